"""Tensor-parallel layers: 1D (Megatron-style column/row, vocab-parallel embedding and loss)
and 2D/3D mesh layers (see :mod:`neuron_tp.layers.nd`). Every layer states the activation
layouts it takes and returns as ``input_layout`` / ``output_layout``
(:mod:`neuron_tp.layers.activation_layout`)."""

from .dropout import sharded_dropout
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .loss import parallel_cross_entropy
from .nd import (
    Classifier2D,
    Classifier3D,
    Embedding2D,
    Embedding3D,
    LayerNorm2D,
    LayerNorm3D,
    Linear2D,
    Linear3D,
    RMSNorm2D,
    RMSNorm3D,
    cross_entropy_2d,
    cross_entropy_3d,
    cross_entropy_nd,
    gather_output,
    split_input,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "parallel_cross_entropy",
    "sharded_dropout",
    "Linear2D",
    "Linear3D",
    "LayerNorm2D",
    "LayerNorm3D",
    "RMSNorm2D",
    "RMSNorm3D",
    "Embedding2D",
    "Embedding3D",
    "Classifier2D",
    "Classifier3D",
    "cross_entropy_2d",
    "cross_entropy_3d",
    "cross_entropy_nd",
    "split_input",
    "gather_output",
]
