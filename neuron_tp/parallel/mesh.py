"""The device mesh: which ranks talk to which, computed once, as plain rank lists.

World = pp x dp x cp x tp, with ranks laid out
``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``: a tensor-parallel group is
a block of contiguous ranks (the NeuronCores of one node), the context-parallel ring next to it,
and pipeline stages outermost (so stages can sit on different nodes). Each axis' group varies
its own index with the others fixed; ``dp_cp`` varies dp and cp together (parameters are
replicated over both: gradients reduce over it; it is ``dp`` when cp = 1). With expert
parallelism (``ep > 1``, dividing dp) the dp ranks are also cut into blocks of ``ep``
consecutive dp ranks: an ``ep`` group (one block) shares its MoE experts out, and an ``edp``
group (the same place in every block) holds copies of the same experts. In 2D mode the tp group is a
``q x q`` grid (``tp_rank = row * q + col``); in 3D mode a ``q x q x q`` cube
(``tp_rank = (i * q + j) * q + l``). Every group of every axis is listed, so the same lists give
XLA replica groups and torch.distributed process groups.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backend import xla as _xla
from . import store
from .layout import ParallelLayout, divisors, grid_side


@dataclass(eq=False)
class Group:
    """One axis of the mesh as seen from this rank."""

    name: str
    ranks: tuple[int, ...]  # world ranks of this rank's group, in group order
    all_groups: tuple[tuple[int, ...], ...]  # every group of the axis (XLA replica groups)
    rank: int  # this rank's index inside ``ranks``
    virtual: bool = False  # trace-only: XLA tensors only, nothing executes
    process_group: Any = field(default=None, repr=False)
    # Sums (all-reduce, reduce-scatter) of lower-precision floats accumulate in this dtype
    # (e.g. fp32 for a bf16 model), then cast back; None: in the tensor's own dtype.
    reduce_dtype: torch.dtype | None = None
    _rank_tensors: dict = field(default_factory=dict, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    def rank_tensor(self, device: torch.device | str) -> torch.Tensor:
        """This rank's index in the group as a ``[1]`` int64 tensor on ``device`` (cached).

        Rank-dependent values must enter XLA graphs as data, never as Python constants, so
        every rank traces the same graph (one Neuron compile, not one per rank). Not 0-d:
        torch-xla turns 0-d tensors holding 0 or 1 into graph constants.
        """
        key = str(device)
        if key not in self._rank_tensors:
            self._rank_tensors[key] = torch.tensor([self.rank], device=device)
        return self._rank_tensors[key]


def valid_tp_degrees(world_size: int, *sizes: int) -> list[int]:
    """The tp degrees that divide ``world_size`` and every one of ``sizes`` (heads, features...):
    the list error messages offer when a size cannot be split over the requested tp."""
    return [d for d in divisors(world_size) if all(s % d == 0 for s in sizes)]


def _tp_axes(tp_mode: str, tp: int) -> dict[str, list[list[int]]]:
    """tp-local rank lists of each axis of the tensor-parallel group."""
    axes = {"tp": [list(range(tp))]}
    q = grid_side(tp, tp_mode)
    if tp_mode == "2d":
        # row group: same row, varying column; col group: same column, varying row.
        axes["row"] = [[r * q + c for c in range(q)] for r in range(q)]
        axes["col"] = [[r * q + c for r in range(q)] for c in range(q)]
    elif tp_mode == "3d":

        def idx(i: int, j: int, l: int) -> int:
            return (i * q + j) * q + l

        r = range(q)
        axes["input"] = [[idx(i, j, l) for i in r] for j in r for l in r]  # vary i
        axes["weight"] = [[idx(i, j, l) for j in r] for i in r for l in r]  # vary j
        axes["output"] = [[idx(i, j, l) for l in r] for i in r for j in r]  # vary l
        axes["input_weight"] = [[idx(i, j, l) for i in r for j in r] for l in r]  # vary i, j
        axes["input_output"] = [[idx(i, j, l) for i in r for l in r] for j in r]  # vary i, l
    return axes


def _axis_lists(
    dims: dict[str, int], ep: int, local_tp: dict[str, list[list[int]]]
) -> dict[str, list[list[int]]]:
    """Every group of every axis of a ``pp x dp x cp x tp`` world, as world-rank lists."""
    pp, dp, cp, tp = dims["pp"], dims["dp"], dims["cp"], dims["tp"]

    def rank(p: int, d: int, c: int, t: int) -> int:
        return ((p * dp + d) * cp + c) * tp + t

    P, D, C, T = range(pp), range(dp), range(cp), range(tp)
    lists: dict[str, list[list[int]]] = {
        "pp": [[rank(p, d, c, t) for p in P] for d in D for c in C for t in T],
        "dp": [[rank(p, d, c, t) for d in D] for p in P for c in C for t in T],
        "cp": [[rank(p, d, c, t) for c in C] for p in P for d in D for t in T],
        "dp_cp": [[rank(p, d, c, t) for d in D for c in C] for p in P for t in T],
        "world": [[rank(p, d, c, t) for p in P for d in D for c in C for t in T]],
    }
    if ep > 1:  # dp rank d = block * ep + j
        blocks, J = range(dp // ep), range(ep)
        lists["ep"] = [
            [rank(p, b * ep + j, c, t) for j in J] for p in P for b in blocks for c in C for t in T
        ]
        lists["edp"] = [
            [rank(p, b * ep + j, c, t) for b in blocks] for p in P for j in J for c in C for t in T
        ]
    for name, local_groups in local_tp.items():
        lists[name] = [
            [rank(p, d, c, t) for t in g] for p in P for d in D for c in C for g in local_groups
        ]
    return lists


class Mesh:
    """pp x dp x cp x tp mesh (tp optionally a 2D grid or 3D cube) with one :class:`Group`
    per axis; with ``ep > 1`` also the ``ep`` and ``edp`` axes over dp (module doc).

    Use :func:`init_mesh` in a real job and :meth:`Mesh.virtual` to trace what one rank of a
    large job would run, on a single XLA device, without executing it.
    """

    def __init__(
        self,
        world_size: int,
        rank: int,
        tp: int = 1,
        tp_mode: str = "1d",
        *,
        virtual: bool = False,
        create_process_groups: bool = False,
        reduce_dtype: torch.dtype | None = None,
        ep: int = 1,
        pp: int = 1,
        cp: int = 1,
    ):
        ParallelLayout(world_size, tp, tp_mode, pp=pp, cp=cp, ep=ep).check()
        if reduce_dtype is not None and not reduce_dtype.is_floating_point:
            raise ValueError(f"reduce_dtype must be a floating dtype (or None), got {reduce_dtype}")
        self.reduce_dtype = reduce_dtype
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of size {world_size}")
        self.world_size, self.rank, self.tp_mode = world_size, rank, tp_mode
        self.virtual = virtual  # type: ignore[method-assign,assignment]  # shadows the classmethod
        dims = {"pp": pp, "dp": world_size // (pp * cp * tp), "cp": cp, "tp": tp}
        lists = _axis_lists(dims, ep, _tp_axes(tp_mode, tp))
        self.groups: dict[str, Group] = {}
        made: dict[tuple[int, ...], Any] = {}  # one process group per distinct rank list
        for name, groups in lists.items():
            mine = next(g for g in groups if rank in g)
            pg = None
            if create_process_groups:
                # Every rank must create every group, in the same order.
                import torch.distributed as dist

                for g in groups:
                    if len(g) == world_size:
                        created = dist.group.WORLD
                    elif len(g) == 1:
                        created = None
                    elif tuple(g) in made:
                        created = made[tuple(g)]
                    else:
                        created = made[tuple(g)] = dist.new_group(g)
                    if g == mine:
                        pg = created
            self.groups[name] = Group(
                name,
                tuple(mine),
                tuple(map(tuple, groups)),
                mine.index(rank),
                virtual,
                pg,
                reduce_dtype,
            )

    @classmethod
    def of(cls, layout: ParallelLayout, rank: int, **kwargs) -> Mesh:
        """Rank ``rank``'s mesh of ``layout`` (``kwargs``: the other keywords of Mesh)."""
        return cls(
            layout.world,
            rank,
            tp=layout.tp,
            tp_mode=layout.tp_mode,
            ep=layout.ep,
            pp=layout.pp,
            cp=layout.cp,
            **kwargs,
        )

    @classmethod
    def virtual(cls, world_size: int, rank: int, tp: int = 1, **degrees) -> Mesh:
        """A trace-only mesh: layers emit XLA collectives for rank ``rank`` of ``world_size``
        (``degrees``: Mesh's other keywords, ``tp_mode``, ``ep``, ``pp``, ``cp``,
        ``reduce_dtype``).

        Only XLA tensors may be fed to its layers; the graph is traced, not executed.
        """
        return cls(world_size, rank, tp=tp, virtual=True, **degrees)

    def group(self, name: str) -> Group:
        try:
            return self.groups[name]
        except KeyError:
            raise ValueError(
                f"mesh ({self.tp_mode}) has no axis {name!r}; axes: {sorted(self.groups)}"
            ) from None

    @property
    def tp(self) -> Group:
        return self.groups["tp"]

    @property
    def grid_side(self) -> int:
        """``q`` of a 2D (``tp = q*q``) or 3D (``tp = q^3``) mesh; 1 on a 1D mesh."""
        return grid_side(self.tp_size, self.tp_mode)

    @property
    def dp(self) -> Group:
        return self.groups["dp"]

    @property
    def pp(self) -> Group:
        """The pipeline axis: this rank's stage is ``pp.rank`` of ``pp.size``."""
        return self.groups["pp"]

    @property
    def cp(self) -> Group:
        """The context-parallel ring: each rank holds 1/cp of the sequence."""
        return self.groups["cp"]

    @property
    def replicas(self) -> Group:
        """The ranks holding the same parameters (dp x cp): gradients are summed over it."""
        return self.groups["dp_cp"]

    @property
    def pp_size(self) -> int:
        return self.pp.size

    @property
    def cp_size(self) -> int:
        return self.cp.size

    @property
    def ep_size(self) -> int:
        """Expert-parallel degree: how many dp ranks share one set of MoE experts out."""
        return self.groups["ep"].size if "ep" in self.groups else 1

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def dp_size(self) -> int:
        return self.dp.size

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    def __repr__(self) -> str:
        kind = "virtual " if self.virtual else ""  # type: ignore[truthy-function]
        return (
            f"{kind}Mesh(world={self.world_size}, rank={self.rank}, dp={self.dp_size}, "
            f"tp={self.tp_size}, tp_mode={self.tp_mode!r}"
            + (f", pp={self.pp_size}" if self.pp_size > 1 else "")
            + (f", cp={self.cp_size}" if self.cp_size > 1 else "")
            + (f", ep={self.ep_size})" if self.ep_size > 1 else ")")
        )


