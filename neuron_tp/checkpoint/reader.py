"""Loading a checkpoint: read and check everything first, agree, then apply.

Phase 1 reads this rank's tensors (verifying their checksums), the optimizer state, the RNG
state and checks the scheduler state, modifying nothing; an exception of any type on any rank
makes every rank raise (model, optimizer, scheduler and RNG untouched everywhere). Phase 2
applies what was staged.
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..optim import zero1_state
from ..parallel.mesh import Mesh
from ..parallel.sharding import ParamMeta, experts_piece, named_parameter_meta
from ..parallel.state import mesh_of, stage_of
from . import zero1_files
from .agree import agree
from .buffers import apply_buffers, read_buffers
from .format import CheckpointError, file_record, read_meta, shard_file, verify
from .reshard import assemble, local_piece, logical_shape
from .writer import device_of, is_zero1
from .zero1_files import DpShards


class Shards:
    """Lazy, verifying readers of a checkpoint's tp shard files; with ``dp_shards`` (a ZeRO-1
    state, :mod:`.zero1_files`) ``optim/`` tensors come from the per-(tp, dp) files, joined
    over dp; with ``stage_of`` (a pipeline checkpoint: parameter or buffer name -> stage) each
    tensor from its stage's files."""

    def __init__(
        self,
        path: str,
        tp: int,
        step: int | None = None,
        dp_shards: int | None = None,
        tp_mode: str = "1d",
        stage_of: Mapping[str, int] | None = None,
    ):
        self.path, self.tp, self.step = path, tp, step
        self.handles: dict[tuple[int | None, int], Any] = {}
        self.tp_mode = tp_mode
        self.stage_of = stage_of
        self.optim = DpShards(path, tp, dp_shards, step, stage_of) if dp_shards else None

    @classmethod
    def of(cls, path: str, meta: dict) -> Shards:
        """The readers of checkpoint ``path`` whose metadata is ``meta``."""
        saved = meta["mesh"]
        dp_shards = (meta.get("optimizer") or {}).get("dp_shards")
        stages = None
        if saved.get("pp", 1) > 1:
            recs = {**meta["params"], **(meta.get("buffers") or {})}
            stages = {n: int(r.get("stage", 0)) for n, r in recs.items()}
        mode = saved.get("tp_mode", "1d")
        return cls(path, saved["tp"], meta.get("step"), dp_shards, mode, stages)

    def stage(self, key: str) -> int | None:
        """The pipeline stage whose file holds tensor ``key`` (None: pp 1)."""
        if self.stage_of is None:
            return None
        kind, rest = key.split("/", 1)
        name = rest.rsplit("/", 1)[0] if kind == "optim" else rest
        return self.stage_of.get(name, 0)

    def file(self, tp_rank: int, stage: int | None = None) -> str:
        return shard_file(self.path, tp_rank, stage)

    def _open(self, tp_rank: int, stage: int | None):
        from safetensors import safe_open

        if (stage, tp_rank) not in self.handles:
            f = self.file(tp_rank, stage)
            try:
                handle = safe_open(f, "pt")
                header = handle.metadata()
            except Exception as e:  # noqa: BLE001 - missing/corrupt file: one clear message
                raise CheckpointError(f"{f}: unreadable checkpoint shard ({e})") from None
            rec = file_record(f, header)
            if rec is not None and (
                rec.get("tp_rank") != tp_rank
                or (self.step is not None and rec.get("step") != self.step)
                or rec.get("pp_rank") != stage
            ):
                where = "" if stage is None else f" of pipeline stage {stage}"
                raise CheckpointError(
                    f"{f}: holds tp rank {rec.get('tp_rank')} (stage {rec.get('pp_rank')}) of "
                    f"step {rec.get('step')}, expected tp rank {tp_rank}{where} of step "
                    f"{self.step} (a file from another checkpoint?)"
                )
            self.handles[stage, tp_rank] = (handle, rec)
        return self.handles[stage, tp_rank]

    def get(self, tp_rank: int, key: str) -> torch.Tensor:
        if self.optim is not None and key.startswith("optim/"):
            return self.optim.joined(tp_rank, key)
        stage = self.stage(key)
        handle, rec = self._open(tp_rank, stage)
        try:
            t = handle.get_tensor(key)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"{self.file(tp_rank, stage)}: tensor {key!r} missing or unreadable ({e})"
            ) from None
        return verify(self.file(tp_rank, stage), key, t, rec)

    def keys(self, tp_rank: int) -> set[str]:
        optim = self.optim.keys(tp_rank) if self.optim is not None else set()
        stages: list[int | None] = [None]
        if self.stage_of:
            stages = list(sorted(set(self.stage_of.values())))
        return {k for s in stages for k in self._open(tp_rank, s)[0].keys()} | optim

    def full(self, key: str, rec: dict) -> torch.Tensor:
        """The unsharded tensor ``key`` of a parameter recorded as ``rec``, assembled from the
        saved tp ranks' pieces in the saved layout. A piece replicated over a mesh axis (2D/3D)
        is used once; the other copies are still read one at a time for their checksums."""
        read = set()

        def get(r: int) -> torch.Tensor:
            read.add(r)
            return self.get(r, key)

        full = assemble(get, rec["sharding"], self.tp, self.tp_mode)
        if rec["sharding"] is not None:
            for r in range(self.tp):
                if r not in read:
                    self.get(r, key)  # verified, dropped
        return full


