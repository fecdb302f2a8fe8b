"""The tensor-parallel MoE block: router replicated, routed experts and shared expert(s) split
over tp by their intermediate dimension, ONE reduction over tp for the whole layer.

Forward, per rank: the input (all-gathered first under sequence parallelism) goes to the
replicated router and to the sharded experts; each rank computes its partial output of every
selected expert and of the shared expert, weighted by the routing weights (and the sigmoid of
the shared-expert gate), and the sum is all-reduced (reduce-scattered over the sequence under
sequence parallelism) once.

Gradients: the routing weights pass through ``identity_fwd_all_reduce_bwd`` before they meet
the partial expert outputs, so their gradient (a partial sum on each rank) is completed by one
small ``[T, k(+1)]`` all-reduce in backward; the router and the shared-expert gate then see
complete gradients on every rank, exactly the unsharded model's (no gradient sync needed, and an
auxiliary loss on the replicated router logits stays exact). The router's input gradient is
complete too, so it joins the experts' (partial) one after their reduction.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import comm, regions
from ..parallel.mesh import Mesh
from .experts import MODES, TPExperts
from .interface import TPInterfaceExperts


def _same_noise(x: torch.Tensor, jitter: float, mesh: Mesh) -> torch.Tensor:
    """Multiplicative jitter ``U(1 - j, 1 + j)`` identical on every tp rank (tp rank 0's draw,
    spread by one all-reduce): ranks that routed differently would not sum to one layer."""
    noise = torch.empty_like(x).uniform_(1.0 - jitter, 1.0 + jitter)
    tp = mesh.tp
    if tp.size == 1:
        return noise
    first = (tp.rank_tensor(x.device) == 0).to(noise.dtype)
    return comm.all_reduce(noise * first, tp)


class ParallelMoEBlock(nn.Module):
    """An MoE layer over the tp group of ``mesh``.

    ``router``: replicated module mapping ``[T, H]`` to ``(logits, weights [T, k], indices
    [T, k])`` (:class:`neuron_tp.moe.routing.Router` or transformers' own); ``experts``: the
    sharded routed experts; ``shared``: an optional shared expert returning a partial output
    (:class:`neuron_tp.moe.shared.TPSharedMLP`); ``shared_gate``: an optional replicated
    ``Linear(H, 1)`` whose sigmoid scales the shared expert (Qwen2-MoE). ``names`` gives the
    attribute names of those children (the checkpoint's parameter names). ``jitter``:
    multiplicative input noise in training (Mixtral's ``router_jitter_noise``), none in eval.
    """

    def __init__(
        self,
        router: nn.Module,
        experts: TPExperts,
        mesh: Mesh,
        *,
        shared: nn.Module | None = None,
        shared_gate: nn.Module | None = None,
        names: dict[str, str] | None = None,
        jitter: float = 0.0,
        sequence_parallel: bool = False,
    ):
        super().__init__()
        self.names = {"router": "gate", "shared": "shared_expert"}
        self.names.update({"shared_gate": "shared_expert_gate", **(names or {})})
        self.add_module(self.names["router"], router)
        self.experts = experts
        if shared is not None:
            self.add_module(self.names["shared"], shared)
        if shared_gate is not None:
            self.add_module(self.names["shared_gate"], shared_gate)
        self.has_shared, self.has_shared_gate = shared is not None, shared_gate is not None
        self.mesh, self.jitter, self.sequence_parallel = mesh, jitter, sequence_parallel

    def _child(self, role: str) -> nn.Module:
        return getattr(self, self.names[role])

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tp = self.mesh.tp
        if self.sequence_parallel:
            x, x_router = regions.all_gather_fwd_sharded_and_replicated_bwd(hidden_states, tp, 1)
        else:
            x, x_router = regions.identity_fwd_all_reduce_bwd(hidden_states, tp), hidden_states
        if self.training and self.jitter > 0:
            noise = _same_noise(x_router, self.jitter, self.mesh)
            x, x_router = x * noise, x_router * noise
        shape = x.shape
        flat, flat_router = x.reshape(-1, shape[-1]), x_router.reshape(-1, shape[-1])
        _, weights, idx = self._child("router")(flat_router)
        k = weights.shape[1]
        if self.has_shared_gate:
            gate = torch.sigmoid(self._child("shared_gate")(flat_router))
            both = torch.cat([weights, gate.to(weights.dtype)], 1)
            both = regions.identity_fwd_all_reduce_bwd(both, tp)
            weights, gate = both[:, :k], both[:, k:].to(gate.dtype)
        else:
            weights = regions.identity_fwd_all_reduce_bwd(weights, tp)
        out = self.experts(flat, idx, weights)
        if self.has_shared:
            shared = self._child("shared")(flat)
            out = out + (gate * shared if self.has_shared_gate else shared)
        out = out.view(shape)
        if self.sequence_parallel:
            return regions.reduce_scatter_fwd_all_gather_bwd(out, tp, 1)
        return regions.all_reduce_fwd_identity_bwd(out, tp)


def set_moe_mode(model: nn.Module, mode: str = "auto", capacity_factor: float | None = None) -> int:
    """Choose how every :class:`ParallelMoEBlock` (and every experts module sharded behind
    transformers' interface, :class:`~neuron_tp.moe.interface.TPInterfaceExperts`) of
    ``model`` computes its experts (:mod:`neuron_tp.moe.experts`): ``auto`` (default:
    ``gather`` when ``tokens * k < num_experts``, else ``dense``), ``dense``, ``gather`` or
    ``capacity`` (needs ``capacity_factor``; drops the (token, expert) pairs past an expert's
    capacity, so results then differ from transformers). Returns the number of blocks set."""
    if mode not in MODES:
        raise ValueError(f"unknown MoE mode {mode!r}; valid: {MODES}")
    if mode == "capacity" and (capacity_factor is None or capacity_factor <= 0):
        raise ValueError(f"MoE mode 'capacity' needs capacity_factor > 0, got {capacity_factor}")
    n = 0
    for mod in model.modules():
        if isinstance(mod, (ParallelMoEBlock, TPInterfaceExperts)):
            experts = mod.experts if isinstance(mod, ParallelMoEBlock) else mod
            experts.mode, experts.capacity_factor = mode, capacity_factor
            n += 1
    return n
