"""Transformer building blocks made of 1D tensor-parallel layers (optionally sequence-parallel).

Activations are batch-first ``[batch, seq, hidden]``. With ``sequence_parallel`` the residual
stream between blocks is sharded on the sequence (``[batch, seq/tp, hidden]``) and the norms
run on shards; otherwise it is replicated over tp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers import ColumnParallelLinear, RowParallelLinear
from ..layers.activation_layout import REPLICATED, SHARDED_SEQUENCE
from ..layers.dropout import sharded_dropout
from ..parallel.mesh import Mesh, get_mesh, valid_tp_degrees
from ..parallel.sharding import mark_sequence_parallel


def _residual_layout(sequence_parallel: bool) -> str:
    """The layout of the residual stream between blocks (input and output of every block)."""
    return SHARDED_SEQUENCE if sequence_parallel else REPLICATED


def _norm(hidden: int, sequence_parallel: bool, dtype) -> nn.LayerNorm:
    norm = nn.LayerNorm(hidden, dtype=dtype)
    if sequence_parallel:
        mark_sequence_parallel(norm)
    return norm


class ParallelMLP(nn.Module):
    """``down(gelu(up(x)))``: column-parallel up, row-parallel down; one all-reduce (or
    all-gather + reduce-scatter under SP) forward, the same backward."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        mesh: Mesh | None = None,
        *,
        sequence_parallel: bool = False,
        bias: bool = True,
        dtype=None,
        sequence_parallel_regather: bool = True,
    ):
        super().__init__()
        mesh = get_mesh(mesh)
        self.up = ColumnParallelLinear(
            hidden,
            ffn,
            bias=bias,
            sequence_parallel=sequence_parallel,
            mesh=mesh,
            dtype=dtype,
            sequence_parallel_regather=sequence_parallel_regather,
        )
        self.down = RowParallelLinear(
            ffn, hidden, bias=bias, sequence_parallel=sequence_parallel, mesh=mesh, dtype=dtype
        )
        self.input_layout = self.output_layout = _residual_layout(sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with heads split over tp (fused, head-sharded QKV)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        mesh: Mesh | None = None,
        *,
        sequence_parallel: bool = False,
        bias: bool = True,
        dtype=None,
        sequence_parallel_regather: bool = True,
    ):
        super().__init__()
        mesh = get_mesh(mesh)
        if hidden % num_heads:
            raise ValueError(f"hidden={hidden} is not divisible by num_heads={num_heads}")
        if num_heads % mesh.tp_size:
            ok = valid_tp_degrees(mesh.world_size, num_heads)
            raise ValueError(
                f"num_heads={num_heads} is not divisible by tp={mesh.tp_size}; "
                f"tp degrees that work: {ok}"
            )
        self.local_heads = num_heads // mesh.tp_size
        self.head_dim = hidden // num_heads
        self.qkv = ColumnParallelLinear(
            hidden,
            3 * hidden,
            bias=bias,
            segments=(hidden,) * 3,
            sequence_parallel=sequence_parallel,
            mesh=mesh,
            dtype=dtype,
            sequence_parallel_regather=sequence_parallel_regather,
        )
        self.out = RowParallelLinear(
            hidden, hidden, bias=bias, sequence_parallel=sequence_parallel, mesh=mesh, dtype=dtype
        )
        self.input_layout = self.output_layout = _residual_layout(sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], -1
        q, k, v = (
            t.reshape(b, s, self.local_heads, self.head_dim).transpose(1, 2)
            for t in self.qkv(x).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, y.shape[2], -1))


class TransformerBlock(nn.Module):
    """Pre-norm block: ``x + drop(attn(ln1(x)))`` then ``x + drop(mlp(ln2(x)))``.

    Dropout masks equal the unsharded block's for the same RNG state (see
    :func:`neuron_tp.layers.dropout.sharded_dropout`), with or without sequence parallelism.
    With ``sequence_parallel`` the column-parallel linears save their sequence shard and
    all-gather it again in backward (activation memory / tp);
    ``sequence_parallel_regather=False`` keeps their gathered inputs instead (see
    :class:`~neuron_tp.layers.ColumnParallelLinear`).
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        ffn: int | None = None,
        mesh: Mesh | None = None,
        *,
        sequence_parallel: bool = False,
        bias: bool = True,
        dropout: float = 0.0,
        dtype=None,
        sequence_parallel_regather: bool = True,
    ):
        super().__init__()
        mesh = get_mesh(mesh)
        self.mesh, self.dropout, self.sequence_parallel = mesh, dropout, sequence_parallel
        self.input_layout = self.output_layout = _residual_layout(sequence_parallel)
        self.ln1 = _norm(hidden, sequence_parallel, dtype)
        regather = sequence_parallel_regather
        self.attn = ParallelSelfAttention(
            hidden,
            num_heads,
            mesh,
            sequence_parallel=sequence_parallel,
            bias=bias,
            dtype=dtype,
            sequence_parallel_regather=regather,
        )
        self.ln2 = _norm(hidden, sequence_parallel, dtype)
        self.mlp = ParallelMLP(
            hidden,
            ffn or 4 * hidden,
            mesh,
            sequence_parallel=sequence_parallel,
            bias=bias,
            dtype=dtype,
            sequence_parallel_regather=regather,
        )

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        group = self.mesh.tp if self.sequence_parallel else None  # else replicated over tp
        return sharded_dropout(x, self.dropout, group, 1, self.training)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln1(x)))
        return x + self._drop(self.mlp(self.ln2(x)))
