"""The one module that calls collectives.

XLA tensors get torch-xla collectives with replica groups (the rank lists of the mesh);
other tensors get ``torch.distributed`` calls on the group's process group (gloo on CPU, NCCL on
GPU). A group of size one communicates nothing. All functions are plain (not autograd); the
differentiable versions live in :mod:`neuron_tp.parallel.regions`.

XLA collectives come in two forms, chosen in one place (:func:`_channel_form`): on Neuron, and
for virtual (trace-only) meshes, exactly what neuronx-distributed emits (no channel ids); on a
multi-device CPU runtime (``xmp.spawn`` with ``CPU_NUM_DEVICES=N``) the channel-id form with
global device ids, the only one XLA:CPU can execute across its device threads. torch-xla 2.9
has no channel-id all-to-all or collective-permute, so on that runtime :func:`all_to_all` and
:func:`ring_shift` are carried by a channel-id all-gather (same values, ``group.size`` times the
bytes; Neuron gets the real all-to-all and collective-permute).
"""

from __future__ import annotations

import torch

from ..backend import xla as _xla
from .mesh import Group

__all__ = [
    "all_reduce",
    "all_reduce_max",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "local_chunk",
    "ring_shift",
    "all_reduce_coalesced",
    "accumulation_dtype",
]


def _replica_groups(group: Group) -> list[list[int]]:
    return [list(g) for g in group.all_groups]


def _channel_form(group: Group) -> bool:
    """True when ``group``'s XLA collectives need channel ids (multi-device CPU runtime)."""
    return not group.virtual and _xla.cpu_runtime()


def _channel_kwargs(group: Group) -> dict:
    """Extra arguments of xm.all_gather / xm.reduce_scatter in the channel-id form. One id
    for every op is enough: every device runs the same program, ops meet in program order."""
    return dict(channel_id=1, use_global_device_ids=True) if _channel_form(group) else {}


def _check(x: torch.Tensor, group: Group) -> bool:
    """True when ``x`` goes through torch-xla; errors for impossible combinations."""
    if _xla.is_xla(x):
        return True
    if group.virtual:
        raise RuntimeError(
            f"a virtual (trace-only) mesh can only run on XLA tensors, got a {x.device} tensor; "
            "move the module and inputs to the XLA device (neuron_tp.xla_device())"
        )
    if group.process_group is None:
        raise RuntimeError(
            f"group {group.name!r} has no torch.distributed process group (the job uses the xla "
            f"backend, or was not initialised with init_mesh); got a {x.device} tensor"
        )
    return False


