"""Mixture-of-experts routers with static shapes, written as transformers computes them.

A router maps tokens ``[T, H]`` to ``(logits [T, E], weights [T, k], indices [T, k])`` (the
transformers router contract). Two kinds exist:

* ``softmax_topk``: softmax over the experts in fp32, top-k, optionally renormalised over the
  k selected (Mixtral always, Qwen2/3-MoE and OLMoE with ``norm_topk_prob``); the weights stay
  fp32 (Mixtral) or are cast back to the logits' dtype (Qwen-MoE, OLMoE).
* ``sigmoid_group_topk`` (DeepSeek-V3 / GLM-4-MoE): sigmoid scores, a per-expert correction
  bias that only affects the choice, experts chosen inside the ``topk_group`` best of
  ``n_group`` groups (a group scores the sum of its two best), optional renormalisation, then
  ``routed_scaling_factor``.

Every op has a shape fixed by ``T``, ``E`` and ``k``: one graph whatever tokens go where.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ROUTER_KINDS = ("softmax_topk", "sigmoid_group_topk")


def softmax_topk(
    logits: torch.Tensor, k: int, normalize: bool, fp32_weights: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], indices [T, k])`` of a softmax top-k router."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float)
    top, idx = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return (top if fp32_weights else top.to(logits.dtype)), idx


def sigmoid_group_topk(
    logits: torch.Tensor,
    k: int,
    correction_bias: torch.Tensor,
    *,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], indices [T, k])`` of a DeepSeek-V3 style router (``logits`` fp32)."""
    scores = logits.sigmoid()
    choice = scores + correction_bias
    n, e = choice.shape
    group_scores = choice.view(n, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(n, n_group, e // n_group).reshape(n, e)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, idx)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, idx


class Router(nn.Module):
    """A replicated router (``weight [E, H]``) of one of :data:`ROUTER_KINDS`; ``forward``
    returns ``(logits, weights, indices)``. ``options``: for ``softmax_topk`` ``normalize``
    and ``fp32_weights``; for ``sigmoid_group_topk`` ``n_group``, ``topk_group``,
    ``normalize`` and ``scaling`` (it also holds the ``e_score_correction_bias`` buffer)."""

    e_score_correction_bias: torch.Tensor  # a buffer, sigmoid_group_topk only

    def __init__(self, kind: str, num_experts: int, hidden: int, top_k: int, **options):
        super().__init__()
        if kind not in ROUTER_KINDS:
            raise ValueError(f"unknown router kind {kind!r}; known: {ROUTER_KINDS}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
        self.kind, self.top_k, self.options = kind, top_k, options
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        if kind == "sigmoid_group_topk":
            if num_experts % options["n_group"]:
                raise ValueError(
                    f"n_group={options['n_group']} must divide num_experts={num_experts}"
                )
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = x.reshape(-1, self.weight.shape[1])
        o = self.options
        if self.kind == "softmax_topk":
            logits = F.linear(x, self.weight)
            w, idx = softmax_topk(logits, self.top_k, o["normalize"], o["fp32_weights"])
            return logits, w, idx
        logits = F.linear(x.float(), self.weight.float())
        w, idx = sigmoid_group_topk(
            logits,
            self.top_k,
            self.e_score_correction_bias,
            n_group=o["n_group"],
            topk_group=o["topk_group"],
            normalize=o["normalize"],
            scaling=o["scaling"],
        )
        return logits, w, idx
