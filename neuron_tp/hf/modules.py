"""Sharded replacements for the linear/embedding modules of a transformers model."""

from __future__ import annotations

import weakref
from collections import Counter
from types import SimpleNamespace
from typing import cast, overload

import torch
from torch import nn

from ..layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from ..layers.activation_layout import REPLICATED
from ..layers.common import LayerMixin
from ..parallel import gathered_linears
from ..parallel.mesh import Mesh, valid_tp_degrees
from .attention import SyncReplicatedRows
from .slice_map import HFSliceMap, even_pieces, set_slice_map


class ReplicaRows(LayerMixin):
    """Mixin of a module whose parameter rows (dim 0 of ``weight`` / ``bias``) hold kv heads
    replicated over tp ranks: in backward every copy gets the sum of all copies' gradients (the
    gradient of the one unsharded row), and the global grad norm counts each row once. Needs
    ``self.weight`` and ``self.mesh``."""

    mesh: Mesh
    weight: nn.Parameter
    _rows: torch.Tensor  # buffers registered by set_replicas
    _uid: torch.Tensor
    replicas: int | None = None  # the number of distinct rows once set

    def set_replicas(self, rows: list[int], uid_table: list[list[int]], n_unique: int) -> None:
        """``rows``: this rank's local rows that are copies; ``uid_table[r]``: the distinct
        row each of rank ``r``'s copies holds (in ``rows`` order); ``n_unique`` of them."""
        self.register_buffer("_rows", torch.tensor(rows, dtype=torch.long), persistent=False)
        self.register_buffer("_uid", torch.tensor(uid_table, dtype=torch.long), persistent=False)
        self.replicas = n_unique
        counts = Counter(i for u in uid_table for i in u)
        copies = [counts[i] for i in range(n_unique)]
        weights = torch.ones(self.weight.shape[0])
        for row, i in zip(rows, uid_table[self.mesh.tp_rank]):
            weights[row] = 1.0 / copies[i]
        self.register_buffer("_distinct_w", weights, persistent=False)

    def distinct_row_weights(self, name: str) -> torch.Tensor | None:
        """1/copies per row of ``weight`` / ``bias`` (see :func:`neuron_tp.global_grad_norm`)."""
        return getattr(self, "_distinct_w", None) if name in ("weight", "bias") else None

    @overload
    def _sync(self, t: torch.Tensor, device) -> torch.Tensor: ...
    @overload
    def _sync(self, t: None, device) -> None: ...
    def _sync(self, t: torch.Tensor | None, device) -> torch.Tensor | None:
        if t is None or self.replicas is None:
            return t
        tp = self.mesh.tp
        uid = self._uid.to(device)
        uid = (
            uid[0]
            if tp.size == 1
            else uid.index_select(0, tp.rank_tensor(device).view(1)).squeeze(0)
        )
        return SyncReplicatedRows.apply(t, self._rows.to(device), uid, self.replicas, tp)


