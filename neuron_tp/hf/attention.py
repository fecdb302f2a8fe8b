"""Attention heads under tensor parallelism: per-rank head counts, GQA/MQA key/value heads that
tp does not divide (replicated on as few ranks as needed), and norms over sharded features."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import UserError
from ..layers.activation_layout import SHARDED_FEATURES
from ..layers.blockwise_attention import blockwise_attention
from ..parallel import comm, regions
from ..parallel.mesh import Mesh, divisors, valid_tp_degrees

if TYPE_CHECKING:
    # transformers is not analysed (pyproject): a model read by its attribute names
    # (``config._attn_implementation``), a documented dynamic boundary.
    from transformers import PreTrainedModel

SUPPORTED_ATTN = ("eager", "sdpa", None)
BLOCKWISE = "ntp-blockwise"  # registered as f"{BLOCKWISE}-{block}" (the block size in the name)
RING = "ntp-ring"  # ring attention (:mod:`.context_parallel`), registered as f"{RING}-{block}"
DEFAULT_BLOCK = 512
# Packed rows' segment ids [b, s], passed by the model's forward down to the attention function
# of an implementation that masks by them (blockwise, ring) instead of a [b, 1, s, s] mask.
SEGMENTS_KW = "segment_ids"


def takes_segments(config) -> bool:
    """Whether the model's attention masks packed rows by segment ids (blockwise or ring
    attention: give ``model_inputs(batch, segments=True)``), not by a 4D mask."""
    impl = getattr(config, "_attn_implementation", None)
    return isinstance(impl, str) and impl.startswith((BLOCKWISE + "-", RING + "-"))


def is_supported_attention(impl: object) -> bool:
    """An attention implementation that tensor parallelism can run (heads split per rank);
    ``impl`` as read from a config (None: transformers' default, anything else: not one)."""
    return impl in SUPPORTED_ATTN or (isinstance(impl, str) and impl.startswith(BLOCKWISE + "-"))


@dataclass(frozen=True)
class Heads:
    """Head layout of one model: ``q`` query heads, ``kv`` key/value heads of size ``dim``."""

    q: int
    kv: int
    dim: int
    # (attention module name, its heads) where a layer's differ (per-layer configs: Gemma-4)
    layers: tuple[tuple[str, Heads], ...] = ()

    def at(self, name: str) -> Heads:
        """The heads of the attention module ``name`` is (or is inside)."""
        for att, h in self.layers:
            if name == att or name.startswith(att + "."):
                return h
        return self


def model_heads(config) -> Heads | None:
    """Query/key-value head counts and head size from a transformers config (None if absent;
    a per-layer count or size takes its first layer's value)."""
    if getattr(config, "per_layer_attributes", None):  # heterogeneous (Gemma-4)
        config = config.per_layer_config[0]
    q = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    if not q:
        # A multimodal model's decoder keeps its head counts in its text config (Gemma-3).
        text = getattr(config, "get_text_config", None)
        inner = text(decoder=True) if callable(text) else None
        return model_heads(inner) if inner is not None and inner is not config else None
    kv = getattr(config, "num_key_value_heads", None) or getattr(config, "num_kv_heads", None)
    if hasattr(config, "multi_query") and not getattr(config, "new_decoder_architecture", False):
        kv = 1 if config.multi_query else q  # Falcon / StarCoder: MQA, else multi-head
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    dim = getattr(config, "head_dim", None) or hidden // q
    return Heads(q, kv or q, dim)


def check_heads(heads: Heads, tp: int, world_size: int, where: str) -> None:
    """Refuse query heads that tp does not split evenly (before any collective)."""
    if heads.q % tp:
        raise UserError(
            f"{where}: num_attention_heads={heads.q} cannot be split over tp={tp} (each rank "
            f"must own whole query heads); tp degrees that work with world size {world_size}: "
            f"{valid_tp_degrees(world_size, heads.q)}"
        )


def kv_slots(heads: Heads, tp: int) -> list[list[int]]:
    """For each tp rank, the key/value heads it holds, in the order its query heads use them.

    Rank r owns query heads ``[r*q/tp, (r+1)*q/tp)``; query head ``i`` reads kv head
    ``i // (q/kv)``. A rank holds the fewest kv heads (``L`` per rank, the same on every rank)
    such that its local query heads map onto them uniformly (local group size ``q/tp/L``).
    With tp dividing kv this is the plain contiguous split; with tp > kv each kv head is
    replicated on the ``tp/kv`` ranks that need it.
    """
    local_q, group = heads.q // tp, heads.q // heads.kv
    for slots in divisors(local_q):
        block = local_q // slots
        ok = all(
            len({(r * local_q + j * block + i) // group for i in range(block)}) == 1
            for r in range(tp)
            for j in range(slots)
        )
        if ok:
            return [[(r * local_q + j * block) // group for j in range(slots)] for r in range(tp)]
    raise AssertionError("unreachable: one slot per query head always works")


def is_plain_split(slots: list[list[int]], kv: int) -> bool:
    """True when the slots are the contiguous split of the kv heads (no replication)."""
    return [h for s in slots for h in s] == list(range(kv))


class SyncReplicatedRows(torch.autograd.Function):
    """Identity forward. Backward: rows that are copies of the same kv head (on this and other
    ranks) get the sum of all copies' gradients (the gradient of the one unsharded head)."""

    @staticmethod
    def forward(ctx, w, rows, uid, n_unique, group):
        ctx.rows, ctx.uid, ctx.n_unique, ctx.group = rows, uid, n_unique, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx, g):
        part = g.index_select(0, ctx.rows)
        full = g.new_zeros((ctx.n_unique, *g.shape[1:])).index_add(0, ctx.uid, part)
        full = comm.all_reduce(full, ctx.group)
        g = g.index_copy(0, ctx.rows, full.index_select(0, ctx.uid))
        return g, None, None, None, None


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a feature dim that is sharded over tp (OLMo-2's q/k norm over all heads):
    the mean of squares is all-reduced; the weight is sharded like the features."""

    input_layout = output_layout = SHARDED_FEATURES

    def __init__(self, norm: nn.Module, mesh: Mesh, full_features: int):
        super().__init__()
        self.mesh, self.full_features = mesh, full_features
        self.eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        self.weight = norm.get_parameter("weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        # Every rank uses the sum on its own features: all-reduce forward and backward.
        ssq = regions.all_reduce_fwd_all_reduce_bwd(h.pow(2).sum(-1, keepdim=True), self.mesh.tp)
        h = h * torch.rsqrt(ssq / self.full_features + self.eps)
        return self.weight * h.to(dtype)


def patch_attention_module(attn: nn.Module, heads: Heads, tp: int, slots_per_rank: int) -> None:
    """Set the per-rank head counts on an attention module (and on its own config copy)."""
    local_q = heads.q // tp
    impl = getattr(getattr(attn, "config", None), "_attn_implementation", None)
    if not is_supported_attention(impl):
        raise UserError(
            f"{type(attn).__name__}: attention implementation {impl!r} is not "
            f"supported under tensor parallelism; use 'sdpa' or 'eager'"
        )
    updates = {
        "num_heads": local_q,
        "n_heads": local_q,
        "num_attention_heads": local_q,
        "n_head": local_q,
        "num_key_value_heads": slots_per_rank,
        "num_kv_heads": slots_per_rank,
        "kv_heads": slots_per_rank,
        "num_key_value_groups": local_q // slots_per_rank,
        "split_size": local_q * heads.dim,
        "all_head_size": local_q * heads.dim,
        "embed_dim": local_q * heads.dim,
        "d_model_size": local_q * heads.dim,
    }
    for name, value in updates.items():
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, value)
    if getattr(attn, "config", None) is not None:
        cfg = copy.copy(attn.config)
        for name in ("num_attention_heads", "num_key_value_heads", "num_kv_heads", "n_head"):
            if name in cfg.__dict__ and isinstance(cfg.__dict__[name], int):
                cfg.__dict__[name] = updates[name]
        attn.config = cfg


def _blockwise_forward(block: int):
    """transformers' AttentionInterface function running :func:`blockwise_attention` with
    ``block``; gets sdpa's masks (None for plain causal, bool otherwise), and packed rows'
    segment ids (``SEGMENTS_KW``) instead of a mask."""

    def attention(
        module,
        query,
        key,
        value,
        attention_mask,
        *,
        dropout=0.0,
        scaling=None,
        is_causal=None,
        **kw,
    ):
        if dropout:
            raise UserError(
                f"blockwise attention has no attention dropout (got {dropout}); set the "
                "model's attention_dropout to 0 or use attn_implementation='sdpa'"
            )
        if kw.get("output_attentions"):
            raise UserError("blockwise attention cannot return attention weights")
        q_len, kv_len = query.shape[2], key.shape[2]
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        # sdpa's rule: a causal model gets its mask as None when causal masking is all there is
        # (top-left aligned, as sdpa's is_causal); with a mask and as many queries as keys the
        # mask is a subset of the causal one, so the blocks above the diagonal can be skipped.
        causal = bool(is_causal) and q_len > 1 and (attention_mask is None or q_len == kv_len)
        if attention_mask is None and causal and kv_len > q_len:
            key, value = key[:, :, :q_len], value[:, :, :q_len]
        window = kw.get("sliding_window") if causal and q_len == kv_len else None
        segments = kw.get(SEGMENTS_KW)
        if segments is not None and not (causal and q_len == kv_len):
            raise UserError(
                "packed rows' segment ids mask a causal self-attention over the whole row "
                f"(got {q_len} queries over {kv_len} keys, causal={causal})"
            )
        out = blockwise_attention(
            query,
            key,
            value,
            attention_mask,
            causal=causal,
            scale=scaling,
            block=block,
            sliding_window=window,
            softcap=kw.get("softcap"),
            segment_ids=segments,
        )
        return out.transpose(1, 2).contiguous(), None

    return attention


def blockwise_name(block: int = DEFAULT_BLOCK) -> str:
    """Register the blockwise attention with ``block`` in transformers and return its
    ``attn_implementation`` name (usable in ``from_pretrained`` / ``from_config`` too)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if block < 1:
        raise UserError(f"attention block size must be positive, got {block}")
    name = f"{BLOCKWISE}-{block}"
    AttentionInterface.register(name, _blockwise_forward(block))
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return name


def use_blockwise_attention(model: PreTrainedModel, block: int = DEFAULT_BLOCK) -> str:
    """Switch ``model`` (a transformers model, parallelized or not) to blockwise attention with
    ``block``, in place: the [heads, s, s] scores are never materialised. Returns the name."""
    name = blockwise_name(block)
    old = model.config._attn_implementation
    if not is_supported_attention(old):
        raise UserError(
            f"{type(model).__name__}: blockwise attention replaces 'sdpa' or 'eager', got "
            f"attn_implementation={old!r}"
        )
    for module in model.modules():  # parallelize gives attention modules their own configs
        cfg = getattr(module, "config", None)
        if cfg is not None and is_supported_attention(getattr(cfg, "_attn_implementation", 0)):
            cfg._attn_implementation = name
    model.config._attn_implementation = name
    return name
