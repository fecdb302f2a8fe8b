"""Differentiable communication regions: one function per (forward, backward) pair.

Each function is named for what it does, ``<forward>_fwd_<backward>_bwd``, over one mesh
:class:`~neuron_tp.parallel.mesh.Group` and one tensor dim. The layers choose the pair that matches
the layouts around them (e.g. an all-gather whose consumer is sharded over the same group must
reduce-scatter its gradient; one whose consumer is replicated only keeps its chunk).

For readers of Megatron's 1D layers: its ``copy_to_tensor_model_parallel_region`` is
:func:`identity_fwd_all_reduce_bwd`, ``reduce_from_...`` :func:`all_reduce_fwd_identity_bwd`,
``scatter_to_...`` :func:`split_fwd_all_gather_bwd` (hidden dim), ``gather_from_...``
:func:`all_gather_fwd_split_bwd`, and the sequence-parallel ``scatter`` / ``gather`` /
``reduce_scatter_to_sequence_parallel_region`` are :func:`split_fwd_all_gather_bwd`,
:func:`all_gather_fwd_reduce_scatter_bwd` and :func:`reduce_scatter_fwd_all_gather_bwd` on the
sequence dim. The linears that save only their input's shard live in :mod:`.gathered_linears`.
"""

from __future__ import annotations

import torch

from . import comm
from .mesh import Group

__all__ = [
    "identity_fwd_all_reduce_bwd",
    "all_reduce_fwd_identity_bwd",
    "all_reduce_fwd_all_reduce_bwd",
    "all_to_all_fwd_all_to_all_bwd",
    "split_fwd_all_gather_bwd",
    "all_gather_fwd_split_bwd",
    "all_gather_fwd_reduce_scatter_bwd",
    "reduce_scatter_fwd_all_gather_bwd",
    "all_gather_fwd_sharded_and_replicated_bwd",
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


class _GatherTwoConsumers(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        full = comm.all_gather(x.contiguous(), group, dim)
        return full, full.detach()

    @staticmethod
    def backward(ctx, g_sharded, g_replicated):
        g = comm.reduce_scatter(g_sharded.contiguous(), ctx.group, ctx.dim)
        if g_replicated is not None:
            g = g + comm.local_chunk(g_replicated, ctx.group, ctx.dim)
        return g, None, None


class _AllReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g, ctx.group), None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, split_dim, concat_dim):
        ctx.group, ctx.dims = group, (split_dim, concat_dim)
        return comm.all_to_all(x, group, split_dim, concat_dim)

    @staticmethod
    def backward(ctx, g):
        split_dim, concat_dim = ctx.dims
        return comm.all_to_all(g.contiguous(), ctx.group, concat_dim, split_dim), None, None, None


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


def all_to_all_fwd_all_to_all_bwd(
    x: torch.Tensor, group: Group, split_dim: int, concat_dim: int
) -> torch.Tensor:
    """forward: all-to-all (``split_dim`` scattered, ``concat_dim`` gathered), backward: the
    inverse all-to-all (e.g. tokens sent to the ranks holding their experts, and back)."""
    if group.size == 1:
        return comm.all_to_all(x, group, split_dim, concat_dim)  # checks the dims, no copy
    return _AllToAll.apply(x, group, split_dim, concat_dim)


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


def all_gather_fwd_sharded_and_replicated_bwd(
    x: torch.Tensor, group: Group, dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One all-gather along ``dim`` read by two kinds of consumer: the first output feeds
    compute sharded over ``group`` (each rank's gradient is partial: reduce-scattered), the
    second compute replicated over ``group`` (each rank's gradient is complete: its chunk is
    kept). Backward: ``reduce_scatter(g_sharded) + chunk(g_replicated)``, one reduce-scatter
    (an MoE layer under sequence parallelism: experts sharded, router replicated)."""
    if group.size == 1:
        return x, x
    return _GatherTwoConsumers.apply(x, group, dim)
