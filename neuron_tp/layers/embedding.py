"""Vocabulary-parallel embedding: each tp rank owns a contiguous slice of the vocabulary."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import regions
from ..mesh import Mesh, get_mesh
from .common import check_device, load_shards_from, make_parameter


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (vocabulary) over tp.

    Each rank looks up the ids in its slice (others give zeros) and the partial results are
    summed: all-reduce, or reduce-scatter along ``sequence_dim`` with ``sequence_parallel``
    (output sequence-sharded). A vocabulary that tp does not divide is padded with zero rows
    that no valid id reaches. Input: integer ids ``[...]``; output ``[..., embedding_dim]``.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None,
                 sequence_parallel: bool = False, sequence_dim: int = 1,
                 mesh: Mesh | None = None, device=None, dtype=None, init_method=None):
        super().__init__()
        self.mesh = get_mesh(mesh)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = (num_embeddings,
                                                                     embedding_dim, padding_idx)
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.rows_per_rank = -(-num_embeddings // self.mesh.tp_size)

        def init(w: torch.Tensor) -> None:
            (init_method or nn.init.normal_)(w)
            if padding_idx is not None:
                with torch.no_grad():
                    w[padding_idx].zero_()

        self.weight = make_parameter(
            self, "weight", (num_embeddings, embedding_dim), (("tp", 0),), self.mesh, init, device,
            dtype)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, mesh: Mesh | None = None,
                       **kwargs) -> "VocabParallelEmbedding":
        """Shard an existing ``nn.Embedding`` (every rank holds the same full module)."""
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError("VocabParallelEmbedding supports neither max_norm, "
                             "scale_grad_by_freq nor sparse gradients")
        layer = cls(embedding.num_embeddings, embedding.embedding_dim,
                    padding_idx=embedding.padding_idx, mesh=mesh, device="meta",
                    dtype=embedding.weight.dtype, **kwargs)
        return load_shards_from(layer, embedding)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"VocabParallelEmbedding: ids must be int64/int32, got {ids.dtype}")
        check_device(ids, self.mesh, type(self).__name__)
        tp = self.mesh.tp
        if tp.size == 1:
            out = F.embedding(ids, self.weight)
        else:
            # The slice start is device data, not a Python constant: one graph for all ranks.
            start = tp.rank_tensor(ids.device) * self.rows_per_rank
            local = ids - start
            outside = (local < 0) | (local >= self.rows_per_rank)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.padding_idx is not None:
            # nn.Embedding semantics: the padding row receives no gradient.
            out = torch.where((ids == self.padding_idx).unsqueeze(-1), out.detach(), out)
        if self.sequence_parallel:
            return regions.reduce_scatter_to_sequence_parallel(out, tp, self.sequence_dim)
        return regions.reduce_from_tensor_parallel(out, tp)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, tp={self.mesh.tp_size}, "
                f"sequence_parallel={self.sequence_parallel}")
