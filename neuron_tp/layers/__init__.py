"""1D tensor-parallel layers (Megatron-style) and the vocab-parallel loss."""
from .dropout import sharded_dropout
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .loss import parallel_cross_entropy

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "parallel_cross_entropy", "sharded_dropout"]
