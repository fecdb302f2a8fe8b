"""Gradient synchronisation after backward: data parallelism, sequence-parallel replicated
parameters, and clipping by the true global norm across tp, dp and pipeline stages."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..parallel import comm
from ..parallel.mesh import Group, Mesh, get_mesh
from ..parallel.sharding import (
    expert_split,
    get_param_meta,
    named_parameter_meta,
    num_shards,
    without_experts,
)

PPSum = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the pipeline (pp) group. The pipeline runner's
(:meth:`~neuron_tp.pipeline.runner.PipelineRunner.pp_sum`) puts that collective in a graph of
its own that every stage enters together; without one, a plain all-reduce in the current
graph."""


def sum_over_pp(t: torch.Tensor, mesh: Mesh, pp_sum: PPSum | None = None) -> torch.Tensor:
    """``t`` summed over ``mesh``'s pp group (stages hold disjoint parameters: their square
    sums add up), by ``pp_sum`` when given."""
    if mesh.pp_size == 1:
        return t
    return pp_sum(t) if pp_sum is not None else comm.all_reduce(t, mesh.pp)


def _bucketed_all_reduce(
    grads: list[torch.Tensor], group: Group, bucket_bytes: int, scale: float = 1.0
) -> None:
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


def allreduce_data_parallel_grads(
    model: nn.Module, mesh: Mesh | None = None, bucket_mb: float = 25.0
) -> None:
    """Average every gradient over the dp group (bucketed all-reduce). Call after backward.
    With context parallelism the sum runs over dp x cp (``mesh.replicas``: every rank of a cp
    ring holds the gradient of its own tokens), still divided by dp.

    Under expert parallelism an expert's gradient already holds the contributions of every
    rank of its ``ep`` group (they came back through the all-to-all): it is summed over the
    ``edp`` group (the ranks holding the same experts) and divided by dp, the same mean."""
    mesh = get_mesh(mesh)
    if mesh.replicas.size == 1:
        return
    bucket, scale = int(bucket_mb * 2**20), 1.0 / mesh.dp_size
    experts = {
        id(p) for _, p, m in named_parameter_meta(model) if expert_split(m.sharding) is not None
    }
    _bucketed_all_reduce(
        _grads(p for p in model.parameters() if id(p) not in experts),
        mesh.replicas,
        bucket,
        scale,
    )
    if experts:
        grads = _grads(p for p in model.parameters() if id(p) in experts)
        if mesh.group("edp").size > 1:
            _bucketed_all_reduce(grads, mesh.group("edp"), bucket, scale)
        else:
            for g in grads:
                g.mul_(scale)


def sync_sequence_parallel_grads(model: nn.Module, mesh: Mesh | None = None) -> None:
    """Sum over tp the gradients of replicated parameters used on sequence shards (norm
    weights, row-parallel biases under SP): each rank only saw its part of the sequence."""
    mesh = get_mesh(mesh)
    if mesh.tp_size > 1:
        grads = _grads(p for _, p, m in named_parameter_meta(model) if m.sum_grad_over_tp)
        _bucketed_all_reduce(grads, mesh.tp, 2**62)


def norm_weights(model: nn.Module, name: str, mesh: Mesh) -> tuple[float, torch.Tensor | None]:
    """How parameter ``name``'s local square sum counts in the global grad norm, so each
    distinct element counts once: a factor (num_shards / tp: 1/tp for a parameter replicated
    over tp) and, for a parameter some of whose rows are copies held by several tp ranks (kv
    heads replicated when tp > num_key_value_heads), per-row weights 1/copies (else None)."""
    sharding = without_experts(get_param_meta(model, name).sharding)
    factor = num_shards(sharding, mesh) / mesh.tp_size
    parent, _, local = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    weights = getattr(owner, "distinct_row_weights", None)
    return factor, (weights(local) if weights is not None else None)


def global_grad_norm(
    model: nn.Module, mesh: Mesh | None = None, pp_sum: PPSum | None = None
) -> torch.Tensor:
    """The L2 norm of the full (unsharded) gradient, equal on every rank, as a device tensor.

    Each distinct element is counted once: a parameter replicated over tp contributes 1/tp of
    its square sum on each tp rank, a sharded one all of its (local) square sum, and rows that
    are copies on several ranks (replicated kv heads) 1/copies of theirs.
    """
    mesh = get_mesh(mesh)
    entries = [(n, p.grad, m) for n, p, m in named_parameter_meta(model) if p.grad is not None]
    if not entries:
        return torch.zeros(())
    total = torch.zeros((), dtype=torch.float32, device=entries[0][1].device)
    experts = torch.zeros_like(total)  # expert parallelism: this rank's experts only
    for name, grad, meta in entries:
        sq = grad.detach().float().pow(2)
        factor, rows = norm_weights(model, name, mesh)
        if rows is not None:
            sq = sq.reshape(rows.shape[0], -1).sum(1) * rows.to(sq.device)
        if expert_split(meta.sharding) is None:
            total = total + sq.sum() * factor
        else:
            experts = experts + sq.sum() * factor
    if mesh.ep_size > 1:
        total = total + comm.all_reduce(experts, mesh.group("ep"))
    return sum_over_pp(comm.all_reduce(total, mesh.tp), mesh, pp_sum).sqrt()


def clip_grad_norm_(
    model: nn.Module, max_norm: float, mesh: Mesh | None = None, pp_sum: PPSum | None = None
) -> torch.Tensor:
    """Scale gradients so the global norm is at most ``max_norm``; returns the norm (before
    clipping) as a device tensor, without a host read."""
    norm = global_grad_norm(model, mesh, pp_sum)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in model.parameters():
        if p.grad is not None:
            p.grad.detach().mul_(coef.to(p.grad.dtype))
    return norm


def reduce_gradients(
    model: torch.nn.Module,
    optimizer,
    mesh: Mesh,
    max_grad_norm: float,
    zero1: bool,
    pp_sum: PPSum | None = None,
) -> torch.Tensor:
    """After the step's backward passes: complete the gradients of replicated parameters over
    tp, average over dp (all-reduce, or ``optimizer``'s reduce-scatter with ZeRO-1), clip to
    ``max_grad_norm`` (0: no clipping); returns the global gradient norm (its square sum
    summed over the pipeline stages by ``pp_sum``, see :data:`PPSum`)."""
    # Replicated parameters with partial gradients: SP norms, but also e.g. Qwen3's q/k norms
    # (replicated_with_grad_allreduce) without SP. A no-op when the model has none.
    sync_sequence_parallel_grads(model, mesh)
    if zero1:  # reduce-scatter over dp (the mean) instead of the all-reduce
        if max_grad_norm > 0:
            return optimizer.clip_grad_norm_(max_grad_norm, pp_sum=pp_sum)
        return optimizer.grad_norm(pp_sum=pp_sum)
    allreduce_data_parallel_grads(model, mesh)
    if max_grad_norm > 0:
        return clip_grad_norm_(model, max_grad_norm, mesh, pp_sum)
    return global_grad_norm(model, mesh, pp_sum)
