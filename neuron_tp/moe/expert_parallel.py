"""Expert parallelism: experts distributed over an ``ep`` group, tokens exchanged by all-to-all.

Each rank of the ``ep`` group holds ``E / ep`` consecutive experts (rank ``j``: experts
``j*E/ep .. (j+1)*E/ep - 1``), optionally each with a tp slice of its intermediate dim, and its
own tokens. :func:`expert_parallel_mlp` sends every (token, top-k slot) pair to the rank of its
expert, runs the local experts as batched matmuls and sends the results back: two all-to-alls
forward, two backward.

Shapes are static: per (destination rank, local expert) a buffer of ``C`` token rows, filled with
one-hot/cumsum positions and fixed-size gathers (no ``nonzero``, no data-dependent sizes), so
the graph never depends on where tokens go. ``C = T`` by default (an expert can be chosen by
every one of this rank's ``T`` tokens): exact, dropless, ``E*T`` rows sent per all-to-all. With a
``capacity_factor``, ``C = min(T, ceil(cf*T*k/E))``: the pairs of one source rank beyond an
expert's first ``C`` (in token order: lowest token index kept first) are dropped (they
contribute nothing; the count is returned).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..parallel.mesh import Group
from ..parallel.regions import all_to_all_fwd_all_to_all_bwd

__all__ = [
    "ExpertParallelOutput",
    "dispatch_to_experts",
    "exchange_with_experts",
    "expert_capacity",
    "expert_parallel_mlp",
]


class ExpertParallelOutput(NamedTuple):
    """``output [T, H]`` (this rank's tokens; a partial sum over tp when the experts hold tp
    slices) and ``dropped``, a device int64 scalar: this rank's (token, slot) pairs dropped
    for capacity (always 0 when dropless)."""

    output: torch.Tensor
    dropped: torch.Tensor


def expert_capacity(tokens: int, k: int, num_experts: int, capacity_factor: float | None) -> int:
    """Rows per (source rank, expert): ``tokens`` when ``capacity_factor`` is None (dropless),
    else ``min(tokens, ceil(capacity_factor * tokens * k / num_experts))`` (at least 1)."""
    if capacity_factor is None:
        return tokens
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None: dropless), got {capacity_factor}")
    return max(1, min(tokens, math.ceil(capacity_factor * tokens * k / num_experts)))


def _check(x, topk_ids, topk_weights, gate_up, down, group) -> None:
    """Shape errors, raised before any collective."""
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    t, h = x.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids must be [tokens={t}, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise ValueError(f"topk_ids must hold integer expert ids, got {topk_ids.dtype}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
            f"got {tuple(topk_weights.shape)}"
        )
    if gate_up.dim() != 3 or gate_up.shape[2] != h or gate_up.shape[1] % 2:
        raise ValueError(
            f"gate_up must be [local experts, 2*intermediate, hidden={h}] (gate rows then up "
            f"rows), got shape {tuple(gate_up.shape)}"
        )
    e_local, two_i, _ = gate_up.shape
    if tuple(down.shape) != (e_local, h, two_i // 2):
        raise ValueError(
            f"down must be [local experts={e_local}, hidden={h}, intermediate={two_i // 2}] "
            f"to match gate_up {tuple(gate_up.shape)}, got {tuple(down.shape)}"
        )
    k = topk_ids.shape[1]
    if not 1 <= k <= e_local * group.size:
        raise ValueError(
            f"top-k={k} must be between 1 and the number of experts "
            f"{e_local} x ep {group.size} = {e_local * group.size}"
        )


def expert_parallel_mlp(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    group: Group,
    act: Callable[[torch.Tensor], torch.Tensor] = F.silu,
    capacity_factor: float | None = None,
) -> ExpertParallelOutput:
    """``sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for this rank's tokens, the
    experts spread over ``group`` (the ``ep`` group).

    ``x [T, H]``: this rank's tokens (``T`` equal on every rank of ``group``); ``topk_ids``,
    ``topk_weights [T, k]``: their routing (ids in ``0 .. E-1``, not checked on the device);
    ``gate_up [E/ep, 2I', H]`` (gate rows then up rows) and ``down [E/ep, H, I']``: this rank's
    experts, ``I'`` the whole intermediate dim or a tp slice of it (then the output is a partial
    sum over tp, and every tp rank must route the same tokens the same way); an expert is
    ``down @ (act(gate @ x) * (up @ x))``. Gradients flow to ``x``, ``topk_weights`` and the
    local expert weights (complete: every token routed to them contributes; do not average
    them over ``group`` with the data-parallel gradients). See the module doc for capacity.
    """
    _check(x, topk_ids, topk_weights, gate_up, down, group)

    def experts(tokens: torch.Tensor) -> torch.Tensor:
        gate, up = torch.bmm(tokens, gate_up.transpose(1, 2)).chunk(2, dim=-1)
        return torch.bmm(act(gate) * up, down.transpose(1, 2))

    return dispatch_to_experts(
        x,
        topk_ids,
        topk_weights,
        experts,
        local_experts=gate_up.shape[0],
        group=group,
        capacity_factor=capacity_factor,
    )


def dispatch_to_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: Callable[[torch.Tensor], torch.Tensor],
    *,
    local_experts: int,
    group: Group,
    capacity_factor: float | None = None,
) -> ExpertParallelOutput:
    """:func:`expert_parallel_mlp` for any experts: ``experts`` maps the tokens of this rank's
    ``local_experts`` experts ``[E/ep, N, H]`` to their outputs ``[E/ep, N, H]`` (expert ``e``
    applied to row block ``e``; rows that hold no token are zeros and never read back, so an
    expert may add biases to them). Same routing, buffers, capacity and gradients."""
    t, h = x.shape
    k = topk_ids.shape[1]
    e_local, ep = local_experts, group.size
    n_exp = e_local * ep
    cap = expert_capacity(t, k, n_exp, capacity_factor)
    dev = x.device

    # A router may pick one expert twice for a token (DeepSeek-V4's hash routing): the later
    # copies' weights join the first one's and they are sent nowhere, so an expert still gets
    # at most one pair per token (dropless at C = T).
    same = topk_ids.unsqueeze(2) == topk_ids.unsqueeze(1)  # [T, k, k]
    repeat = torch.tril(same, diagonal=-1).any(-1)  # an earlier slot has this expert
    weights = torch.where(
        repeat, 0.0, (same.to(topk_weights.dtype) * topk_weights.unsqueeze(1)).sum(-1)
    )
    first = ~repeat.reshape(-1)
    # Position of each (token, slot) pair in its expert's queue, token-major: lowest token first.
    ids = topk_ids.reshape(-1).long()
    onehot = F.one_hot(ids, n_exp) * first.unsqueeze(1)  # [T*k, E]
    pos = (onehot.cumsum(0) * onehot).sum(1) - 1
    keep = (pos < cap) & first
    trash = n_exp * cap  # one extra slot: dropped pairs go there and read zeros back
    slot = torch.where(keep, ids * cap + pos, torch.full_like(ids, trash))
    token = torch.arange(t * k, device=dev) // k
    # Which token fills each slot (``t``: none, a zero row). Kept slots are unique; only the
    # trash slot receives several writes, and it is never read.
    slot_token = torch.full((trash + 1,), t, device=dev, dtype=torch.long).scatter(0, slot, token)
    x_pad = torch.cat([x, x.new_zeros(1, h)])
    send = x_pad.index_select(0, slot_token[:trash])  # [E*C, H], expert-major = rank-major

    out = exchange_with_experts(send.view(n_exp, cap, h), experts, group)
    back = out.reshape(n_exp * cap, -1)  # [E*C, H] in slot order

    back_pad = torch.cat([back, back.new_zeros(1, back.shape[1])])
    pairs = back_pad.index_select(0, slot) * weights.reshape(-1, 1).to(back.dtype)
    return ExpertParallelOutput(pairs.view(t, k, -1).sum(1), (first & ~keep).sum())


def exchange_with_experts(
    rows: torch.Tensor, experts: Callable[[torch.Tensor], torch.Tensor], group: Group
) -> torch.Tensor:
    """``rows [E, N, H]`` (row block ``e`` for global expert ``e``, from this rank) travel to
    the ranks holding their experts (``E/ep`` consecutive experts per rank of ``group``), go
    through ``experts`` there (``[E/ep, ep*N, H] -> [E/ep, ep*N, H]``, every source rank's rows
    of an expert together) and come back: ``[E, N, H]``, each block through its expert. Two
    all-to-alls forward, two backward."""
    n_exp, n, h = rows.shape
    ep = group.size
    e_local = n_exp // ep
    recv = all_to_all_fwd_all_to_all_bwd(rows.reshape(n_exp * n, h), group, 0, 0)
    tokens_in = recv.view(ep, e_local, n, h).transpose(0, 1).reshape(e_local, ep * n, h)
    out = experts(tokens_in)
    h_out = out.shape[-1]
    out = out.reshape(e_local, ep, n, h_out).transpose(0, 1).reshape(ep * e_local * n, h_out)
    back = all_to_all_fwd_all_to_all_bwd(out, group, 0, 0)
    return back.view(n_exp, n, h_out)
