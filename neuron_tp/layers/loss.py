"""Cross-entropy over vocabulary-sharded logits, without gathering the full vocabulary."""

from __future__ import annotations

import torch

from .. import comm
from ..mesh import Group, Mesh, get_mesh

_NEG = -1e30  # finite "minus infinity": a shard made only of padding stays NaN-free


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
    """Per-token loss from this rank's vocab slice; the backward is analytic and local
    (``softmax - onehot``, with the global log-sum-exp), so it needs no communication."""

    @staticmethod
    def forward(
        ctx, logits, labels, tp: Group, vocab_size: int, ignore_index: int, smoothing: float
    ):
        z = logits.float()
        local_v = z.shape[-1]
        start = (
            tp.rank_tensor(z.device) * local_v
            if tp.size > 1
            else torch.zeros((), dtype=torch.long, device=z.device)
        )
        padded = None
        if vocab_size != local_v * tp.size:
            padded = torch.arange(local_v, device=z.device) + start >= vocab_size
            z = z.masked_fill(padded, _NEG)
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        lse = torch.logsumexp(comm.all_gather(lse, tp, -1), dim=-1)
        valid = labels != ignore_index
        local = labels - start
        inside = (local >= 0) & (local < local_v) & valid
        idx = local.clamp(0, local_v - 1).unsqueeze(-1)
        target = z.gather(-1, idx).squeeze(-1) * inside
        if smoothing > 0:
            zs = z if padded is None else z.masked_fill(padded, 0.0)
            target = (1 - smoothing) * target + smoothing * zs.sum(-1) / vocab_size
        target = comm.all_reduce(target, tp)
        ctx.save_for_backward(z, lse, idx, inside, valid, padded)
        ctx.smoothing, ctx.vocab_size, ctx.dtype = smoothing, vocab_size, logits.dtype
        return (lse - target) * valid

    @staticmethod
    def backward(ctx, g):
        z, lse, idx, inside, valid, padded = ctx.saved_tensors
        g = (g * valid).unsqueeze(-1)
        grad = torch.exp(z - lse.unsqueeze(-1)) * g
        hit = (1 - ctx.smoothing) * (inside.unsqueeze(-1) * g)
        grad = grad.scatter_add(-1, idx, -hit)
        if ctx.smoothing > 0:
            spread = g * (ctx.smoothing / ctx.vocab_size)
            grad = grad - (spread if padded is None else spread * ~padded)
        return grad.to(ctx.dtype), None, None, None, None, None


def parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    mesh: Mesh | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    vocab_size: int | None = None,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits, labels)`` computed from this rank's vocab slice.

    ``logits``: ``[..., V/tp]``, rank r holding columns ``[r*V/tp, (r+1)*V/tp)``; ``labels``:
    ``[...]``. ``vocab_size`` is the true vocabulary when the last shard is padded; padded
    columns never affect the loss. Label smoothing spreads ``label_smoothing`` over the full
    vocabulary (not the local slice). Communication: one all-gather of ``[..., tp]`` local
    log-sum-exps and one all-reduce of the target (and mean) logits.
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