# The default mesh is per thread: under ``xmp.spawn`` every rank is a thread of one process.
# A thread that never set one (a data-loader or autograd worker) falls back to the mesh set
# process-wide, unless threads of this process hold meshes of different ranks (then there is
# no right answer and get_mesh says so instead of silently picking one rank's mesh).
_local = threading.local()
_lock = threading.Lock()
_lock_init = threading.Lock()  # init_mesh: one thread at a time creates the process group
_process_default: Mesh | None = None
_holders: dict[int, int] = {}  # thread id -> rank of the default mesh it set


def set_default_mesh(mesh: Mesh | None) -> None:
    """Make ``mesh`` the one layers use when they are given ``mesh=None`` (in this thread, and
    in threads of this process that never set one)."""
    global _process_default
    _local.mesh = mesh
    with _lock:
        if mesh is None:
            _holders.pop(threading.get_ident(), None)
            if not _holders:
                _process_default = None
        else:
            _holders[threading.get_ident()] = mesh.rank
            _process_default = mesh


def get_mesh(mesh: Mesh | None = None) -> Mesh:
    """``mesh`` itself, or the default mesh; a clear error when neither exists."""
    if mesh is not None:
        return mesh
    found = getattr(_local, "mesh", None)
    if found is None and not hasattr(_local, "mesh"):
        with _lock:
            if len(set(_holders.values())) > 1:
                raise RuntimeError(
                    "no mesh in this thread, and threads of this process hold meshes of "
                    f"different ranks {sorted(set(_holders.values()))} (xmp.spawn): pass mesh= "
                    "or call neuron_tp.set_default_mesh(mesh) in this thread"
                )
            found = _process_default
    if found is None:
        raise RuntimeError("no mesh: call neuron_tp.init_mesh(tp=...) first or pass mesh=")
    return found