def saved_names(model: torch.nn.Module) -> dict[str, str]:
    """``{name in model: name in a checkpoint}`` of every parameter of ``model``: the same
    but for a pipeline stage's copies of another stage's parameter (a tied table)."""
    stage = stage_of(model)
    return {
        n: (stage.saved_name(n) if stage is not None else n) for n, _ in model.named_parameters()
    }


def check_model(meta: dict, model: torch.nn.Module, path: str) -> None:
    """:class:`CheckpointError` unless checkpoint ``path`` (metadata ``meta``) holds the
    parameters of ``model``: the same names and logical (unsharded) shapes. A pipeline stage's
    model is compared as the whole model it is part of (names), its own parameters (shapes)."""
    saved = meta["params"]
    rename = saved_names(model)
    names = {rename[n]: (p, m) for n, p, m in named_parameter_meta(model)}
    stage = stage_of(model)
    whole = set(stage.whole) if stage is not None else set(names)
    missing, unexpected = sorted(whole - set(saved)), sorted(set(saved) - whole)
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the model: parameters missing from the "
            f"checkpoint {missing[:5]}, not in the model {unexpected[:5]}"
        )
    wrong = [
        (n, saved[n]["logical_shape"], list(logical_shape(p, m)))
        for n, (p, m) in names.items()
        if saved[n]["logical_shape"] != list(logical_shape(p, m))
    ]
    if wrong:
        raise CheckpointError(
            f"{path} does not match the model (name, saved shape, model shape): {wrong[:5]}"
        )


@dataclass
class Staged:
    """Everything :func:`load` applies, read and checked."""

    meta: dict
    params: dict
    optim: dict
    zero1: dict | None  # this rank's own ZeRO-1 shard state (same tp and dp layout)
    rng: tuple | None  # (torch cpu state, python state, xla seed or None)
    buffers: dict  # persistent buffers (replicated), by name


def _same_cut(meta: dict, mesh: Mesh, names: Mapping[str, str]) -> bool:
    """True when the checkpoint was cut into the same pipeline stages as this rank's: every
    parameter ``names`` lists (``{here: saved}``) saved by this rank's stage."""
    if meta["mesh"].get("pp", 1) != mesh.pp_size:
        return False
    return mesh.pp_size == 1 or all(
        meta["params"][saved].get("stage") == mesh.pp.rank for saved in names.values()
    )


