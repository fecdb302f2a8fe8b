"""The MoE router load-balancing loss of a model cut into pipeline stages.

transformers' ``load_balancing_loss_func`` (Mixtral, Qwen2-MoE, Qwen3-MoE; every position
counted: neither an unpadded batch nor a packed 4-D mask gives it a 2-D mask) takes the router
logits of every MoE layer of the model for one forward and returns
``E * sum_e f_e * P_e``: ``f_e`` the fraction of the (layer, token) rows whose top-k
picks ``e`` (no gradient), ``P_e`` the mean router probability of ``e`` over the same rows,
both over the ``N`` rows of every layer. A stage holds only its layers, so per micro-batch
each stage sums its own rows (:class:`PieceRouting`: the top-k counts and ``N`` as
constants, the probability sums with their graph); once the last piece ran the micro-batch's
forward, the stages sum the counts and ``N`` over the pp group (a data-independent all-reduce
of ``E + 1`` numbers, in a graph of its own). With the global ``f`` and ``N`` the loss is a
sum over the stages of ``coef * E * sum_e f_e * probs_e / N`` (``probs``: the stage's
probability sums), each term with exactly the gradient the whole loss has with respect to that
stage's router: every piece adds its term to the micro-batch's loss and backpropagates it
with the piece's activation gradient.

Per micro-batch, as at pp 1 (each forward of the model adds ``coef * aux`` of its
micro-batch): the step's loss is ``sum over micro-batches (CE * scale + coef * aux)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class RouterLoss:
    """The load-balancing loss of a model: ``experts`` routed experts, top-``top_k``, weight
    ``coef``."""

    experts: int
    top_k: int
    coef: float


@dataclass
class PieceRouting:
    """One piece's rows of one micro-batch: ``counts`` ``[E + 1]`` (top-k picks per expert,
    then the number of rows; constants) and ``probs`` ``[E]`` (router probability sums, with
    their graph)."""

    counts: torch.Tensor
    probs: torch.Tensor


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The router loss ``model`` (a causal LM) adds to its loss, or None: none asked for
    (``output_router_logits`` off, or a zero ``router_aux_loss_coef``) or no config at all (a
    stack of library blocks)."""
    cfg: Any = getattr(model, "config", None)  # none: a stack of library blocks
    if not getattr(cfg, "output_router_logits", False):
        return None
    on_model = getattr(model, "router_aux_loss_coef", None)  # transformers copies it there
    coef = float(cfg.router_aux_loss_coef if on_model is None else on_model)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if not coef or not experts:
        return None
    return RouterLoss(int(experts), int(cfg.num_experts_per_tok), coef)


def piece_routing(
    loss: RouterLoss, logits: list[torch.Tensor], device: torch.device
) -> PieceRouting:
    """The sums of one piece's recorded router ``logits`` (one ``[rows, E]`` tensor per MoE
    layer it ran; none: zeros), as transformers' function sums them."""
    e = loss.experts
    counts = torch.zeros(e + 1, dtype=torch.float32, device=device)
    probs = torch.zeros(e, dtype=torch.float32, device=device)
    for layer in logits:
        layer = layer.reshape(-1, e)
        weights = nn.functional.softmax(layer, dim=-1)
        picked = torch.topk(weights.detach(), loss.top_k, dim=-1).indices
        hits = nn.functional.one_hot(picked.reshape(-1), e).sum(0).float()
        rows = torch.full((1,), float(layer.shape[0]), device=device)
        counts = counts + torch.cat([hits, rows])
        probs = probs + weights.float().sum(0)
    return PieceRouting(counts.detach(), probs)


def weights(loss: RouterLoss, total: torch.Tensor) -> torch.Tensor:
    """``[E]``: the constants a stage's probability sums are multiplied by, from the counts
    ``total`` summed over every stage: ``coef * E * counts / N**2``."""
    n = total[-1:].clamp(min=1.0)
    return total[:-1] * (loss.coef * loss.experts) / (n * n)


def term(w: torch.Tensor, routing: PieceRouting) -> torch.Tensor:
    """The piece's share of ``coef * aux`` (``[1]``), with its gradient."""
    return (w * routing.probs).sum().reshape(1)
