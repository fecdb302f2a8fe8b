"""Vocabulary-parallel embedding, classifier (lm head) and cross-entropy for 2D/3D layouts.

Embedding: the table ``[V, h]`` is split by vocabulary over the layout's batch group and by
features over its feature axis (1/P of it per rank). The (tiny) integer ids are all-gathered over
the batch group, each rank looks up its vocabulary slice for the whole batch, and the partial
embeddings are reduce-scattered back to the batch shards (backward: all-gather).
Classifier: a :class:`Linear2D` / :class:`Linear3D` (``ab``) without bias: its logits have the
vocabulary split over the output layout's feature axis. Cross-entropy then never gathers them.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import comm, regions
from ..mesh import Mesh, get_mesh
from .activation_layout import (
    LAYOUT_2D,
    LAYOUT_3D_A,
    LAYOUT_3D_B,
    ActivationLayout,
    check_mode,
    get_layout,
    tag,
)
from .common import make_parameter, require_multiple
from .embedding import FromEmbedding, check_ids, embedding_init, lookup_vocab_slice
from .linear_2d import Linear2D
from .linear_3d import Linear3D
from .loss import check_loss_inputs


class _EmbeddingND(FromEmbedding, nn.Module):
    layout: ActivationLayout = LAYOUT_2D

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        mesh: Mesh | None = None,
        device=None,
        dtype=None,
        init_method=None,
    ):
        super().__init__()
        self.mesh = get_mesh(mesh)
        name = type(self).__name__
        check_mode(self.mesh, self.layout, name)
        require_multiple(num_embeddings, self.layout.batch_split(self.mesh), "num_embeddings", name)
        require_multiple(embedding_dim, self.layout.feature_split(self.mesh), "embedding_dim", name)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        # ids: this rank's batch shard of the layout (no feature dim); output: the layout.
        self.input_layout = self.output_layout = self.layout
        self.rows_per_rank = num_embeddings // self.layout.batch_split(self.mesh)
        self.weight = make_parameter(
            self,
            "weight",
            (num_embeddings, embedding_dim),
            ((self.layout.batch_group, 0), (self.layout.feature_axis, 1)),
            self.mesh,
            embedding_init(init_method, padding_idx),
            device,
            dtype,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids``: this rank's batch shard ``[b/nb, ...]`` (``split_input(ids, layout, mesh,
        feature_dim=False)``); returns ``[b/nb, ..., h/q]`` in the layout."""
        check_ids(ids, self.mesh, type(self).__name__)
        batch = self.mesh.group(self.layout.batch_group)
        all_ids = comm.all_gather(ids.contiguous(), batch, 0)
        out = lookup_vocab_slice(all_ids, self.weight, batch, self.rows_per_rank, self.padding_idx)
        out = regions.reduce_scatter_fwd_all_gather_bwd(out, batch, dim=0)
        return tag(out, self.layout)


class Embedding2D(_EmbeddingND):
    """Embedding whose output is in ``LAYOUT_2D``; ``num_embeddings`` must divide by q."""


class Embedding3D(_EmbeddingND):
    """Embedding whose output is in ``LAYOUT_3D_A``; ``num_embeddings`` must divide by q^2."""

    layout = LAYOUT_3D_A


class Classifier2D(Linear2D):
    """Vocab-parallel lm head: ``LAYOUT_2D`` hidden -> logits ``[b/q, ..., V/q]`` (vocab
    split over ``row``). No bias by default."""

    def __init__(self, hidden: int, vocab_size: int, bias: bool = False, **kwargs):
        super().__init__(hidden, vocab_size, bias=bias, **kwargs)


class Classifier3D(Linear3D):
    """Vocab-parallel lm head: ``LAYOUT_3D_A`` hidden -> logits in ``LAYOUT_3D_B``
    ``[b/q^2, ..., V/q]`` (vocab split over ``weight``). No bias by default."""

    def __init__(self, hidden: int, vocab_size: int, bias: bool = False, **kwargs):
        kwargs.setdefault("orientation", "ab")
        super().__init__(hidden, vocab_size, bias=bias, **kwargs)


def cross_entropy_nd(
    logits: torch.Tensor,
    labels: torch.Tensor,
    layout: ActivationLayout | str,
    mesh: Mesh | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of the full logits from this rank's block in ``layout``.

    ``logits``: ``[b/nb, ..., V/q]`` (vocab split over the layout's feature axis), ``labels``:
    the matching batch shard ``[b/nb, ...]``. ``'mean'``/``'sum'`` are over the whole batch
    (equal on every tp rank); ``'none'`` returns this rank's batch shard.
    """
    mesh = get_mesh(mesh)
    layout = get_layout(layout)
    check_mode(mesh, layout, "cross_entropy_nd")
    check_loss_inputs(logits, labels, reduction)
    vocab, batch = mesh.group(layout.feature_axis), mesh.group(layout.batch_group)
    z = logits.float()
    local_v = z.shape[-1]
    cols = torch.arange(local_v, device=z.device)
    if vocab.size > 1:
        cols = cols + vocab.rank_tensor(z.device) * local_v
    local_lse = torch.logsumexp(z, dim=-1, keepdim=True)
    lse = torch.logsumexp(regions.all_gather_fwd_split_bwd(local_lse, vocab, dim=-1), dim=-1)
    valid = labels != ignore_index
    hit = (labels.unsqueeze(-1) == cols) & valid.unsqueeze(-1)
    target = regions.all_reduce_fwd_identity_bwd((z * hit).sum(-1), vocab)
    loss = (lse - target) * valid
    if reduction == "none":
        return loss
    total = regions.all_reduce_fwd_identity_bwd(loss.sum(), batch)
    if reduction == "sum":
        return total
    return total / comm.all_reduce(valid.sum().to(z.dtype), batch)


def cross_entropy_2d(
    logits: torch.Tensor, labels: torch.Tensor, mesh: Mesh | None = None, **kwargs
) -> torch.Tensor:
    """:func:`cross_entropy_nd` of :class:`Classifier2D` logits (layout ``2d``)."""
    return cross_entropy_nd(logits, labels, LAYOUT_2D, mesh, **kwargs)


def cross_entropy_3d(
    logits: torch.Tensor, labels: torch.Tensor, mesh: Mesh | None = None, **kwargs
) -> torch.Tensor:
    """:func:`cross_entropy_nd` of :class:`Classifier3D` logits (layout ``3d-b``)."""
    return cross_entropy_nd(logits, labels, LAYOUT_3D_B, mesh, **kwargs)
