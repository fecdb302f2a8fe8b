"""Routed experts sharded over tp behind transformers' experts interface: a drop-in for a
transformers 5 experts module (the MoE block keeps its own forward, router, shared experts and
gates, replicated), called exactly as the block calls the original.

Two call conventions (:class:`ExpertsLayout` ``call``):

* ``routed``: ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``
  (the ``@use_experts_implementation`` experts of transformers 5);
* ``dense``: ``experts(hidden [E*T, H]) -> [E*T, H]``, every token already scaled for every
  expert by the block (Llama-4).

Each rank holds every expert's slice of the intermediate dimension, in the layout the original
declares (transformers' ``use_experts_implementation`` flags): gate/up concatenated (``[gate;
up]``, each half split) or interleaved (``g0 u0 g1 u1 ...``, a contiguous split keeps the
pairs), weights ``[E, O, H]`` or transposed ``[E, H, O]``, optional biases, optional gate (no
gate: ``act(up)``). The gating function is the original's (``_apply_gate``: clamps, custom
activations), applied to this rank's slice: it is elementwise per (gate, up) pair. The down
bias is added on tp rank 0 only (a device mask, the same graph on every rank).

ONE reduction per layer: the partial outputs are all-reduced (reduce-scattered over the
tokens under sequence parallelism, where the tokens are all-gathered first). Backward: the
input, routing weights (and down bias) gradients are completed by all-reduces. Shapes are
static (``dense`` / ``gather`` / ``capacity`` modes as :mod:`neuron_tp.moe.experts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..parallel import comm, regions
from ..parallel.mesh import Mesh
from ..parallel.sharding import Sharding, mark_sharded, shard_of
from .expert_parallel import dispatch_to_experts, exchange_with_experts
from .experts import ModeDispatch


@dataclass(frozen=True)
class ExpertsLayout:
    """How a transformers experts module stores and applies its experts."""

    gated: bool = True  # gate_up_proj (+ a gating function); False: up_proj and act(up)
    concatenated: bool = True  # [gate; up] halves; False: interleaved g0 u0 g1 u1 ...
    transposed: bool = False  # gate_up [E, H, 2I], down [E, I, H]; False: [E, 2I, H], [E, H, I]
    bias: bool = False  # gate_up_proj_bias [E, 2I] (up_proj_bias), down_proj_bias [E, H]
    call: str = "routed"  # "routed": (x, top_k_index, top_k_weights); "dense": (x [E*T, H])

    @property
    def up_name(self) -> str:
        return "gate_up_proj" if self.gated else "up_proj"

    @property
    def up_dim(self) -> int:
        """The dim of the up (gate_up) weight holding the intermediate features."""
        return 2 if self.transposed else 1

    @property
    def down_dim(self) -> int:
        return 1 if self.transposed else 2


def _up(x: torch.Tensor, w: torch.Tensor, transposed: bool, eq: str) -> torch.Tensor:
    """``x @ w`` per expert: ``eq`` is the einsum for the non-transposed ``[.., O, H]`` weight;
    a transposed one ``[.., H, O]`` swaps the weight's last two letters."""
    if transposed:
        lhs, rest = eq.split("->")
        a, b = lhs.split(",")
        eq = f"{a},{b[:-2]}{b[-1]}{b[-2]}->{rest}"
    return torch.einsum(eq, x, w)


