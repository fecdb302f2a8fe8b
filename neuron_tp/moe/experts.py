"""Fused experts sharded over tp, computed with static shapes.

Each rank holds, for every expert, its chunk of the intermediate dimension: ``gate_up_proj
[E, 2I/tp, H]`` (its chunk of the gate half, then of the up half) and ``down_proj
[E, H, I/tp]``; its output is a partial sum over tp that the MoE block reduces once for the
whole layer. Three ways to compute it, all with shapes fixed by ``T``, ``E`` and ``k``:

* ``dense`` (exact, dropless): every token through every local expert slice as batched
  matmuls, combined with the routing weights scattered into a dense ``[T, E]`` matrix (zero for
  unselected experts). FLOPs ``E / k`` times the ideal top-k compute.
* ``gather`` (exact, for few tokens, i.e. decode): the selected experts' weight slices are
  gathered per (token, slot) and applied with batched matmuls: ideal FLOPs, ``T * k`` weight
  slices read.
* ``capacity`` (not exact when tokens overflow): each expert takes at most
  ``C = ceil(capacity_factor * T * k / E)`` (token, slot) pairs, earlier tokens first; the
  pairs past an expert's capacity are dropped (their weight treated as 0), so results differ
  from transformers whenever any pair is dropped. FLOPs ``capacity_factor`` times ideal.

With expert parallelism (a mesh with ``ep > 1``) each rank holds only ``E / ep`` experts (its
``ep`` chunk, each expert still split over tp) and the tokens travel to their experts by
all-to-all (:func:`~neuron_tp.moe.expert_parallel.expert_parallel_mlp`): dropless by default,
``capacity`` mode bounds the rows sent per expert.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..parallel.mesh import Mesh
from ..parallel.sharding import Sharding, mark_sharded, shard_of
from .expert_parallel import expert_parallel_mlp

MODES = ("auto", "dense", "gather", "capacity")


def pick_mode(mode: str, tokens: int, k: int, num_experts: int) -> str:
    """The compute mode for ``tokens`` tokens: ``auto`` is ``gather`` when ``tokens * k <
    num_experts`` (fewer routed pairs than experts: decode) else ``dense``. A static rule on
    shapes, so each traced graph uses one mode."""
    if mode not in MODES:
        raise ValueError(f"unknown MoE mode {mode!r}; valid: {MODES}")
    if mode == "auto":
        return "gather" if tokens * k < num_experts else "dense"
    return mode


def _ffn(x, gate_up, down, act):
    """``down(act(gate) * up)`` per expert for ``x [E, N, H]`` (batched over experts)."""
    h = torch.bmm(x, gate_up.transpose(1, 2))
    gate, up = h.chunk(2, dim=-1)
    return torch.bmm(act(gate) * up, down.transpose(1, 2))


class ModeDispatch:
    """Mixin of the tp experts modules: run ``_dense``, ``_gather`` or ``_capacity`` as the
    module's ``mode`` (:func:`pick_mode`) says."""

    mode: str
    num_experts: int
    capacity_factor: float | None

    if TYPE_CHECKING:  # defined by each experts module

        def _dense(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...
        def _gather(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor: ...
        def _capacity(
            self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
        ) -> torch.Tensor: ...

    def _run_mode(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        mode = pick_mode(self.mode, x.shape[0], idx.shape[1], self.num_experts)
        if mode == "capacity":
            if self.capacity_factor is None:
                raise ValueError("MoE mode 'capacity' needs a capacity_factor")
            return self._capacity(x, idx, w)
        return self._gather(x, idx, w) if mode == "gather" else self._dense(x, idx, w)


class TPExperts(ModeDispatch, nn.Module):
    """The tp-local slices of ``E`` fused experts (transformers' layout and parameter names:
    ``gate_up_proj`` and ``down_proj``); ``forward`` returns this rank's partial output."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: nn.Module, mesh: Mesh):
        """``gate_up [E, 2I, H]`` and ``down [E, H, I]``: the full fused weights (any device,
        meta too); this rank keeps its slices."""
        super().__init__()
        e, two_i, h = gate_up.shape
        inter = two_i // 2
        if tuple(down.shape) != (e, h, inter):
            raise ValueError(f"experts: down_proj {tuple(down.shape)} != {(e, h, inter)}")
        tp, ep = mesh.tp_size, mesh.ep_size
        if inter % tp:
            raise ValueError(f"experts: intermediate size {inter} not divisible by tp={tp}")
        if e % ep:
            raise ValueError(f"experts: {e} experts cannot be split over ep={ep}")
        outer = (("ep", 0),) if ep > 1 else ()
        gu = Sharding((*outer, ("tp", 1)), tuple(gate_up.shape), segments=(inter, inter))
        dn = Sharding((*outer, ("tp", 2)), tuple(down.shape))
        rg = gate_up.requires_grad
        self.gate_up_proj = nn.Parameter(shard_of(gate_up.detach(), gu, mesh).clone(), rg)
        self.down_proj = nn.Parameter(shard_of(down.detach(), dn, mesh).clone(), rg)
        mark_sharded(self, "gate_up_proj", gu)
        mark_sharded(self, "down_proj", dn)
        self.num_experts, self.act_fn, self.mesh = e, act, mesh
        self.mode, self.capacity_factor = "auto", None
        self.dropped: torch.Tensor | None = None  # capacity mode: pairs dropped last forward

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Partial output ``[T, H]`` for tokens ``x [T, H]`` routed to ``idx [T, k]`` with
        weights ``w [T, k]``."""
        if self.mesh.ep_size > 1:
            cf = self.capacity_factor if self.mode == "capacity" else None
            out, self.dropped = expert_parallel_mlp(
                x,
                idx,
                w,
                gate_up=self.gate_up_proj,
                down=self.down_proj,
                group=self.mesh.group("ep"),
                act=self.act_fn,
                capacity_factor=cf,
            )
            return out
        return self._run_mode(x, idx, w)

    def _dense(self, x, idx, w):
        e, t = self.num_experts, x.shape[0]
        gu = self.gate_up_proj
        # One [T, H] x [H, E * 2I/tp] matmul for every expert's gate/up, then per expert down.
        h = (x @ gu.reshape(-1, gu.shape[2]).t()).view(t, e, -1).transpose(0, 1)
        gate, up = h.chunk(2, dim=-1)
        y = torch.bmm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2))
        combine = torch.zeros(t, e, dtype=w.dtype, device=w.device).scatter(1, idx, w)
        return torch.einsum("eth,te->th", y, combine.to(y.dtype)).to(x.dtype)

    def _gather(self, x, idx, w):
        gu = self.gate_up_proj[idx]  # [T, k, 2I/tp, H]
        gate, up = torch.einsum("th,tkoh->tko", x, gu).chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", self.act_fn(gate) * up, self.down_proj[idx])
        return (y * w.unsqueeze(-1).to(y.dtype)).sum(1).to(x.dtype)

    def _capacity(self, x, idx, w):
        t, k = idx.shape
        e = self.num_experts
        cap = math.ceil(self.capacity_factor * t * k / e)
        flat = idx.reshape(-1)  # (token, slot) pairs, token-major: earlier tokens first
        onehot = (flat.unsqueeze(1) == torch.arange(e, device=flat.device)).to(torch.int32)
        pos = ((onehot.cumsum(0) - 1) * onehot).sum(1)  # place of each pair in its expert
        keep = pos < cap
        dump = e * cap  # one extra slot for the dropped pairs (never read back)
        slot = torch.where(keep, flat * cap + pos, torch.full_like(flat, dump))
        token = torch.arange(t * k, device=flat.device) // k
        src = torch.zeros(dump + 1, dtype=torch.long, device=flat.device).scatter(0, slot, token)
        xin = x[src[:dump]].view(e, cap, x.shape[1])  # empty slots read token 0, weight 0
        y = _ffn(xin, self.gate_up_proj, self.down_proj, self.act_fn).reshape(dump, -1)
        y = torch.cat([y, y.new_zeros(1, y.shape[1])])
        wk = (w.reshape(-1) * keep.to(w.dtype)).to(y.dtype)
        self.dropped = (~keep).sum()
        return (y[slot] * wk.unsqueeze(1)).view(t, k, -1).sum(1).to(x.dtype)
