"""Vocabulary-parallel embedding: each tp rank owns a contiguous slice of the vocabulary.

Also the pieces the 2D/3D embeddings (:mod:`neuron_tp.layers.vocab_nd`) share with it: the
lookup in one rank's slice of the table, the table's initialisation and ``from_embedding``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel import regions
from ..parallel.mesh import Group, Mesh, get_mesh
from .activation_layout import REPLICATED, SHARDED_SEQUENCE
from .common import RefusesPeftWrap, check_device, load_shards_from, make_parameter


def check_ids(ids: torch.Tensor, mesh: Mesh, layer: str) -> None:
    """Integer ids on a device the mesh can use, checked before any collective runs."""
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{layer}: ids must be int64/int32, got {ids.dtype}")
    check_device(ids, mesh, layer)


def lookup_vocab_slice(
    ids: torch.Tensor,
    weight: torch.Tensor,
    group: Group,
    rows_per_rank: int,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """This rank's part of ``embedding(ids)`` for a table split by rows over ``group`` (rank r
    holds rows ``[r * rows_per_rank, (r + 1) * rows_per_rank)`` as ``weight``): ids outside the
    slice give zeros, so the sum over the group is the full lookup. The padding row gets no
    gradient, as in ``nn.Embedding``."""
    if group.size == 1:
        out = F.embedding(ids, weight)
    else:
        # The slice start is device data, not a Python constant: one graph for all ranks.
        local = ids - group.rank_tensor(ids.device) * rows_per_rank
        outside = (local < 0) | (local >= rows_per_rank)
        out = F.embedding(local.masked_fill(outside, 0), weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    if padding_idx is not None:
        out = torch.where((ids == padding_idx).unsqueeze(-1), out.detach(), out)
    return out


def embedding_init(
    init_method: Callable[[torch.Tensor], object] | None, padding_idx: int | None
) -> Callable[[torch.Tensor], None]:
    """Initialisation of a full embedding table: ``init_method`` (default: standard normal),
    then the padding row set to zero (as ``nn.Embedding`` does)."""

    def init(w: torch.Tensor) -> None:
        (init_method or nn.init.normal_)(w)
        if padding_idx is not None:
            with torch.no_grad():
                w[padding_idx].zero_()

    return init


class FromEmbedding(RefusesPeftWrap):
    """Mixin: ``from_embedding`` for a layer whose constructor takes ``(num_embeddings,
    embedding_dim, padding_idx=..., mesh=..., device=..., dtype=...)`` like ``nn.Embedding``."""

    @classmethod
    def from_embedding(
        cls, embedding: nn.Embedding, mesh: Mesh | None = None, **kwargs: Any
    ) -> Self:
        """Shard an existing ``nn.Embedding`` (every rank holds the same full module); extra
        keyword arguments go to the constructor."""
        if embedding.max_norm is not None or embedding.scale_grad_by_freq or embedding.sparse:
            raise ValueError(
                f"{cls.__name__} supports neither max_norm, scale_grad_by_freq nor sparse gradients"
            )
        layer = cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            padding_idx=embedding.padding_idx,
            mesh=mesh,
            device="meta",
            dtype=embedding.weight.dtype,
            **kwargs,
        )
        return load_shards_from(layer, embedding)


class VocabParallelEmbedding(FromEmbedding, nn.Module):
    """Embedding table split by rows (vocabulary) over tp.

    Each rank looks up the ids in its slice (others give zeros) and the partial results are
    summed: all-reduce, or reduce-scatter along ``sequence_dim`` with ``sequence_parallel``
    (output sequence-sharded). A vocabulary that tp does not divide is padded with zero rows
    that no valid id reaches. Input: integer ids ``[...]``; output ``[..., embedding_dim]``.
    """

    input_layout = REPLICATED  # the ids, on every tp rank

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        mesh: Mesh | None = None,
        device=None,
        dtype=None,
        init_method=None,
    ):
        super().__init__()
        self.mesh = get_mesh(mesh)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = (
            num_embeddings,
            embedding_dim,
            padding_idx,
        )
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.rows_per_rank = -(-num_embeddings // self.mesh.tp_size)
        self.weight = make_parameter(
            self,
            "weight",
            (num_embeddings, embedding_dim),
            (("tp", 0),),
            mesh=self.mesh,
            init_fn=embedding_init(init_method, padding_idx),
            device=device,
            dtype=dtype,
        )

    @property
    def output_layout(self) -> str:
        return SHARDED_SEQUENCE if self.sequence_parallel else REPLICATED

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.mesh, type(self).__name__)
        tp = self.mesh.tp
        out = lookup_vocab_slice(ids, self.weight, tp, self.rows_per_rank, self.padding_idx)
        if self.sequence_parallel:
            return regions.reduce_scatter_fwd_all_gather_bwd(out, tp, self.sequence_dim)
        return regions.all_reduce_fwd_identity_bwd(out, tp)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, tp={self.mesh.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
