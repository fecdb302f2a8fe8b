"""Example transformer blocks built from the parallel layers: :mod:`.block_1d` (1D tensor
and sequence parallel), :mod:`.block_nd` (2D / 3D)."""

from .block_1d import ParallelMLP, ParallelSelfAttention, TransformerBlock
from .block_nd import MLPND, SelfAttentionND, TransformerBlockND, block_layout

__all__ = [
    "ParallelMLP",
    "ParallelSelfAttention",
    "TransformerBlock",
    "MLPND",
    "SelfAttentionND",
    "TransformerBlockND",
    "block_layout",
]