class HFColumnLinear(ReplicaRows, ColumnParallelLinear):
    """Column-parallel linear whose input region (copy / sequence all-gather) may be applied
    once by its parent module for all its sibling projections (``shared_region``: its input is
    then already replicated), and whose rows may hold kv heads replicated over ranks (gradients
    of copies summed in backward). Its forward is :class:`ColumnParallelLinear`'s."""

    hf_name = ""
    shared_region = False
    # Its input is made inside its parent from the parent's (region) input, e.g. a latent of
    # multi-head latent attention: no region of its own, its input's gradient stays partial.
    input_replicated = False
    # weakref to the parent's region output (not kept after forward)
    region_input: weakref.ref[torch.Tensor] | None = None

    @property
    def input_layout(self) -> str:
        return REPLICATED if self.shared_region or self.input_replicated else super().input_layout

    def _label(self) -> str:
        return self.hf_name or type(self).__name__

    def _linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        if not self.shared_region:
            return super()._linear(x, weight, bias)
        # A sequence-gathered shared input (regather): save its shard, not ``x``.
        return gathered_linears.shared_gathered_linear(self._input_region(x), weight, bias)

    def _input_region(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_replicated:
            return x
        if not self.shared_region:
            return super()._input_region(x)
        if self.region_input is None or x is not self.region_input():
            raise ValueError(
                f"{self.hf_name}: its input is not the input of its parent module, so the "
                "shared tensor-parallel input region does not apply (cross-attention or a "
                "transformed input); give this module an explicit plan without it"
            )
        return x

    def _local_weight_and_bias(
        self, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._sync(self.weight, device), self._sync(self.bias, device)


def linear_view(mod: nn.Module, name: str):
    """``(weight [out, in], bias, transposed)`` of an nn.Linear or a GPT-2 style Conv1D."""
    if isinstance(mod, nn.Linear):
        return mod.weight, mod.bias, False
    if type(mod).__name__ == "Conv1D" and hasattr(mod, "nf"):
        return mod.get_parameter("weight").t(), mod.bias, True
    raise ValueError(
        f"{name}: a linear style was planned for a {type(mod).__name__}, which is "
        "neither nn.Linear nor Conv1D; fix the plan"
    )


def runs(rows: list[int]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for r in rows:
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return [(p[0], p[1]) for p in out]


def require_even_split(size: int, mesh: Mesh, name: str, what: str) -> None:
    """ValueError naming ``name`` and the tp degrees that work unless tp divides ``size``."""
    if size % mesh.tp_size:
        raise ValueError(
            f"{name}: {what}={size} cannot be split over tp={mesh.tp_size}; tp "
            f"degrees that work with world size {mesh.world_size}: "
            f"{valid_tp_degrees(mesh.world_size, size)}"
        )


def check_column_linear(
    mod: nn.Module,
    name: str,
    mesh: Mesh,
    rows_of_rank: list[list[int]] | None = None,
    segments: list[int] | None = None,
    pad_output: bool = False,
) -> None:
    """The refusals of :func:`build_column_linear` for these arguments, without building."""
    out = linear_view(mod, name)[0].shape[0]
    if rows_of_rank is None and not pad_output:
        for s in segments or [out]:
            require_even_split(s, mesh, name, "output features")


def build_column_linear(
    mod: nn.Module,
    name: str,
    mesh: Mesh,
    *,
    rows_of_rank: list[list[int]] | None = None,
    segments: list[int] | None = None,
    replicated_from: int | None = None,
    gather_output: bool = False,
    pad_output: bool = False,
) -> HFColumnLinear:
    """Shard ``mod`` by output rows. ``rows_of_rank[r]``: the HF rows rank r holds (kv heads
    may repeat across ranks); None = the plain contiguous split (of each segment)."""
    check_column_linear(mod, name, mesh, rows_of_rank, segments, pad_output)
    w, b, transposed = linear_view(mod, name)
    tp, r = mesh.tp_size, mesh.tp_rank
    out = w.shape[0]
    if rows_of_rank is None:
        segs = segments or [out]
        src, exp_segments, keep = SimpleNamespace(weight=w, bias=b), segments, None
        pieces = []
        off = 0
        for s in segs:
            pieces += even_pieces(s, r, tp, off)
            off += s
    else:
        local = len(rows_of_rank[0])
        # Expanded layout: each segment of every rank's rows, in rank order within segments.
        segs = segments or [local * tp]
        per = [s // tp for s in segs]
        index, off = [], 0
        for p in per:
            for rows in rows_of_rank:
                index += rows[off : off + p]
            off += p
        idx = torch.tensor(index, dtype=torch.long)
        src = SimpleNamespace(
            weight=w.index_select(0, idx), bias=None if b is None else b.index_select(0, idx)
        )
        exp_segments = [p * tp for p in per] if segments else None
        first: dict[int, int] = {}
        for pos, j in enumerate(index):  # the first copy of every original row
            first.setdefault(j, pos)
        keep = tuple(first[j] for j in range(out))
        pieces = runs(rows_of_rank[r])
    src.in_features, src.out_features = src.weight.shape[1], src.weight.shape[0]
    layer = HFColumnLinear.from_linear(
        cast(nn.Linear, src),  # a stand-in with nn.Linear's four attributes
        mesh=mesh,
        gather_output=gather_output,
        pad_output=pad_output,
        segments=tuple(exp_segments) if exp_segments else None,
    )
    layer.hf_name = name
    if rows_of_rank is not None and replicated_from is not None:
        mine = rows_of_rank[r]
        rows = [i for i, j in enumerate(mine) if j >= replicated_from]
        table = [[j - replicated_from for j in rr if j >= replicated_from] for rr in rows_of_rank]
        layer.set_replicas(rows, table, out - replicated_from)
    set_slice_map(
        layer, "weight", HFSliceMap(1 if transposed else 0, tuple(pieces), transposed, keep)
    )
    if layer.bias is not None:
        set_slice_map(layer, "bias", HFSliceMap(0, tuple(pieces), False, keep))
    return layer


def check_row_linear(mod: nn.Module, name: str, mesh: Mesh) -> None:
    """The refusals of :func:`build_row_linear`, without building."""
    require_even_split(linear_view(mod, name)[0].shape[1], mesh, name, "input features")


def build_row_linear(
    mod: nn.Module, name: str, mesh: Mesh, input_is_parallel: bool, sequence_parallel: bool
) -> RowParallelLinear:
    """Shard ``mod`` by input features (partial outputs summed over tp)."""
    check_row_linear(mod, name, mesh)
    w, b, transposed = linear_view(mod, name)
    src = SimpleNamespace(weight=w, bias=b, in_features=w.shape[1], out_features=w.shape[0])
    layer = RowParallelLinear.from_linear(
        cast(nn.Linear, src),  # a stand-in with nn.Linear's four attributes
        mesh=mesh,
        input_is_parallel=input_is_parallel,
        sequence_parallel=sequence_parallel,
    )
    pieces = tuple(even_pieces(w.shape[1], mesh.tp_rank, mesh.tp_size))
    set_slice_map(layer, "weight", HFSliceMap(0 if transposed else 1, pieces, transposed))
    return layer


def _embed_scale(mod: nn.Embedding) -> torch.Tensor | None:
    """The ``embed_scale`` of a scaled embedding subclass (Gemma's buffer, XGLM's float), None
    for nn.Embedding."""
    scale = None if type(mod) is nn.Embedding else getattr(mod, "embed_scale", None)
    return torch.tensor(float(scale)) if isinstance(scale, (int, float)) else scale


def check_vocab_embedding(mod: nn.Module, name: str) -> nn.Embedding:
    """The refusals of :func:`build_vocab_embedding`, without building; ``mod`` as the
    embedding it is."""
    if not isinstance(mod, nn.Embedding):
        raise ValueError(f"{name}: embedding_rowwise planned for a {type(mod).__name__}")
    if type(mod) is not nn.Embedding and not isinstance(_embed_scale(mod), torch.Tensor):
        raise ValueError(
            f"{name}: {type(mod).__name__} overrides nn.Embedding.forward in a "
            "way the vocab-parallel embedding does not know (only a scaled "
            "embedding with an `embed_scale` buffer or number is supported)"
        )
    return mod


def build_vocab_embedding(mod: nn.Module, name: str, mesh: Mesh) -> VocabParallelEmbedding:
    """Shard an embedding over the vocabulary (rows padded to a multiple of tp)."""
    emb = check_vocab_embedding(mod, name)
    scale = _embed_scale(emb)
    layer = (
        ScaledVocabParallelEmbedding if scale is not None else VocabParallelEmbedding
    ).from_embedding(emb, mesh=mesh)
    if scale is not None:
        layer.register_buffer("embed_scale", scale.detach().clone(), persistent=False)
    set_slice_map(
        layer,
        "weight",
        HFSliceMap(0, tuple(even_pieces(emb.num_embeddings, mesh.tp_rank, mesh.tp_size))),
    )
    return layer


class ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """Vocab-parallel embedding times ``embed_scale`` (Gemma's scaled word embedding)."""

    embed_scale: torch.Tensor  # a buffer registered by build_vocab_embedding

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)