def _init_process_group(backend: str | None, world: int) -> None:
    import torch.distributed as dist

    if dist.is_initialized() or world <= 1:
        return
    spawned = _spawned_world()
    if backend is None:
        backend = "xla" if _xla.on_neuron() or spawned else "gloo"
    if backend == "xla" and spawned and _xla.cpu_runtime():
        # Devices are threads of one process: an in-memory store (xla:// would listen on a
        # fixed TCP port, MASTER_PORT or 12355, and collide with any other such job).
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the backend)

        dist.init_process_group(
            "xla", store=dist.HashStore(), rank=spawned[1], world_size=spawned[0]
        )
    elif backend == "xla":
        import torch_xla.distributed.xla_backend  # noqa: F401  (registers the backend)

        dist.init_process_group("xla", init_method="xla://")
    elif store.under_torchrun():  # a store of this attempt's own: nothing of a dead one is read
        rank = int(os.environ["RANK"])
        fresh = store.attempt_store(rank, world)
        dist.init_process_group(
            backend, store=dist.PrefixStore("default_pg", fresh), rank=rank, world_size=world
        )
    else:
        dist.init_process_group(backend)


def _spawned_world() -> tuple[int, int] | None:
    """(world, rank) of this thread when it is one of several XLA devices of a process started
    by ``xmp.spawn`` (no torchrun environment, XLA runtime already up); else None."""
    if "WORLD_SIZE" in os.environ or "torch_xla" not in sys.modules:
        return None
    import torch_xla

    if not torch_xla._XLAC._xla_runtime_is_initialized():
        return None
    return _xla.runtime_world()


