"""Additive per-head attention biases the model builds once for all heads (ALiBi: BLOOM's
``alibi`` ``[batch * heads, 1, keys]``, MPT's ``position_bias`` ``[heads, 1, keys]``) and passes
to every attention module: under tensor parallelism each attention module holds only this
rank's query heads, so a forward pre-hook keeps the bias rows of those heads (the slopes follow
the heads)."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UserError

# Keyword arguments of an attention forward that hold a bias per query head (leading dim).
HEAD_BIAS_KWARGS = ("alibi", "position_bias")


class SliceHeadBias:
    """Forward pre-hook (with kwargs) of an attention module whose query heads are split: the
    rows of every :data:`HEAD_BIAS_KWARGS` tensor that belong to heads
    ``[rank * local, (rank + 1) * local)``, for a leading dim of ``heads`` or
    ``batch * heads`` (batch-major)."""

    def __init__(self, heads: int, tp: int, rank: int, name: str):
        self.heads, self.local, self.rank, self.name = heads, heads // tp, rank, name

    def _slice(self, bias: torch.Tensor) -> torch.Tensor:
        if bias.dim() < 2 or bias.shape[0] % self.heads:
            raise UserError(
                f"{self.name}: a per-head attention bias of shape {tuple(bias.shape)} whose "
                f"leading dim is not (batch x) {self.heads} heads; this attention cannot be "
                "split over tp (pass plan= without its projections)"
            )
        start = self.rank * self.local
        grouped = bias.reshape(-1, self.heads, *bias.shape[1:])
        mine = grouped[:, start : start + self.local]
        return mine.reshape(-1, *bias.shape[1:])

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        found = {
            k: self._slice(v)
            for k, v in kwargs.items()
            if k in HEAD_BIAS_KWARGS and isinstance(v, torch.Tensor)
        }
        return args, {**kwargs, **found}


def install_head_bias_slicing(attn: nn.Module, heads: int, tp: int, rank: int, name: str) -> None:
    """Slice the per-head biases ``attn`` gets to this rank's query heads (a no-op for an
    attention module that gets none)."""
    attn.register_forward_pre_hook(SliceHeadBias(heads, tp, rank, name), with_kwargs=True)
