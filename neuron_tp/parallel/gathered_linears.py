"""Linears that save only their input's shard: the all-gather of a sharded input is done
again in backward instead of keeping the gathered activation alive (Korthikanti et al. for
sequence parallelism; the 2D / 3D layers' local blocks likewise). One more all-gather per
gathered input in backward, for 1/t of that activation memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..backend import xla as _xla
from . import comm
from .mesh import Group
from .regions import all_gather_fwd_reduce_scatter_bwd

__all__ = [
    "gathered_linear",
    "gather_for_shared_linears",
    "shared_gathered_linear",
    "gathered_operands_linear",
]


# -- Sequence-parallel linears that save only the sequence shard (Korthikanti et al.) --------
# A column-parallel linear under sequence parallelism all-gathers its sequence-sharded input;
# a plain matmul would then save the gathered input for its weight gradient (t times the
# shard). These save the shard instead and all-gather it again in backward: one more
# all-gather per gathered input in backward, for 1/t of that activation memory.


def _in_backward(shard: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """On XLA, ``shard`` and ``g`` through one optimization barrier: the re-gather then
    depends on the backward's ``g``, so the compiler can neither merge it with the forward
    all-gather of the same shard (CSE) nor hoist it into the forward, either of which would
    keep the gathered input alive after all. Elsewhere: unchanged."""
    if not _xla.is_xla(shard):
        return shard, g
    shard, g = shard.detach(), g.detach()
    _xla.xm().optimization_barrier_([shard, g])
    return shard, g


def _matmul_grads(g, full, weight, need_x: bool, need_w: bool):
    """``dY W`` (the gradient of the gathered input) and ``dY^T X`` (of the weight)."""
    dx = g.matmul(weight) if need_x else None
    dw = g.reshape(-1, g.shape[-1]).t().matmul(full.reshape(-1, full.shape[-1])) if need_w else None
    return dx, dw


class _GatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, dim):
        x = x.contiguous()
        ctx.group, ctx.dim = group, dim
        ctx.save_for_backward(x, weight)  # the shard, not the gathered input
        return F.linear(comm.all_gather(x, group, dim), weight)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if need_w:
            x, g = _in_backward(x, g)
        # The re-gather is issued first so it can overlap the dX matmul.
        full = comm.all_gather(x, ctx.group, ctx.dim) if need_w else None
        dx, dw = _matmul_grads(g, full, weight, need_x, need_w)
        if dx is not None:
            dx = comm.reduce_scatter(dx.contiguous(), ctx.group, ctx.dim)
        return dx, dw, None, None


def gathered_linear(
    x: torch.Tensor, weight: torch.Tensor, group: Group, dim: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``all_gather(x, dim) @ weight^T + bias`` saving only the shard ``x``. Backward:
    all-gather ``x`` again for the weight gradient; the input gradient ``dY W`` is
    reduce-scattered along ``dim`` (the matmul is sharded over ``group``, so each rank holds
    a partial sum)."""
    if group.size == 1:
        return F.linear(x, weight, bias)
    y = _GatheredLinear.apply(x, weight, group, dim)
    return y if bias is None else y + bias


# attribute of a gathered tensor: ``(its shard, _SharedRegather)``
_SHARD_ATTR = "_ntp_shard"


class _SharedRegather:
    """The backward re-gather of one shared gathered input: the first consumer's backward
    all-gathers the shard, the others reuse it, the last one drops it."""

    def __init__(self, group: Group, dim: int):
        self.group, self.dim = group, dim
        self.users = self.pending = 0
        self.full: torch.Tensor | None = None

    def add_user(self) -> None:
        self.users += 1
        self.pending += 1

    def gathered(self, shard: torch.Tensor) -> torch.Tensor:
        full = self.full
        if full is None:
            full = comm.all_gather(shard, self.group, self.dim)
        self.pending -= 1
        # Keep it for the siblings still to come; reset for a retain_graph backward.
        self.full, self.pending = (full, self.pending) if self.pending > 0 else (None, self.users)
        return full