class TPInterfaceExperts(ModeDispatch, nn.Module):
    """This rank's intermediate slice of ``E`` experts, parameters under the original's names;
    ``forward`` takes the original's call and returns the complete output (one reduction)."""

    down_proj: torch.Tensor  # a parameter, set by name with the up projection (and biases)

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        layout: ExpertsLayout,
        gate_fn: Callable[[torch.Tensor], torch.Tensor],
        mesh: Mesh,
        sequence_parallel: bool = False,
    ):
        """``params``: the original's full tensors by name (``gate_up_proj`` or ``up_proj``,
        ``down_proj``, with ``layout.bias`` their ``_bias``); ``gate_fn``: maps the up output
        ``[..., 2I']`` (``[..., I']`` without a gate) to the activation ``[..., I']``."""
        super().__init__()
        self.layout, self.gate_fn, self.mesh = layout, gate_fn, mesh
        self.sequence_parallel = sequence_parallel
        up, down = params[layout.up_name], params["down_proj"]
        e = up.shape[0]
        inter = down.shape[layout.down_dim]
        width = up.shape[layout.up_dim]
        if width != (2 * inter if layout.gated else inter):
            raise ValueError(
                f"experts: {layout.up_name} {tuple(up.shape)} does not match down_proj "
                f"{tuple(down.shape)} (intermediate size {inter})"
            )
        tp, ep = mesh.tp_size, mesh.ep_size
        if inter % tp:
            raise ValueError(f"experts: intermediate size {inter} not divisible by tp={tp}")
        if e % ep:
            raise ValueError(f"experts: {e} experts cannot be split over ep={ep}")
        halves = (inter, inter) if layout.gated and layout.concatenated else None
        self.num_experts, self.inter = e, inter
        outer = (("ep", 0),) if ep > 1 else ()
        specs = {
            layout.up_name: Sharding(
                (*outer, ("tp", layout.up_dim)), tuple(up.shape), segments=halves
            ),
            "down_proj": Sharding((*outer, ("tp", layout.down_dim)), tuple(down.shape)),
        }
        if layout.bias:
            b = f"{layout.up_name}_bias"
            specs[b] = Sharding((*outer, ("tp", 1)), tuple(params[b].shape), segments=halves)
            specs["down_proj_bias"] = Sharding(outer, tuple(params["down_proj_bias"].shape))
        for name, full in params.items():
            spec = specs.get(name)
            if spec is not None and not spec.splits:
                spec = None
            local = full.detach() if spec is None else shard_of(full.detach(), spec, mesh)
            setattr(self, name, nn.Parameter(local.clone(), full.requires_grad))
            if spec is not None:
                mark_sharded(self, name, spec)
        self.mode, self.capacity_factor = "auto", None
        self.dropped: torch.Tensor | None = None

    # -- the experts on this rank's slice -----------------------------------------------------

    def _biases(self):
        if not self.layout.bias:
            return None, None
        down_b = self.down_proj_bias
        if self.mesh.tp_size > 1:  # added once: on tp rank 0 (a device mask, one graph)
            first = (self.mesh.tp.rank_tensor(down_b.device) == 0).to(down_b.dtype)
            # mask after the region: rank 0's gradient (the whole one) reaches every rank
            down_b = regions.identity_fwd_all_reduce_bwd(down_b, self.mesh.tp) * first
        return getattr(self, f"{self.layout.up_name}_bias"), down_b

    def _per_expert(self, x: torch.Tensor) -> torch.Tensor:
        """``x [E, N, H]`` through every local expert slice: ``[E, N, H]`` (partial)."""
        lay = self.layout
        up_b, down_b = self._biases()
        h = _up(x, getattr(self, lay.up_name), lay.transposed, "enh,eoh->eno")
        if up_b is not None:
            h = h + up_b.unsqueeze(1)
        y = _up(self.gate_fn(h), self.down_proj, lay.transposed, "eni,ehi->enh")
        return y if down_b is None else y + down_b.unsqueeze(1)

    def _dense(self, x, idx, w):
        t, e = x.shape[0], self.num_experts
        y = self._per_expert(x.unsqueeze(0).expand(e, t, x.shape[1]))
        # scatter_add: a hash router (DeepSeek-V4) may pick one expert twice for a token
        combine = torch.zeros(t, e, dtype=w.dtype, device=w.device).scatter_add(1, idx, w)
        return torch.einsum("eth,te->th", y, combine.to(y.dtype))

    def _gather(self, x, idx, w):
        lay = self.layout
        up_b, down_b = self._biases()
        h = _up(x, getattr(self, lay.up_name)[idx], lay.transposed, "th,tkoh->tko")
        if up_b is not None:
            h = h + up_b[idx]
        y = _up(self.gate_fn(h), self.down_proj[idx], lay.transposed, "tki,tkhi->tkh")
        if down_b is not None:
            y = y + down_b[idx]
        return (y * w.unsqueeze(-1).to(y.dtype)).sum(1)

    def _capacity(self, x, idx, w):
        t, k = idx.shape
        e = self.num_experts
        cap = math.ceil(self.capacity_factor * t * k / e)
        flat = idx.reshape(-1)
        onehot = (flat.unsqueeze(1) == torch.arange(e, device=flat.device)).to(torch.int32)
        pos = ((onehot.cumsum(0) - 1) * onehot).sum(1)
        keep = pos < cap
        dump = e * cap
        slot = torch.where(keep, flat * cap + pos, torch.full_like(flat, dump))
        token = torch.arange(t * k, device=flat.device) // k
        src = torch.zeros(dump + 1, dtype=torch.long, device=flat.device).scatter(0, slot, token)
        xin = x[src[:dump]].view(e, cap, x.shape[1])
        y = self._per_expert(xin).reshape(dump, -1)
        y = torch.cat([y, y.new_zeros(1, y.shape[1])])
        wk = (w.reshape(-1) * keep.to(w.dtype)).to(y.dtype)
        self.dropped = (~keep).sum()
        return (y[slot] * wk.unsqueeze(1)).view(t, k, -1).sum(1)

    # -- the original's call ------------------------------------------------------------------

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None):
        tp = self.mesh.tp
        if self.layout.call == "dense":
            return self._forward_dense(hidden_states)
        dtype = hidden_states.dtype
        if self.sequence_parallel:  # this rank's tokens: gather all, compute, scatter back
            x = regions.all_gather_fwd_reduce_scatter_bwd(hidden_states, tp, 0)
            idx = comm.all_gather(top_k_index, tp, 0)
            w = regions.all_gather_fwd_reduce_scatter_bwd(top_k_weights, tp, 0)
        else:
            x = regions.identity_fwd_all_reduce_bwd(hidden_states, tp)
            idx, w = top_k_index, regions.identity_fwd_all_reduce_bwd(top_k_weights, tp)
        out = self._local_experts(x, idx, w).to(dtype)
        if self.sequence_parallel:
            return regions.reduce_scatter_fwd_all_gather_bwd(out, tp, 0)
        return regions.all_reduce_fwd_identity_bwd(out, tp)

    def _local_experts(self, x, idx, w):
        """The partial output (over tp) of every token: the local experts' modes at ep 1, the
        all-to-all to the experts' ranks under expert parallelism."""
        if self.mesh.ep_size == 1:
            return self._run_mode(x, idx, w)
        cf = self.capacity_factor if self.mode == "capacity" else None
        if self.mode == "capacity" and cf is None:
            raise ValueError("MoE mode 'capacity' needs a capacity_factor")
        e_local = self.num_experts // self.mesh.ep_size
        out, self.dropped = dispatch_to_experts(
            x,
            idx,
            w,
            self._per_expert,
            local_experts=e_local,
            group=self.mesh.group("ep"),
            capacity_factor=cf,
        )
        return out

    def _forward_dense(self, hidden_states):
        """Llama-4: ``[E*T, H]``, row block ``e`` the tokens scaled for expert ``e``."""
        tp, e = self.mesh.tp, self.num_experts
        x = hidden_states.view(e, -1, hidden_states.shape[-1])
        if self.sequence_parallel:
            x = regions.all_gather_fwd_reduce_scatter_bwd(x, tp, 1)
        else:
            x = regions.identity_fwd_all_reduce_bwd(x, tp)
        if self.mesh.ep_size > 1:  # every expert's rows to its rank and back
            out = exchange_with_experts(x, self._per_expert, self.mesh.group("ep"))
        else:
            out = self._per_expert(x)
        out = out.to(hidden_states.dtype)
        if self.sequence_parallel:
            out = regions.reduce_scatter_fwd_all_gather_bwd(out, tp, 1)
        else:
            out = regions.all_reduce_fwd_identity_bwd(out, tp)
        return out.reshape(-1, hidden_states.shape[-1])
