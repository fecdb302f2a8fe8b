"""Differentiable communication regions (Megatron-style mappings).

Each function moves a tensor between layouts over one mesh :class:`~neuron_tp.mesh.Group`
and knows the matching backward. Tensor-parallel regions act on the hidden (last) dim by
default; sequence-parallel regions act on the sequence dim, which the caller names
(HF models are batch-first: ``[batch, seq, hidden]`` -> ``dim=1``).
"""
from __future__ import annotations

import torch

from . import comm
from .mesh import Group

__all__ = [
    "copy_to_tensor_parallel", "reduce_from_tensor_parallel", "scatter_to_tensor_parallel",
    "gather_from_tensor_parallel", "scatter_to_sequence_parallel",
    "gather_from_sequence_parallel", "reduce_scatter_to_sequence_parallel", "all_reduce_shared",
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


def copy_to_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: identity, backward: all-reduce."""
    return x if group.size == 1 else _Copy.apply(x, group)


def reduce_from_tensor_parallel(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-reduce, backward: identity."""
    return x if group.size == 1 else _Reduce.apply(x, group)


def scatter_to_tensor_parallel(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """forward: keep this rank's chunk of ``dim``, backward: all-gather."""
    return x if group.size == 1 else _Split.apply(x, group, dim)


def gather_from_tensor_parallel(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    """forward: all-gather along ``dim``, backward: keep this rank's chunk (consumer is replicated)."""
    return x if group.size == 1 else _Gather.apply(x, group, dim)


def scatter_to_sequence_parallel(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """forward: keep this rank's sequence chunk, backward: all-gather."""
    return x if group.size == 1 else _Split.apply(x, group, dim)


def gather_from_sequence_parallel(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """forward: all-gather the sequence, backward: reduce-scatter (consumer is tensor-parallel)."""
    return x if group.size == 1 else _GatherReduceScatter.apply(x, group, dim)


def reduce_scatter_to_sequence_parallel(x: torch.Tensor, group: Group,
                                        dim: int = 1) -> torch.Tensor:
    """forward: reduce-scatter along the sequence, backward: all-gather."""
    return x if group.size == 1 else _ReduceScatter.apply(x, group, dim)


class _AllReduceBoth(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce(g, ctx.group), None


def all_reduce_shared(x: torch.Tensor, group: Group) -> torch.Tensor:
    """forward: all-reduce, backward: all-reduce (each rank uses the sum on different local data)."""
    return x if group.size == 1 else _AllReduceBoth.apply(x, group)