def accumulation_dtype(x: torch.Tensor, group: Group) -> torch.dtype:
    """The dtype a sum of ``x`` over ``group`` accumulates in: the group's ``reduce_dtype`` for
    floats of fewer bits, else ``x.dtype``."""
    rd = group.reduce_dtype
    if rd is None or not x.is_floating_point() or x.dtype.itemsize >= rd.itemsize:
        return x.dtype
    return rd


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over the group (in the group's ``reduce_dtype`` if wider); returns a new
    tensor."""
    if group.size == 1:
        return x
    wide = accumulation_dtype(x, group)
    if wide != x.dtype:
        return _all_reduce(x.to(wide), group).to(x.dtype)
    return _all_reduce(x, group)


def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    if _check(x, group):
        import torch_xla

        # Call the op directly: xm.all_reduce is a no-op when the *runtime* world is one
        # device, which is exactly the virtual (trace-only) case.
        xm = _xla.xm()
        if _channel_form(group):
            # 1-D operand: XLA:CPU fails to lay out some 2-D channel-id all-reduces. The result
            # is a fresh tensor, not a view: callers modify it in place (Falcon's ``+=``),
            # which autograd forbids on a view made inside a Function.
            flat = torch_xla._XLAC._xla_spmd_all_reduce(
                xm.REDUCE_SUM, x.reshape(-1), 1.0, _replica_groups(group)
            )
            return flat.view(x.shape).clone()
        return torch_xla._XLAC._xla_all_reduce(xm.REDUCE_SUM, x, 1.0, _replica_groups(group), False)
    import torch.distributed as dist

    out = x.clone()
    dist.all_reduce(out, group=group.process_group)
    return out


def all_reduce_max(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Elementwise maximum of ``x`` over the group (exact in any dtype); returns a new tensor.
    Not differentiable (e.g. int8 weight scales over a row-parallel weight's full rows)."""
    if group.size == 1:
        return x
    if _check(x, group):
        import torch_xla

        xm = _xla.xm()
        if _channel_form(group):  # 1-D operand, as in _all_reduce
            flat = torch_xla._XLAC._xla_spmd_all_reduce(
                xm.REDUCE_MAX, x.reshape(-1), 1.0, _replica_groups(group)
            )
            return flat.view(x.shape).clone()
        return torch_xla._XLAC._xla_all_reduce(xm.REDUCE_MAX, x, 1.0, _replica_groups(group), False)
    import torch.distributed as dist

    out = x.clone()
    dist.all_reduce(out, op=dist.ReduceOp.MAX, group=group.process_group)
    return out


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """Sum a list of tensors over the group in one collective (flattened into one buffer)."""
    if group.size == 1 or not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors])
    flat = all_reduce(flat, group)
    return [chunk.view_as(t) for chunk, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


def all_gather(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in group order."""
    if group.size == 1:
        return x
    dim = dim % x.dim()
    if _check(x, group):
        return _xla.xm().all_gather(
            x, dim=dim, groups=_replica_groups(group), pin_layout=False, **_channel_kwargs(group)
        )
    import torch.distributed as dist

    src = x.contiguous()
    out = src.new_empty((group.size * src.shape[0], *src.shape[1:]))
    dist.all_gather_into_tensor(out, src, group=group.process_group)
    if dim == 0:
        return out
    # A contiguous result (a strided movedim view made e.g. gathered logits slow downstream).
    return torch.cat(out.view(group.size, *src.shape).unbind(0), dim)


def reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group (in the group's ``reduce_dtype`` if wider) and keep this rank's
    chunk along ``dim``."""
    if group.size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % group.size:
        raise ValueError(
            f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not divisible "
            f"by the group size {group.size}"
        )
    wide = accumulation_dtype(x, group)
    if wide != x.dtype:
        return _reduce_scatter(x.to(wide), group, dim).to(x.dtype)
    return _reduce_scatter(x, group, dim)


def _reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if _check(x, group):
        xm = _xla.xm()
        return xm.reduce_scatter(
            xm.REDUCE_SUM,
            x,
            scale=1.0,
            scatter_dim=dim,
            shard_count=group.size,
            groups=_replica_groups(group),
            pin_layout=False,
            **_channel_kwargs(group),
        )
    import torch.distributed as dist

    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // group.size, *src.shape[1:]))
    dist.reduce_scatter_tensor(out, src, group=group.process_group)
    if dim == 0:
        return out
    # A fresh tensor, not a movedim view: callers may modify it in place (Falcon's
    # ``mlp_output += attention_output``), which autograd forbids on a view made in a Function.
    return out.movedim(0, dim).clone(memory_format=torch.contiguous_format)


def all_to_all(x: torch.Tensor, group: Group, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Split ``x`` into ``group.size`` chunks along ``split_dim``, send chunk ``j`` to group rank
    ``j``, and concatenate the chunks received (in group order) along ``concat_dim``: the
    result has ``1/size`` of ``split_dim`` and ``size`` times ``concat_dim`` (the same shape
    when the two dims are one). Its inverse is ``all_to_all(y, group, concat_dim, split_dim)``.
    """
    if x.dim() == 0:
        raise ValueError("all_to_all: needs a tensor with at least one dim, got a scalar")
    for name, d in (("split_dim", split_dim), ("concat_dim", concat_dim)):
        if not -x.dim() <= d < x.dim():
            raise ValueError(
                f"all_to_all: {name}={d} is out of range for shape {tuple(x.shape)} "
                f"(valid: {-x.dim()} .. {x.dim() - 1})"
            )
    split_dim, concat_dim = split_dim % x.dim(), concat_dim % x.dim()
    n = group.size
    if x.shape[split_dim] % n:
        valid = [d for d in range(1, x.shape[split_dim] + 1) if x.shape[split_dim] % d == 0]
        raise ValueError(
            f"all_to_all: split dim {split_dim} of shape {tuple(x.shape)} is not divisible by "
            f"the group size {n} (group {group.name!r}); that dim must be a multiple of {n}, "
            f"or the group one of the sizes {valid}"
        )
    if n == 1:
        return x
    if _check(x, group):
        if _channel_form(group):
            return _all_to_all_by_gather(x, group, split_dim, concat_dim)
        return _xla.xm().all_to_all(
            x.contiguous(),
            split_dim,
            concat_dim,
            n,
            groups=_replica_groups(group),
            pin_layout=False,
        )
    import torch.distributed as dist

    src = x.movedim(split_dim, 0).contiguous()  # chunk j (rows j*c .. (j+1)*c) goes to rank j
    out = torch.empty_like(src)
    dist.all_to_all_single(out, src, group=group.process_group)
    return _concat_received(out, n, split_dim, concat_dim)


def _concat_received(out: torch.Tensor, n: int, split_dim: int, concat_dim: int) -> torch.Tensor:
    """``out`` holds the chunk from source ``s`` at rows ``s*c .. (s+1)*c`` of its dim 0 (the
    split dim moved first): the chunks put back in place and concatenated along
    ``concat_dim``, as one contiguous tensor."""
    chunks = out.unflatten(0, (n, out.shape[0] // n)).movedim(1, split_dim + 1)
    # chunks: [n, *chunk_shape]; fold the source dim into concat_dim (source-major).
    return chunks.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1).contiguous()


def _all_to_all_by_gather(
    x: torch.Tensor, group: Group, split_dim: int, concat_dim: int
) -> torch.Tensor:
    """The all-to-all on XLA:CPU devices: every rank's ``x`` all-gathered (channel-id form),
    then this rank's chunk of each kept, chosen with a device-side rank tensor (one graph for
    every rank)."""
    n = group.size
    full = all_gather(x.unsqueeze(0), group, 0)  # [n sources, *x.shape]
    c = x.shape[split_dim] // n
    parts = full.unflatten(split_dim + 1, (n, c))  # [n src, ..., n dest, c, ...]
    mine = parts.index_select(split_dim + 1, group.rank_tensor(x.device)).squeeze(split_dim + 1)
    return mine.movedim(0, concat_dim).flatten(concat_dim, concat_dim + 1).contiguous()


def local_chunk(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication).

    On XLA the chunk is chosen with a device-side rank tensor, so all ranks trace one graph.
    """
    if group.size == 1:
        return x
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group.size:
        raise ValueError(
            f"cannot split dim {dim} of shape {tuple(x.shape)} into {group.size} equal parts"
        )
    if not _xla.is_xla(x):
        return x.narrow(dim, group.rank * (n // group.size), n // group.size)
    parts = x.unflatten(dim, (group.size, n // group.size))
    return parts.index_select(dim, group.rank_tensor(x.device).view(1)).squeeze(dim)


def ring_shift(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Send ``x`` to the next rank of the group's ring (group rank ``r`` to ``r + 1 mod n``)
    and return what the previous rank sent: one collective every rank of the group runs.
    XLA: collective-permute (on XLA:CPU devices a channel-id all-gather and a device-side pick
    of the previous rank's part); gloo: a send and a receive."""
    n = group.size
    if n == 1:
        return x
    if _check(x, group):
        if _channel_form(group):
            full = all_gather(x.unsqueeze(0), group, 0)  # [n, *x.shape]
            prev = (group.rank_tensor(x.device) + (n - 1)) % n
            return full.index_select(0, prev).squeeze(0)
        pairs = [[g[i], g[(i + 1) % n]] for g in group.all_groups for i in range(n)]
        return _xla.xm().collective_permute(x.contiguous(), pairs)
    import torch.distributed as dist

    src = x.contiguous()
    out = torch.empty_like(src)
    nxt, prv = group.ranks[(group.rank + 1) % n], group.ranks[(group.rank - 1) % n]
    ops = [
        dist.P2POp(dist.isend, src, nxt, group=group.process_group),
        dist.P2POp(dist.irecv, out, prv, group=group.process_group),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return out
