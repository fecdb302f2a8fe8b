"""Cross-entropy over vocabulary-sharded logits, without gathering the full vocabulary."""

from __future__ import annotations

import torch

from ..parallel import comm
from ..parallel.mesh import Group, Mesh, get_mesh

FINITE_NEG_INF = -1e30  # finite "minus infinity": a shard made only of padding stays NaN-free


def check_loss_inputs(logits: torch.Tensor, labels: torch.Tensor, reduction: str) -> None:
    """The checks of every sharded cross-entropy, made before any collective runs."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
            "must agree on every dim but the last"
        )


class _VocabParallelCE(torch.autograd.Function):
    """Per-token loss from this rank's vocab slice, with one full-size fp32 tensor in all.

    The forward makes one fresh fp32 tensor ``p = z - m`` (``z`` the logits, padded columns at
    -1e30, ``m`` the local max), takes the target and smoothing terms from it, then
    exponentiates it in place. One all-gather of every rank's (local log-sum-exp, target
    term) gives the global log-sum-exp ``lse``. ``p`` is saved with the per-token factor
    ``exp(m - lse)`` that makes it the global softmax (no extra pass over ``p`` in forward);
    the backward turns it in place into ``g * (softmax - (1 - s) onehot - s / V)`` (no
    communication) and returns it (cast to the logits' dtype). The caller's logits are never
    written. As the backward consumes the saved tensor, a second backward through the same
    graph (``retain_graph``) fails with autograd's "modified by an inplace operation" error,
    never a wrong gradient.
    """

    @staticmethod
    def forward(  # noqa: PLR0917 (autograd passes by position)
        ctx, logits, labels, tp: Group, vocab_size: int, ignore_index: int, smoothing: float
    ):
        local_v = logits.shape[-1]
        dev = logits.device
        start = (
            tp.rank_tensor(dev) * local_v
            if tp.size > 1
            else torch.zeros((), dtype=torch.long, device=dev)
        )
        keep = (torch.arange(local_v, device=dev) + start < vocab_size).float()  # not padding
        padded = vocab_size != local_v * tp.size
        if logits.dtype == torch.float32 and not padded:
            m = logits.amax(-1, keepdim=True)
            p = logits - m  # the one full-size allocation
        else:  # the one full-size allocation: an fp32 copy, padded columns at -1e30
            p = logits.to(torch.float32, copy=True)
            if padded:
                p.masked_fill_(keep == 0, FINITE_NEG_INF)
            m = p.amax(-1, keepdim=True)
            p.sub_(m)
        valid = labels != ignore_index
        local = labels - start
        inside = (local >= 0) & (local < local_v) & valid
        idx = local.clamp(0, local_v - 1).unsqueeze(-1)
        target = (p.gather(-1, idx) + m).squeeze(-1) * inside
        if smoothing > 0:  # mean logit over the FULL vocab: this slice's unpadded sum / V
            zsum = p @ keep + m.squeeze(-1) * keep.sum()
            target = (1 - smoothing) * target + smoothing / vocab_size * zsum
        local_lse = m + p.exp_().sum(-1, keepdim=True).log()
        both = comm.all_gather(torch.cat([local_lse, target.unsqueeze(-1)], -1), tp, -1)
        both = both.unflatten(-1, (tp.size, 2))
        lse = torch.logsumexp(both[..., 0], dim=-1)
        ctx.save_for_backward(p, (m - lse.unsqueeze(-1)).exp(), idx, inside, valid, keep)
        ctx.smoothing, ctx.vocab_size, ctx.dtype = smoothing, vocab_size, logits.dtype
        return (lse - both[..., 1].sum(-1)) * valid

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        grad, scale, idx, inside, valid, keep = ctx.saved_tensors
        g = (g * valid).unsqueeze(-1)
        grad.mul_(scale * g)  # softmax * g
        grad.scatter_add_(-1, idx, (ctx.smoothing - 1) * (inside.unsqueeze(-1) * g))
        if ctx.smoothing > 0:
            grad.addcmul_(g, keep, value=-ctx.smoothing / ctx.vocab_size)
        return grad.to(ctx.dtype), None, None, None, None, None


def parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mesh: Mesh | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits, labels)`` computed from this rank's vocab slice.

    ``logits``: ``[..., V/tp]``, rank r holding columns ``[r*V/tp, (r+1)*V/tp)``; ``labels``:
    ``[...]``. ``vocab_size`` is the true vocabulary when the last shard is padded; padded
    columns never affect the loss. Label smoothing spreads ``label_smoothing`` over the full
    vocabulary (not the local slice). Communication: one all-gather of ``[..., 2 tp]`` (every
    rank's local log-sum-exp and target term). Memory: one fp32 tensor of the logits' shape,
    kept for backward and returned as the gradient; ``logits`` itself is never modified.
    """
    check_loss_inputs(logits, labels, reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    tp = get_mesh(mesh).tp
    local_v = logits.shape[-1]
    vocab_size = vocab_size or local_v * tp.size
    if not (tp.size - 1) * local_v < vocab_size <= tp.size * local_v:
        raise ValueError(f"vocab_size={vocab_size} does not fit {tp.size} shards of {local_v}")
    loss = _VocabParallelCE.apply(logits, labels, tp, vocab_size, ignore_index, label_smoothing)
    valid = labels != ignore_index
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()
