"""A shared expert (a gated MLP every token goes through) sharded over tp inside an MoE block:
``gate_proj`` / ``up_proj`` split by output rows, ``down_proj`` by input columns, and no
reduction of its own: its partial output joins the routed experts' before the block's one
reduction."""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.mesh import Mesh
from ..parallel.sharding import Sharding, mark_sharded, shard_of


def _sharded_linear(weight: torch.Tensor, dim: int, mesh: Mesh) -> tuple[nn.Linear, Sharding]:
    sharding = Sharding((("tp", dim),), tuple(weight.shape))
    local = shard_of(weight.detach(), sharding, mesh)
    lin = nn.Linear(local.shape[1], local.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(local.clone(), weight.requires_grad)
    mark_sharded(lin, "weight", sharding)
    return lin, sharding


class TPSharedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with this rank's slice of the intermediate dimension;
    ``forward`` returns the partial output (summed over tp by the owner)."""

    def __init__(
        self,
        gate: torch.Tensor,
        up: torch.Tensor,
        down: torch.Tensor,
        act: nn.Module,
        mesh: Mesh,
    ):
        """Full weights ``gate, up [I, H]`` and ``down [H, I]`` (nn.Linear layout)."""
        super().__init__()
        inter = gate.shape[0]
        if inter % mesh.tp_size:
            raise ValueError(f"shared expert: intermediate size {inter} not divisible by tp")
        self.gate_proj, _ = _sharded_linear(gate, 0, mesh)
        self.up_proj, _ = _sharded_linear(up, 0, mesh)
        self.down_proj, _ = _sharded_linear(down, 1, mesh)
        self.act_fn = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
