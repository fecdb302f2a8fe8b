"""Vocabulary-parallel embedding, classifier (lm head) and cross-entropy for 2D/3D layouts.

Embedding: the table ``[V, h]`` is split by vocabulary over the layout's batch group and by
features over its feature axis (1/P of it per rank). The (tiny) integer ids are all-gathered over
the batch group, each rank looks up its vocabulary slice for the whole batch, and the partial
embeddings are reduce-scattered back to the batch shards (backward: all-gather).
Classifier: a :class:`Linear2D` / :class:`Linear3D` (``ab``) without bias: its logits have the
vocabulary split over the output layout's feature axis. Cross-entropy then never gathers them.

A vocabulary the split does not divide is padded (as the 1D layers do): the table / classifier
weight get zero rows up to the next multiple (``ceil(V/n)`` rows per shard), recorded through
the parameter's ``Sharding.full_shape`` so ``gather_full`` and checkpoints drop them. Valid ids
(``< V``) never reach the padded rows, :func:`cross_entropy_nd` (``vocab_size=V``) masks the
padded logit columns and :func:`gather_logits` trims the full logits to ``V``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import comm, regions
from ..parallel.mesh import Mesh, get_mesh
from ..parallel.sharding import get_sharding
from .activation_layout import (
    LAYOUT_2D,
    LAYOUT_3D_A,
    LAYOUT_3D_B,
    ActivationLayout,
    check_mode,
    gather_output,
    get_layout,
    tag,
)
from .common import LayerMixin, make_linear_parameters, make_parameter, require_multiple
from .embedding import FromEmbedding, check_ids, embedding_init, lookup_vocab_slice
from .linear_2d import Linear2D
from .linear_3d import Linear3D
from .loss import FINITE_NEG_INF, check_loss_inputs


class _EmbeddingND(FromEmbedding, nn.Module):
    layout: ActivationLayout = LAYOUT_2D

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        mesh: Mesh | None = None,
        device=None,
        dtype=None,
        init_method=None,
    ):
        super().__init__()
        self.mesh = get_mesh(mesh)
        name = type(self).__name__
        check_mode(self.mesh, self.layout, name)
        require_multiple(embedding_dim, self.layout.feature_split(self.mesh), "embedding_dim", name)
        if padding_idx is not None and padding_idx < 0:
            padding_idx += num_embeddings
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx
        # ids: this rank's batch shard of the layout (no feature dim); output: the layout.
        self.input_layout = self.output_layout = self.layout
        # ceil: a vocabulary the batch group does not divide gets zero rows no valid id reaches
        self.rows_per_rank = -(-num_embeddings // self.layout.batch_split(self.mesh))
        self.weight = make_parameter(
            self,
            "weight",
            (num_embeddings, embedding_dim),
            ((self.layout.batch_group, 0), (self.layout.feature_axis, 1)),
            mesh=self.mesh,
            init_fn=embedding_init(init_method, padding_idx),
            device=device,
            dtype=dtype,
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
    """Embedding whose output is in ``LAYOUT_2D``; the table is split by rows over q (padded
    with zero rows when q does not divide ``num_embeddings``)."""


class Embedding3D(_EmbeddingND):
    """Embedding whose output is in ``LAYOUT_3D_A``; the table is split by rows over q^2
    (padded with zero rows when q^2 does not divide ``num_embeddings``)."""

    layout = LAYOUT_3D_A


def _padded(size: int, n: int) -> int:
    return -(-size // n) * n


def _splits(module: nn.Module, name: str) -> tuple[tuple[str, int], ...]:
    sharding = get_sharding(module, name)
    return sharding.splits if sharding is not None else ()  # None: replicated


class _PaddedVocab(LayerMixin):
    """Mixin of the classifiers: built as a linear with the vocabulary rounded up to a multiple
    of its split (on meta), then the weight / bias are made again with the true vocabulary as
    their full shape, so ``shard_of`` pads them with zero rows (fresh init draws exactly the
    ``[V, hidden]`` tensor, the same at every q). ``out_features`` / ``vocab_size``: the true
    vocabulary; ``padded_vocab``: the padded one (the logits' vocab dim is ``padded_vocab / q``)."""

    # set by the linear base (Linear2D / Linear3D)
    mesh: Mesh
    output_layout: ActivationLayout
    out_features: int
    vocab_size: int
    padded_vocab: int

    def _build(self, base, hidden: int, vocab_size: int, bias: bool, q: int, kwargs) -> None:
        padded = _padded(vocab_size, q)
        if padded == vocab_size:
            base.__init__(self, hidden, vocab_size, bias=bias, **kwargs)
        else:
            device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
            init = kwargs.pop("init_method", None)
            base.__init__(self, hidden, padded, bias=bias, device="meta", dtype=dtype, **kwargs)
            w_splits = _splits(self, "weight")
            b_splits = _splits(self, "bias") if bias else ()
            self.weight, self.bias = make_linear_parameters(
                self,
                hidden,
                vocab_size,
                bias,
                weight_splits=w_splits,
                bias_splits=b_splits,
                mesh=self.mesh,
                init_method=init,
                device=device,
                dtype=dtype,
            )
        self.out_features = self.vocab_size = vocab_size
        self.padded_vocab = padded

    def gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The full logits ``[b, ..., V]`` (padding trimmed) from this rank's block."""
        return gather_logits(logits, self.output_layout, self.mesh, self.vocab_size)


class Classifier2D(_PaddedVocab, Linear2D):
    """Vocab-parallel lm head: ``LAYOUT_2D`` hidden -> logits ``[b/q, ..., ceil(V/q)]`` (vocab
    split over ``row``, padded with zero rows when q does not divide V). No bias by default."""

    def __init__(self, hidden: int, vocab_size: int, bias: bool = False, **kwargs):
        mesh = get_mesh(kwargs.get("mesh"))
        check_mode(mesh, LAYOUT_2D, type(self).__name__)
        self._build(Linear2D, hidden, vocab_size, bias, mesh.group("row").size, kwargs)


class Classifier3D(_PaddedVocab, Linear3D):
    """Vocab-parallel lm head: ``LAYOUT_3D_A`` hidden -> logits in ``LAYOUT_3D_B``
    ``[b/q^2, ..., ceil(V/q)]`` (vocab split over ``weight``, padded with zero rows when q
    does not divide V). No bias by default."""

    def __init__(self, hidden: int, vocab_size: int, bias: bool = False, **kwargs):
        kwargs.setdefault("orientation", "ab")
        mesh = get_mesh(kwargs.get("mesh"))
        check_mode(mesh, LAYOUT_3D_A, type(self).__name__)
        self._build(Linear3D, hidden, vocab_size, bias, mesh.group("input").size, kwargs)


def gather_logits(
    logits: torch.Tensor,
    layout: ActivationLayout | str,
    mesh: Mesh | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """:func:`gather_output` of vocab-sharded logits, trimmed to the true ``vocab_size`` (the
    padded columns of a vocabulary the split does not divide dropped)."""
    full = gather_output(logits, layout, get_mesh(mesh))
    if vocab_size is not None and full.shape[-1] != vocab_size:
        full = full[..., :vocab_size]
    return full


def cross_entropy_nd(
    logits: torch.Tensor,
    labels: torch.Tensor,
    layout: ActivationLayout | str,
    mesh: Mesh | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    vocab_size: int | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy`` of the full logits from this rank's block in ``layout``.

    ``logits``: ``[b/nb, ..., V/q]`` (vocab split over the layout's feature axis), ``labels``:
    the matching batch shard ``[b/nb, ...]``. ``'mean'``/``'sum'`` are over the whole batch
    (equal on every tp rank); ``'none'`` returns this rank's batch shard. ``vocab_size``: the
    true vocabulary when the logits are padded (a classifier whose split does not divide it):
    the padded columns never affect the loss or get a gradient. ``label_smoothing`` spreads
    over the true vocabulary, as ``F.cross_entropy``'s.
    """
    mesh = get_mesh(mesh)
    layout = get_layout(layout)
    check_mode(mesh, layout, "cross_entropy_nd")
    check_loss_inputs(logits, labels, reduction)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    vocab, batch = mesh.group(layout.feature_axis), mesh.group(layout.batch_group)
    z = logits.float()
    local_v = z.shape[-1]
    full_v = local_v * vocab.size
    vocab_size = full_v if vocab_size is None else vocab_size
    if not 0 < vocab_size <= full_v:
        raise ValueError(
            f"cross_entropy_nd: vocab_size={vocab_size} does not fit {vocab.size} shards of "
            f"{local_v} logits"
        )
    cols = torch.arange(local_v, device=z.device)
    if vocab.size > 1:
        cols = cols + vocab.rank_tensor(z.device) * local_v
    keep = cols < vocab_size if vocab_size != full_v else None  # not padding
    if keep is not None:  # finite: a shard made only of padding stays NaN-free
        z = z.masked_fill(~keep, FINITE_NEG_INF)
    local_lse = torch.logsumexp(z, dim=-1, keepdim=True)
    lse = torch.logsumexp(regions.all_gather_fwd_split_bwd(local_lse, vocab, dim=-1), dim=-1)
    valid = labels != ignore_index
    hit = (labels.unsqueeze(-1) == cols) & valid.unsqueeze(-1)
    picked = (z * hit).sum(-1)
    if label_smoothing > 0:  # the mean logit over the true vocabulary
        zsum = (z if keep is None else z * keep).sum(-1) * valid
        picked = (1 - label_smoothing) * picked + label_smoothing / vocab_size * zsum
    target = regions.all_reduce_fwd_identity_bwd(picked, vocab)
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