def _own_zero1(
    path: str,
    meta: dict,
    shards: Shards,
    optimizer,
    mesh: Mesh,
    *,
    same: bool,
    rename: Mapping[str, str],
):
    """This rank's own ZeRO-1 shard state when the checkpoint has the same layout (``same``:
    tp and pipeline stages; dp, ep), else None (then it is read per parameter, joined).
    ``rename``: ``{name here: saved name}`` of the model's parameters."""
    saved_mesh = meta["mesh"]
    dp_shards, saved_ep = shards.optim.dp if shards.optim else None, saved_mesh.get("ep", 1)
    own = (
        same
        and is_zero1(optimizer)
        and (dp_shards, saved_ep) == (optimizer.group.size, mesh.ep_size)  # dp (x cp)
    )
    if optimizer is not None and dp_shards and saved_ep > 1 and not own:
        raise CheckpointError(
            f"{path}: a ZeRO-1 state of an expert-parallel run (ep={saved_ep}, tp="
            f"{saved_mesh['tp']}, dp={dp_shards}) resumes with ZeRO-1 at the same tp, dp and "
            f"ep only; this run has tp={mesh.tp_size}, dp={mesh.dp_size}, ep={mesh.ep_size} "
            "(the model weights alone load at any layout)"
        )
    if not own:
        return None
    assert shards.optim is not None
    names = rename if mesh.pp_size > 1 else None
    return zero1_files.stage_shard(shards.optim, optimizer, mesh, path, names)


def _read_tensors(path: str, meta: dict, model, optimizer, mesh: Mesh) -> tuple:
    saved_mesh = meta["mesh"]
    rename = saved_names(model)
    same = saved_mesh["tp"] == mesh.tp_size and saved_mesh.get("tp_mode", "1d") == mesh.tp_mode
    shards = Shards.of(path, meta)
    own_layout = same and _same_cut(meta, mesh, rename)
    zero1 = _own_zero1(path, meta, shards, optimizer, mesh, same=own_layout, rename=rename)

    def piece(name: str, key: str, pmeta: ParamMeta) -> torch.Tensor:
        rec = meta["params"][name]
        if same:  # the files hold every expert: this rank's under expert parallelism
            return experts_piece(shards.get(mesh.tp_rank, key), pmeta.sharding, mesh)
        return local_piece(shards.full(key, rec), rec["hf"], pmeta, mesh)

    params, optim = {}, {}
    src = mesh.tp_rank if same else 0
    optim_keys = shards.keys(src) if optimizer is not None else set()
    for here, p, pmeta in named_parameter_meta(model):
        name = rename[here]  # its name in the checkpoint
        t = piece(name, f"model/{name}", pmeta)
        if tuple(t.shape) != tuple(p.shape):
            raise CheckpointError(
                f"{path}: {name} has shape {tuple(t.shape)} for this rank, "
                f"the model's is {tuple(p.shape)}"
            )
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):  # e.g. an old
            raise CheckpointError(  # (checksum-less) checkpoint of a diverged run
                f"{path}: parameter {name} holds non-finite values (NaN/inf): the run that "
                "saved it had diverged; resume from an earlier checkpoint"
            )
        params[here] = t
        if optimizer is not None and zero1 is None:
            keys = [
                k
                for k in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master")
                if f"optim/{name}/{k}" in optim_keys
            ]
            optim[here] = {
                k: (
                    shards.get(src, f"optim/{name}/{k}")
                    if k == "step"
                    else piece(name, f"optim/{name}/{k}", pmeta)
                )
                for k in keys
            }
    if (
        optimizer is not None
        and meta["optimizer"]
        and meta["optimizer"]["groups"] != len(optimizer.param_groups)
    ):
        raise CheckpointError(
            f"{path}: optimizer had {meta['optimizer']['groups']} parameter "
            f"groups, this one has {len(optimizer.param_groups)}"
        )
    return params, optim, zero1


def _read_rng(path: str, rank: int) -> tuple:
    """This rank's RNG states, checked by applying them to throwaway generators."""
    from safetensors import safe_open

    base = os.path.join(path, f"rng-rank{rank:05d}")
    try:
        with safe_open(base + ".safetensors", "pt") as fh:
            rec = file_record(base + ".safetensors", fh.metadata())
            t = verify(base + ".safetensors", "torch_cpu", fh.get_tensor("torch_cpu"), rec)
        with open(base + ".json") as fh:
            j = json.load(fh)
        torch.Generator().set_state(t)
        py = _tuples(j["python"])
        random.Random().setstate(py)
        xla = int(j["xla_seed"]) if "xla_seed" in j else None
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{base}: unreadable RNG state ({e})") from None
    return t, py, xla


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _stage(path: str, model, optimizer, scheduler, mesh: Mesh, restore_rng: bool) -> Staged:
    meta = read_meta(path)
    check_model(meta, model, path)
    params, optim, zero1 = _read_tensors(path, meta, model, optimizer, mesh)
    first = Shards.of(path, meta)
    part = stage_of(model) is not None  # a pipeline stage holds some of the buffers
    buffers = read_buffers(lambda key: first.get(0, key), meta, model, path, part=part)
    if scheduler is not None and meta.get("scheduler") is not None:
        try:  # on a shallow copy: the scheduler itself is not touched
            copy.copy(scheduler).load_state_dict(copy.deepcopy(meta["scheduler"]))
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"{path}: scheduler state does not fit {type(scheduler).__name__} ({e})"
            ) from None
    rng = None
    if restore_rng and meta["mesh"]["world_size"] == mesh.world_size:
        rng = _read_rng(path, mesh.rank)
    return Staged(meta, params, optim, zero1, rng, buffers)