class _SharedGatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, full, weight, shard, regather):
        ctx.regather = regather
        if ctx.needs_input_grad[1]:
            regather.add_user()
        ctx.save_for_backward(shard, weight)  # the shard, not ``full``
        return F.linear(full, weight)

    @staticmethod
    def backward(ctx, g):
        shard, weight = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        if need_w:
            shard, g = _in_backward(shard, g)
        full = ctx.regather.gathered(shard) if need_w else None
        # The gradient of ``full``: the gather region's backward reduce-scatters it once
        # for all the consumers.
        dx, dw = _matmul_grads(g, full, weight, need_x, need_w)
        return dx, dw, None, None


def gather_for_shared_linears(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """:func:`all_gather_fwd_reduce_scatter_bwd` for an input that several linears read (q, k,
    v; gate, up) through :func:`shared_gathered_linear`: one all-gather forward, one
    reduce-scatter backward, and the consumers save only the shard (the gathered tensor itself
    is saved by no one and freed after forward)."""
    if group.size == 1:
        return x
    x = x.contiguous()
    full = all_gather_fwd_reduce_scatter_bwd(x, group, dim)
    setattr(full, _SHARD_ATTR, (x.detach(), _SharedRegather(group, dim)))
    return full


def shared_gathered_linear(
    full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``full @ weight^T + bias`` for ``full`` from :func:`gather_for_shared_linears`, saving its
    shard; backward all-gathers the shard again (once for all the consumers of ``full``). Any
    other ``full``: a plain linear."""
    shard = getattr(full, _SHARD_ATTR, None)
    if shard is None:
        return F.linear(full, weight, bias)
    y = _SharedGatheredLinear.apply(full, weight, *shard)
    return y if bias is None else y + bias


# -- 2D / 3D linears: both operands all-gathered, only the local blocks saved --------------


class _RegatheredLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, x_group, x_dim, w_group, w_dim):  # noqa: PLR0917
        x, weight = x.contiguous(), weight.contiguous()
        ctx.groups = (x_group, x_dim, w_group, w_dim)
        ctx.save_for_backward(x, weight)  # the local blocks, not the gathered operands
        return F.linear(comm.all_gather(x, x_group, x_dim), comm.all_gather(weight, w_group, w_dim))

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        x_group, x_dim, w_group, w_dim = ctx.groups
        need_x, need_w = ctx.needs_input_grad[:2]
        g = g.contiguous()
        # Through an optimization barrier with ``g`` on XLA: neither merged with the forward
        # gathers nor hoisted into the forward (_in_backward).
        if need_w:
            x, g = _in_backward(x, g)
        if need_x:
            weight, g = _in_backward(weight, g)
        # The re-gathers are issued first, so each can overlap the other GEMM.
        w_full = comm.all_gather(weight, w_group, w_dim) if need_x else None
        x_full = comm.all_gather(x, x_group, x_dim) if need_w else None
        dx, dw = _matmul_grads(g, x_full, w_full, need_x, need_w)
        if dx is not None:
            dx = comm.reduce_scatter(dx.contiguous(), x_group, x_dim)
        if dw is not None:
            dw = comm.reduce_scatter(dw.contiguous(), w_group, w_dim)
        return dx, dw, None, None, None, None


def gathered_operands_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    x_group: Group,
    x_dim: int,
    w_group: Group,
    w_dim: int,
    regather: bool = True,
) -> torch.Tensor:
    """``all_gather(x, x_dim over x_group) @ all_gather(weight, w_dim over w_group)^T``, the
    input and weight gradients reduce-scattered back to the blocks (the GEMM is sharded over
    both groups, so each rank holds partial sums). ``regather=True`` saves only the local
    blocks for backward and all-gathers both again there (two more all-gathers, 1/group of
    the saved bytes); ``regather=False`` saves the gathered operands (the 2D and 3D linears'
    shared core)."""
    if not regather or (x_group.size == 1 and w_group.size == 1):
        x_full = all_gather_fwd_reduce_scatter_bwd(x, x_group, x_dim)
        w_full = all_gather_fwd_reduce_scatter_bwd(weight, w_group, w_dim)
        return F.linear(x_full, w_full)
    return _RegatheredLinear.apply(x, weight, x_group, x_dim, w_group, w_dim)
