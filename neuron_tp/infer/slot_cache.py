"""The KV cache of :class:`~neuron_tp.infer.slots.SlotGenerator`: one static tensor pair per
layer, ``[slots, local kv heads, max_len + 1, head dim]``, where every row (slot) writes at its
OWN positions (a scatter whose indices are device data), as a transformers ``Cache``.

Index ``max_len`` is scratch: padding of a prefill chunk and the rows of inactive slots write
there, and no attention mask of a live query ever admits it (a query at position ``p`` sees
``kv <= p < max_len``). Imports transformers: import this module lazily.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import UserError


def kv_shapes(model) -> list[tuple[int, int, torch.dtype]]:
    """``(local kv heads, head dim, dtype)`` of every attention layer, in ``layer_idx`` order,
    read from the (possibly tp-sharded) model: the local ``k_proj`` rows / head dim."""
    found: dict[int, tuple[int, int, torch.dtype]] = {}
    for module in model.modules():
        idx, k_proj = getattr(module, "layer_idx", None), getattr(module, "k_proj", None)
        if not isinstance(idx, int) or not isinstance(
            getattr(k_proj, "weight", None), torch.Tensor
        ):
            continue
        heads_q = getattr(module.config, "num_attention_heads", None)
        dim = getattr(module, "head_dim", None) or module.config.hidden_size // heads_q
        found[idx] = (k_proj.weight.shape[0] // dim, dim, k_proj.weight.dtype)
    n = model.config.get_text_config(decoder=True).num_hidden_layers
    if sorted(found) != list(range(n)):
        raise UserError(
            f"{type(model).__name__}: slot generation needs attention modules with a k_proj "
            f"projection and a layer_idx on each of the {n} layers (Llama-style models); "
            f"found them on layers {sorted(found)}"
        )
    return [found[i] for i in range(n)]


def allocate(model, slots: int, max_len: int, device) -> list[torch.Tensor]:
    """Zeroed keys and values of every layer: ``[k0, v0, k1, v1, ...]``, each made on the host
    and transferred (device data, not a graph to compile)."""
    out = []
    for heads, dim, dtype in kv_shapes(model):
        shape = (slots, heads, max_len + 1, dim)
        out += [torch.zeros(shape, dtype=dtype).to(device) for _ in range(2)]
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
    written at ``positions`` [B, Q] of slots ``rows`` [B], read as rows ``read``."""

    def __init__(self, kv: list[torch.Tensor], rows, positions, read):
        layers = [SlotLayer(kv[i], kv[i + 1], rows, positions, read) for i in range(0, len(kv), 2)]
        super().__init__(layers=layers)

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in (layer.keys, layer.values)]


def visible(positions: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, 1, Q, length]`` boolean mask: a query at cache index ``p`` sees ``kv <= p``
    (its own sequence's past, itself included; never the scratch index of a live query)."""
    kv = torch.arange(length, device=positions.device)
    return (kv[None, None, :] <= positions[:, :, None])[:, None]
