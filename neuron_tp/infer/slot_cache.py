"""The KV cache of :class:`~neuron_tp.infer.slot_generator.SlotGenerator`: one static tensor
pair per layer, ``[slots, local kv heads, max_len + 1, head dim]``, where every row (slot)
writes at its OWN positions (a scatter whose indices are device data), as a transformers
``Cache``.

Index ``max_len`` is scratch: padding of a prefill chunk and the rows of inactive slots write
there, and no attention mask of a live query ever admits it (a query at position ``p`` sees
``kv <= p < max_len``). Imports transformers: import this module lazily.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import UserError
from ..layers.linear import ColumnParallelLinear

RECURRENT = frozenset({"linear_attention", "linear", "mamba", "conv", "recurrent", "hybrid"})
"""``layer_types`` whose state is (or holds) a recurrence, not only keys and values (a k_proj
there is no attention's)."""


def kv_shapes(model) -> list[tuple[int, int, torch.dtype]]:
    """``(local kv heads, head dim, dtype)`` of every attention layer, in ``layer_idx`` order,
    read from the (possibly tp-sharded) model: the local ``k_proj`` rows / head dim, or (fused
    projections, e.g. GPT-2) the module's own per-rank head count. UserError for a model
    whose state is not one KV cache per layer, or whose masks slots cannot give."""
    _refuse_2d_mask_biases(model)
    text = model.config.get_text_config(decoder=True)
    kinds = list(getattr(text, "layer_types", None) or [])
    found: dict[int, tuple[int, int, torch.dtype]] = {}
    for module in model.modules():
        idx = _first_int(module, "layer_idx", "layer_id")
        if idx is None or (idx < len(kinds) and kinds[idx] in RECURRENT):
            continue
        if (shape := _local_kv(module)) is not None:
            found[idx] = shape
    n = text.num_hidden_layers
    missing = [i for i in range(n) if i not in found]
    if missing:
        named = sorted({kinds[i] for i in missing if i < len(kinds)})
        kind = f" (they are {', '.join(named)} layers, whose state is not only a KV cache)"
        raise UserError(
            f"{type(model).__name__}: slot generation keeps a KV cache per layer and needs an "
            f"attention module (a k_proj, or num_heads and head_dim, and a layer_idx) on each "
            f"of the {n} layers; layers {missing} have none" + (kind if named else "")
        )
    return [found[i] for i in range(n)]


def _refuse_2d_mask_biases(model) -> None:
    if any(callable(getattr(m, "build_alibi_tensor", None)) for m in model.modules()):
        raise UserError(
            f"{type(model).__name__}: its ALiBi biases are built from a 2-D padding mask, and "
            f"slot generation gives the model a 4-D mask per slot; use neuron-tp generate"
        )


def kv_tensor_shapes(model) -> list[tuple[int, int, torch.dtype]]:
    """``(heads, dim, dtype)`` of every cache tensor, ``[k0, v0, k1, v1, ...]``: a layer's keys
    and values alike, except a multi-head latent attention layer's (:mod:`neuron_tp.hf.mla`),
    whose cache holds its latents, replicated: one "head" of ``kv_lora_rank`` features for the
    keys and one of ``qk_rope_head_dim`` for the values."""
    from ..hf.mla import latent_cache_dims

    latent: dict[int, tuple[int, int]] = {}
    for module in model.modules():
        dims = latent_cache_dims(module)
        if dims is not None:
            latent[module.layer_idx] = dims
    out = []
    for i, (heads, dim, dtype) in enumerate(kv_shapes(model)):
        if i in latent:
            out += [(1, latent[i][0], dtype), (1, latent[i][1], dtype)]
        else:
            out += [(heads, dim, dtype)] * 2
    return out


def _local_kv(module) -> tuple[int, int, torch.dtype] | None:
    from ..hf.mla import latent_cache_dims

    if (dims := latent_cache_dims(module)) is not None:
        return 1, dims[0], next(module.parameters()).dtype
    weight = next((p for p in module.parameters(recurse=True)), None)
    dim = getattr(module, "head_dim", None)
    if getattr(module, "is_kv_shared_layer", False) is True and weight is not None:
        # Reads an earlier layer's keys and values, writes none: a one-feature placeholder
        # (a zero-size tensor is no graph input or output on XLA, so not carried by a step).
        return 1, 1, weight.dtype
    k_linear = getattr(module, "k_proj", None)
    k_proj = getattr(k_linear, "weight", None)
    if isinstance(k_proj, torch.Tensor):
        if not isinstance(dim, int):
            dim = module.config.hidden_size // module.config.num_attention_heads
        rows = k_proj.shape[0]
        if isinstance(k_linear, ColumnParallelLinear) and k_linear.gather_output:
            rows = k_linear.out_features  # every head
        return rows // dim, dim, k_proj.dtype
    heads = _first_int(
        module, "num_key_value_heads", "kv_heads", "num_heads", "n_heads", "num_attention_heads"
    )
    config = getattr(module, "config", None)  # the module's own copy, with this rank's heads
    if heads is None and config is not None:
        heads = _first_int(config, "num_key_value_heads", "num_attention_heads")
    dim = dim if isinstance(dim, int) else getattr(module, "head_size", None)
    if isinstance(heads, int) and isinstance(dim, int) and weight is not None:
        return heads, dim, weight.dtype
    return None


def _first_int(obj, *names: str) -> int | None:
    for name in names:
        try:
            value = getattr(obj, name, None)
        except (AttributeError, RuntimeError):  # a heterogeneous config's per-layer attribute
            value = None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def allocate(model, slots: int, max_len: int, device, *, split=None) -> list[torch.Tensor]:
    """Zeroed keys and values of every layer: ``[k0, v0, k1, v1, ...]``, each made on the host
    and transferred (device data, not a graph to compile). ``split``: a
    :class:`~.kv_split.SeqSplit`, this rank's positions only (``local_len + 1`` per slot)."""
    out = []
    length = max_len + 1 if split is None else split.local_len + 1
    for heads, dim, dtype in kv_tensor_shapes(model):
        out.append(torch.zeros((slots, heads, length, dim), dtype=dtype).to(device))
    return out


class SlotLayer(CacheLayerMixin):
    """One layer: writes ``key_states`` [B, H, Q, D] at ``(rows[b], positions[b, q])`` and
    returns the rows ``read`` (a tensor of slot indices or a slice) of the whole cache."""

    is_compileable = False
    is_sliding = False

    def __init__(self, keys, values, rows, positions, read):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.rows, self.positions, self.read = rows, positions, read

    def lazy_initialization(self, key_states, value_states) -> None:  # allocated up front
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        r, p = self.rows[:, None], self.positions  # [B, 1], [B, Q]
        self.keys[r, :, p] = key_states.transpose(1, 2).to(self.keys.dtype)
        self.values[r, :, p] = value_states.transpose(1, 2).to(self.values.dtype)
        if isinstance(self.read, slice):
            return self.keys[self.read], self.values[self.read]
        return self.keys.index_select(0, self.read), self.values.index_select(0, self.read)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return 0  # positions are per row; the model gets explicit position_ids

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """The cache of one step: the tensors of ``kv`` (``[k0, v0, ...]``, updated in place),
    written at ``positions`` [B, Q] of slots ``rows`` [B], read as rows ``read``; ``split``: a
    sequence-split cache (:mod:`.kv_split`): ``positions`` are global, each written at its
    local index on the rank owning it (the scratch row elsewhere)."""

    def __init__(self, kv: list[torch.Tensor], rows, positions, read, *, split=None):
        local = positions if split is None else split.local_index(positions)
        layers = [SlotLayer(kv[i], kv[i + 1], rows, local, read) for i in range(0, len(kv), 2)]
        super().__init__(layers=layers)

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in (layer.keys, layer.values)]


def visible(positions: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, 1, Q, length]`` boolean mask: a query at cache index ``p`` sees ``kv <= p``
    (its own sequence's past, itself included; never the scratch index of a live query)."""
    kv = torch.arange(length, device=positions.device)
    return (kv[None, None, :] <= positions[:, :, None])[:, None]
