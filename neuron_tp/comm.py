"""The one module that calls collectives.

XLA tensors get torch-xla collectives with replica groups (the rank lists of the mesh);
other tensors get ``torch.distributed`` calls on the group's process group (gloo on CPU, NCCL on
GPU). A group of size one communicates nothing. All functions are plain (not autograd); the
differentiable versions live in :mod:`neuron_tp.regions`.
"""
from __future__ import annotations

import torch

from . import _xla
from .mesh import Group

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "local_chunk", "all_reduce_coalesced"]


def _replica_groups(group: Group) -> list[list[int]]:
    return [list(g) for g in group.all_groups]


def _check(x: torch.Tensor, group: Group) -> bool:
    """True when ``x`` goes through torch-xla; errors for impossible combinations."""
    if _xla.is_xla(x):
        return True
    if group.virtual:
        raise RuntimeError(
            f"a virtual (trace-only) mesh can only run on XLA tensors, got a {x.device} tensor; "
            "move the module and inputs to the XLA device (neuron_tp.xla_device())")
    if group.process_group is None:
        raise RuntimeError(
            f"group {group.name!r} has no torch.distributed process group (the job uses the xla "
            f"backend, or was not initialised with init_mesh); got a {x.device} tensor")
    return False


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum ``x`` over the group; returns a new tensor."""
    if group.size == 1:
        return x
    if _check(x, group):
        import torch_xla
        # Call the op directly: xm.all_reduce is a no-op when the *runtime* world is one
        # device, which is exactly the virtual (trace-only) case.
        xm = _xla.xm()
        return torch_xla._XLAC._xla_all_reduce(xm.REDUCE_SUM, x, 1.0, _replica_groups(group),
                                               False)
    import torch.distributed as dist
    out = x.clone()
    dist.all_reduce(out, group=group.process_group)
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
        return _xla.xm().all_gather(x, dim=dim, groups=_replica_groups(group), pin_layout=False)
    import torch.distributed as dist
    src = x.contiguous()
    out = src.new_empty((group.size * src.shape[0], *src.shape[1:]))
    dist.all_gather_into_tensor(out, src, group=group.process_group)
    if dim == 0:
        return out
    # A contiguous result (a strided movedim view made e.g. gathered logits slow downstream).
    return torch.cat(out.view(group.size, *src.shape).unbind(0), dim)


def reduce_scatter(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk along ``dim``."""
    if group.size == 1:
        return x
    dim = dim % x.dim()
    if x.shape[dim] % group.size:
        raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(x.shape)} is not divisible "
                         f"by the group size {group.size}")
    if _check(x, group):
        xm = _xla.xm()
        return xm.reduce_scatter(xm.REDUCE_SUM, x, scale=1.0, scatter_dim=dim,
                                 shard_count=group.size, groups=_replica_groups(group),
                                 pin_layout=False)
    import torch.distributed as dist
    src = x.movedim(dim, 0).contiguous()
    out = src.new_empty((src.shape[0] // group.size, *src.shape[1:]))
    dist.reduce_scatter_tensor(out, src, group=group.process_group)
    if dim == 0:
        return out
    # A fresh tensor, not a movedim view: callers may modify it in place (Falcon's
    # ``mlp_output += attention_output``), which autograd forbids on a view made in a Function.
    return out.movedim(0, dim).clone(memory_format=torch.contiguous_format)


def local_chunk(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication).

    On XLA the chunk is chosen with a device-side rank tensor, so all ranks trace one graph.
    """
    if group.size == 1:
        return x
    dim = dim % x.dim()
    n = x.shape[dim]
    if n % group.size:
        raise ValueError(f"cannot split dim {dim} of shape {tuple(x.shape)} into "
                         f"{group.size} equal parts")
    if not _xla.is_xla(x):
        return x.narrow(dim, group.rank * (n // group.size), n // group.size)
    parts = x.unflatten(dim, (group.size, n // group.size))
    return parts.index_select(dim, group.rank_tensor(x.device).view(1)).squeeze(dim)
