"""Gradient synchronisation after backward: data parallelism, sequence-parallel replicated
parameters, and clipping by the true global norm across tp and dp."""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from . import comm
from .mesh import Group, Mesh, get_mesh
from .sharding import is_sequence_parallel, num_shards


def _bucketed_all_reduce(grads: list[torch.Tensor], group: Group, bucket_bytes: int,
                         scale: float = 1.0) -> None:
    """Sum ``grads`` over ``group`` in place, in flat buckets of about ``bucket_bytes``."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads + [None]:
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket and (g is None or size >= bucket_bytes):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in bucket:
                by_dtype.setdefault(t.dtype, []).append(t)
            for same in by_dtype.values():
                for dst, src in zip(same, comm.all_reduce_coalesced(same, group)):
                    dst.copy_(src * scale if scale != 1.0 else src)
            bucket, size = [], 0


def _grads(params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def allreduce_data_parallel_grads(model: nn.Module, mesh: Mesh | None = None,
                                  bucket_mb: float = 25.0) -> None:
    """Average every gradient over the dp group (bucketed all-reduce). Call after backward."""
    mesh = get_mesh(mesh)
    if mesh.dp_size > 1:
        _bucketed_all_reduce(_grads(model.parameters()), mesh.dp, int(bucket_mb * 2**20),
                             1.0 / mesh.dp_size)


def sync_sequence_parallel_grads(model: nn.Module, mesh: Mesh | None = None) -> None:
    """Sum over tp the gradients of replicated parameters used on sequence shards (norm
    weights, row-parallel biases under SP): each rank only saw its part of the sequence."""
    mesh = get_mesh(mesh)
    if mesh.tp_size > 1:
        grads = _grads(p for p in model.parameters() if is_sequence_parallel(p))
        _bucketed_all_reduce(grads, mesh.tp, 2**62)


def global_grad_norm(model: nn.Module, mesh: Mesh | None = None) -> torch.Tensor:
    """The L2 norm of the full (unsharded) gradient, equal on every rank, as a device tensor.

    Each element is counted once: a parameter replicated over tp contributes 1/tp of its
    square sum on each tp rank, a sharded one all of its (local) square sum.
    """
    mesh = get_mesh(mesh)
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    total = torch.zeros((), dtype=torch.float32, device=params[0].grad.device)
    for p in params:
        weight = num_shards(p, mesh) / mesh.tp_size
        total = total + p.grad.detach().float().pow(2).sum() * weight
    return comm.all_reduce(total, mesh.tp).sqrt()


def clip_grad_norm_(model: nn.Module, max_norm: float, mesh: Mesh | None = None) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm``; returns the norm (before
    clipping) as a device tensor, without a host read."""
    norm = global_grad_norm(model, mesh)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return norm