def _apply(model, optimizer, scheduler, s: Staged) -> None:
    if scheduler is not None and s.meta.get("scheduler") is not None:
        scheduler.load_state_dict(copy.deepcopy(s.meta["scheduler"]))
    if s.rng is not None:
        torch.set_rng_state(s.rng[0])
        random.setstate(s.rng[1])
        if s.rng[2] is not None:
            import torch_xla.core.xla_model as xm

            xm.set_rng_state(s.rng[2])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(s.params[name].to(p.dtype))
    apply_buffers(model, s.buffers)
    if s.zero1 is not None:  # ZeRO-1 at the saved layout: its own shard (params loaded above)
        zero1_state.load_state_dict(optimizer, s.zero1, gather=False)
    elif is_zero1(optimizer):  # ZeRO-1 from a full state: this rank's dp chunks
        _apply_zero1(model, optimizer, s)
    elif optimizer is not None:
        capturable = {
            id(p): g.get("capturable", False) for g in optimizer.param_groups for p in g["params"]
        }
        for name, p in model.named_parameters():
            st = {}
            for k, v in s.optim.get(name, {}).items():
                if k == "master":  # a ZeRO-1 fp32 master: the parameter holds its value
                    continue
                if k != "step" and v.is_floating_point():  # ZeRO-1 saves fp32 moments
                    v = v.to(p.dtype)
                on_device = k != "step" or capturable.get(id(p), False)
                st[k] = v.to(p.device) if on_device else v
            if st:
                optimizer.state[p] = st


def _apply_zero1(model, optimizer, s: Staged) -> None:
    """The per-parameter state (saved with or without ZeRO-1, at any dp degree) into a
    :class:`~neuron_tp.optim.zero1.Zero1`; its hyperparameters stay (the schedule sets the lr)."""
    params = {}
    for name, p in model.named_parameters():
        if name not in optimizer.slots:
            continue
        st = dict(s.optim.get(name, {}))
        master = st.pop("master", None)
        params[name] = {"shape": tuple(p.shape), "state": st, "master": master}
    groups = zero1_state.groups_meta(optimizer)
    optimizer.load_full_state_dict(
        {"format": zero1_state.FULL_FORMAT, "params": params, "param_groups": groups}
    )


def load(
    path: str,
    model: torch.nn.Module,
    optimizer=None,
    scheduler=None,
    mesh: Mesh | None = None,
    restore_rng: bool = True,
) -> dict:
    """Load checkpoint ``path`` into ``model`` (and optimizer, scheduler, RNG); returns its
    metadata. Another tp degree or mode (1d/2d/3d) is resharded from the files. Everything
    is read and verified (checksums) before anything is modified; any failure on any rank
    raises :class:`CheckpointError` on every rank with nothing modified."""
    mesh, device = mesh_of(model, mesh), device_of(model)
    what = f"loading {path}"
    staged, error = None, None
    try:
        staged = _stage(path, model, optimizer, scheduler, mesh, restore_rng)
    except Exception as e:  # noqa: BLE001 - any failure takes the agreed path
        error = e
    agree(mesh, device, what, error)
    assert staged is not None  # agree raised otherwise
    error = None
    try:
        _apply(model, optimizer, scheduler, staged)
    except Exception as e:  # noqa: BLE001 - not expected after the checks; never a hang
        error = e
    agree(mesh, device, what, error)
    return staged.meta
