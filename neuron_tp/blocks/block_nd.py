"""MLP and pre-norm transformer block for 2D (``q x q``) and 3D (``q x q x q``) tensor
parallelism. Activations are batch-first ``[batch, seq, hidden]`` in the mode's layout
(``LAYOUT_2D``: ``[b/q, s, h/q]``; ``LAYOUT_3D_A``: ``[b/q^2, s, h/q]``); the block's input and
output layouts are equal, so blocks stack. Heads are split over the feature axis and sequences
are never split, so attention itself communicates nothing.

The fused QKV projection is laid out per head, ``[heads, (q, k, v), head_dim]`` on its output
dim (GPT-NeoX style), so a contiguous feature chunk holds whole heads with their q, k and v.

``regather=True`` (the default of every constructor here) makes each linear save only its local
input and weight blocks and all-gather them again in backward (two more all-gathers per linear
per backward; see :mod:`~neuron_tp.layers.linear_2d` / ``linear_3d`` for the bytes), so the
saved activations of a block are ~1/P of the unsharded block's; ``regather=False`` saves the
gathered operands instead (~1.65x that at 2D P=4, ~1.8x at 3D P=8, measured by
tests/layers/test_nd_memory.py) and skips those all-gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.activation_layout import ActivationLayout, residual_layout
from ..layers.linear_2d import Linear2D
from ..layers.linear_3d import Linear3D
from ..layers.norm_nd import LayerNorm2D, LayerNorm3D
from ..parallel.mesh import Mesh, get_mesh


def _mode(mesh: Mesh) -> str:
    if mesh.tp_mode not in ("2d", "3d"):
        raise ValueError(
            f"blocks_nd needs a 2d or 3d mesh (init_mesh(tp=..., tp_mode='2d'|'3d'))"
            f", got {mesh}; use neuron_tp.blocks for 1d"
        )
    return mesh.tp_mode


def _pair(
    mesh: Mesh, a: int, b: int, b2: int, c: int, *, bias: bool, dtype, regather: bool
) -> tuple[nn.Module, nn.Module]:
    """Linears ``a -> b`` and ``b2 -> c``; applied in turn they return to the block's layout."""
    kw = {"bias": bias, "mesh": mesh, "dtype": dtype, "regather": regather}
    if _mode(mesh) == "2d":
        return Linear2D(a, b, **kw), Linear2D(b2, c, **kw)
    return (
        Linear3D(a, b, orientation="ab", **kw),
        Linear3D(b2, c, orientation="ba", **kw),
    )


def block_layout(mesh: Mesh) -> ActivationLayout:
    """The layout of the residual stream between blocks of this mesh's mode."""
    return residual_layout(_mode(mesh))


class MLPND(nn.Module):
    """``down(gelu(up(x)))``: 2D: two Linear2D; 3D: Linear3D ``ab`` then ``ba``."""

    def __init__(
        self,
        hidden: int,
        ffn: int,
        mesh: Mesh | None = None,
        bias: bool = True,
        dtype=None,
        regather: bool = True,
    ):
        super().__init__()
        mesh = get_mesh(mesh)
        self.up, self.down = _pair(
            mesh, hidden, ffn, ffn, hidden, bias=bias, dtype=dtype, regather=regather
        )
        self.input_layout = self.output_layout = block_layout(mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class SelfAttentionND(nn.Module):
    """Causal multi-head self-attention; heads split over the feature axis (q per chunk)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        mesh: Mesh | None = None,
        bias: bool = True,
        dtype=None,
        regather: bool = True,
    ):
        super().__init__()
        mesh = get_mesh(mesh)
        mode = _mode(mesh)
        q = mesh.grid_side
        if hidden % num_heads:
            raise ValueError(f"hidden={hidden} is not divisible by num_heads={num_heads}")
        if num_heads % q:
            raise ValueError(
                f"num_heads={num_heads} is not divisible by q={q} ({mode} mesh of "
                f"tp={mesh.tp_size}); use a multiple of {q} heads"
            )
        self.local_heads, self.head_dim = num_heads // q, hidden // num_heads
        self.qkv, self.out = _pair(
            mesh, hidden, 3 * hidden, hidden, hidden, bias=bias, dtype=dtype, regather=regather
        )
        self.input_layout = self.output_layout = block_layout(mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        qkv = self.qkv(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class TransformerBlockND(nn.Module):
    """Pre-norm block ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))`` in the mesh's 2d/3d mode.

    Input and output: the residual stream in :func:`block_layout` (move a full activation in and
    out with :func:`neuron_tp.layers.nd.split_input` / ``gather_output``). ``regather``: see the
    module docstring (every linear of the block).
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        ffn: int | None = None,
        mesh: Mesh | None = None,
        *,
        bias: bool = True,
        dtype=None,
        regather: bool = True,
    ):
        super().__init__()
        mesh = get_mesh(mesh)
        norm = LayerNorm2D if _mode(mesh) == "2d" else LayerNorm3D
        self.mesh = mesh
        self.input_layout = self.output_layout = block_layout(mesh)
        self.ln1 = norm(hidden, mesh=mesh, dtype=dtype)
        self.attn = SelfAttentionND(hidden, num_heads, mesh, bias, dtype, regather)
        self.ln2 = norm(hidden, mesh=mesh, dtype=dtype)
        self.mlp = MLPND(hidden, ffn or 4 * hidden, mesh, bias, dtype, regather)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))
