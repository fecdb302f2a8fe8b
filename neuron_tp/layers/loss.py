"""Cross-entropy over vocabulary-sharded logits, without gathering the full vocabulary."""
from __future__ import annotations

import torch

from .. import regions
from ..mesh import Mesh, get_mesh

_NEG = -1e30  # finite "minus infinity": a shard made only of padding stays NaN-free


def parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, mesh: Mesh | None = None,
                           ignore_index: int = -100, label_smoothing: float = 0.0,
                           vocab_size: int | None = None,
                           reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(full_logits, labels)`` computed from this rank's vocab slice.

    ``logits``: ``[..., V/tp]``, rank r holding columns ``[r*V/tp, (r+1)*V/tp)``; ``labels``:
    ``[...]``. ``vocab_size`` is the true vocabulary when the last shard is padded; padded
    columns never affect the loss. Label smoothing spreads ``label_smoothing`` over the full
    vocabulary (not the local slice). Communication: one all-gather of ``[..., tp]`` local
    log-sum-exps and one all-reduce of the target (and mean) logits.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} "
                         "must agree on every dim but the last")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    tp = get_mesh(mesh).tp
    local_v = logits.shape[-1]
    vocab_size = vocab_size or local_v * tp.size
    if not (tp.size - 1) * local_v < vocab_size <= tp.size * local_v:
        raise ValueError(f"vocab_size={vocab_size} does not fit {tp.size} shards of {local_v}")
    z = logits.float()
    cols = torch.arange(local_v, device=z.device)
    if tp.size > 1:
        cols = cols + tp.rank_tensor(z.device) * local_v
    padded = cols >= vocab_size
    if vocab_size != local_v * tp.size:
        z = z.masked_fill(padded, _NEG)

    local_lse = torch.logsumexp(z, dim=-1, keepdim=True)
    lse = torch.logsumexp(regions.gather_from_tensor_parallel(local_lse, tp, -1), dim=-1)

    valid = labels != ignore_index
    hit = (labels.unsqueeze(-1) == cols) & valid.unsqueeze(-1)
    target = (z * hit).sum(-1)
    if label_smoothing > 0:
        mean_z = z.masked_fill(padded, 0.0).sum(-1) / vocab_size
        target = (1 - label_smoothing) * target + label_smoothing * mean_z
    target = regions.reduce_from_tensor_parallel(target, tp)

    loss = (lse - target) * valid
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum()
