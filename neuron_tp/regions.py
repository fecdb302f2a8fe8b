"""Differentiable communication regions: one function per (forward, backward) pair.

Each function is named for what it does, ``<forward>_fwd_<backward>_bwd``, over one mesh
:class:`~neuron_tp.mesh.Group` and one tensor dim. The layers choose the pair that matches the
layouts around them (e.g. an all-gather whose consumer is sharded over the same group must
reduce-scatter its gradient; one whose consumer is replicated only keeps its chunk).

The Megatron role names at the end (``copy_to_tensor_parallel`` ...) are aliases kept for
readers who know Megatron's 1D layers; everything else uses the operation names.
"""

from __future__ import annotations

import torch

from . import comm
from .mesh import Group

__all__ = [
    "identity_fwd_all_reduce_bwd",
    "all_reduce_fwd_identity_bwd",
    "all_reduce_fwd_all_reduce_bwd",
    "split_fwd_all_gather_bwd",
    "all_gather_fwd_split_bwd",
    "all_gather_fwd_reduce_scatter_bwd",
    "reduce_scatter_fwd_all_gather_bwd",
    # Megatron role names (aliases)
    "copy_to_tensor_parallel",
    "reduce_from_tensor_parallel",
    "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel",
    "scatter_to_sequence_parallel",
    "gather_from_sequence_parallel",
    "reduce_scatter_to_sequence_parallel",
]


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.local_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g.contiguous(), ctx.group, ctx.dim), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.all_gather(x.contiguous(), group, dim)

    @staticmethod
    def backward(ctx, g):
        return comm.local_chunk(g, ctx.group, ctx.dim), None, None


class _GatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.all_gather(x.contiguous(), group, dim)

    @staticmethod
    def backward(ctx, g):
        return comm.reduce_scatter(g.contiguous(), ctx.group, ctx.dim), None, None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.reduce_scatter(x.contiguous(), group, dim)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g.contiguous(), ctx.group, ctx.dim), None, None


class _AllReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g, ctx.group), None


def identity_fwd_all_reduce_bwd(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: identity, backward: all-reduce (a replicated input feeding sharded compute)."""
    return x if group.size == 1 else _Copy.apply(x, group)


def all_reduce_fwd_identity_bwd(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-reduce, backward: identity (partial sums into a replicated consumer)."""
    return x if group.size == 1 else _Reduce.apply(x, group)


def all_reduce_fwd_all_reduce_bwd(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-reduce, backward: all-reduce (every rank uses the sum on its own local
    data, e.g. the statistics of a norm over sharded features)."""
    return x if group.size == 1 else _AllReduceBoth.apply(x, group)


def split_fwd_all_gather_bwd(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """forward: keep this rank's chunk of ``dim``, backward: all-gather."""
    return x if group.size == 1 else _Split.apply(x, group, dim)


def all_gather_fwd_split_bwd(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """forward: all-gather along ``dim``, backward: keep this rank's chunk (the consumer is
    replicated over ``group``)."""
    return x if group.size == 1 else _Gather.apply(x, group, dim)


def all_gather_fwd_reduce_scatter_bwd(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """forward: all-gather along ``dim``, backward: reduce-scatter (the consumer is sharded
    over ``group``, so each rank holds a partial gradient of the whole)."""
    return x if group.size == 1 else _GatherReduceScatter.apply(x, group, dim)


def reduce_scatter_fwd_all_gather_bwd(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """forward: reduce-scatter along ``dim``, backward: all-gather."""
    return x if group.size == 1 else _ReduceScatter.apply(x, group, dim)


# Megatron role names (1D tensor / sequence parallelism). Tensor-parallel regions act on the
# hidden (last) dim by default, sequence-parallel ones on dim 1 (HF models are batch-first).


def copy_to_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Alias of :func:`identity_fwd_all_reduce_bwd`."""
    return identity_fwd_all_reduce_bwd(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Alias of :func:`all_reduce_fwd_identity_bwd`."""
    return all_reduce_fwd_identity_bwd(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Alias of :func:`split_fwd_all_gather_bwd` (hidden dim by default)."""
    return split_fwd_all_gather_bwd(x, group, dim)


def gather_from_tensor_parallel(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """Alias of :func:`all_gather_fwd_split_bwd` (hidden dim by default)."""
    return all_gather_fwd_split_bwd(x, group, dim)


def scatter_to_sequence_parallel(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Alias of :func:`split_fwd_all_gather_bwd` (sequence dim 1 by default)."""
    return split_fwd_all_gather_bwd(x, group, dim)


def gather_from_sequence_parallel(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Alias of :func:`all_gather_fwd_reduce_scatter_bwd` (sequence dim 1 by default)."""
    return all_gather_fwd_reduce_scatter_bwd(x, group, dim)


def reduce_scatter_to_sequence_parallel(
    x: torch.Tensor, group: Group, dim: int = 1
) -> torch.Tensor:
    """Alias of :func:`reduce_scatter_fwd_all_gather_bwd` (sequence dim 1 by default)."""
    return reduce_scatter_fwd_all_gather_bwd(x, group, dim)