def init_mesh(
    tp: int = 1,
    tp_mode: str = "1d",
    backend: str | None = None,
    reduce_dtype: torch.dtype | None = None,
    ep: int = 1,
    *,
    pp: int = 1,
    cp: int = 1,
) -> Mesh:
    """Build the mesh of this job (world = pp x dp x cp x tp) and make it the default.

    ``pp``: pipeline stages (outermost axis); ``cp``: context-parallel degree (the sequence
    split over a ring next to tp). Both 1 by default; see the module doc for the rank layout.

    ``ep``: expert-parallel degree (dividing dp): MoE experts are spread over blocks of ``ep``
    dp ranks and tokens exchanged by all-to-all (:mod:`neuron_tp.moe.expert_parallel`).

    ``reduce_dtype`` (e.g. ``torch.float32`` for a bf16 model): every sum over a group of this
    mesh (row-parallel outputs, sequence-parallel reduce-scatters, input and data-parallel
    gradients, ZeRO-1's reduce-scatter) accumulates lower-precision floats in that dtype, at
    twice the bytes on the wire for bf16; None sums in the tensor's own dtype.

    Uses the existing torch.distributed process group (``xla``, gloo or NCCL); when none
    exists and torchrun's environment says the world is larger than one, creates it
    (``xla`` on Neuron, gloo otherwise, or ``backend``). Inside ``xmp.spawn`` (several XLA
    devices of one process, one thread each) the first thread creates the ``xla`` group. On the
    ``xla`` backend world size and rank come from the XLA runtime (per thread; on Neuron under
    torchrun they equal torch.distributed's).
    """
    import torch.distributed as dist

    with _lock_init:  # xmp.spawn threads: only one may create the process group
        spawned = _spawned_world()
        world = spawned[0] if spawned else int(os.environ.get("WORLD_SIZE", "1"))
        if not dist.is_initialized():
            # Validate before any rendezvous so a bad tp never leaves ranks waiting.
            ParallelLayout(world, tp, tp_mode, pp=pp, cp=cp, ep=ep).check()
        _init_process_group(backend, world)
        if dist.is_available() and dist.is_initialized():
            if dist.get_backend() == "xla":
                world, rank = dist.get_world_size(), dist.get_rank()
                runtime = _xla.runtime_world()  # per thread (xmp.spawn); None: runtime world 1
                if runtime is not None and runtime[0] != world:
                    raise RuntimeError(
                        f"the xla process group has {world} ranks but the XLA "
                        f"runtime has {runtime[0]} devices"
                    )
                world, rank = runtime or (world, rank)
                needs_groups = False
            else:
                world, rank, needs_groups = dist.get_world_size(), dist.get_rank(), True
        else:
            world, rank, needs_groups = 1, 0, False
    mesh = Mesh(
        world,
        rank,
        tp=tp,
        tp_mode=tp_mode,
        create_process_groups=needs_groups,
        reduce_dtype=reduce_dtype,
        ep=ep,
        pp=pp,
        cp=cp,
    )
    set_default_mesh(mesh)
    return mesh
