"""Attention heads per layer: a config with per-layer fields (transformers' heterogeneous
configs, Gemma-4: global layers with their own head size and key/value heads) gives each
attention module its own :class:`~neuron_tp.hf.attention.Heads`; layers that reuse another
layer's keys and values must split them as that layer does."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .attention import Heads, model_heads


def _own_heads(mod: nn.Module) -> Heads | None:
    """The heads of attention module ``mod`` from its layer's config (None: the model's)."""
    cfg = getattr(mod, "config", None)
    idx = getattr(mod, "layer_idx", None)
    if cfg is None or not getattr(cfg, "per_layer_attributes", None) or not isinstance(idx, int):
        return None
    return model_heads(cfg.per_layer_config[idx])


def with_layer_heads(model: nn.Module, attention: frozenset[str], heads: Heads | None):
    """``heads`` (None: the model's config has none) with the attention modules (names in
    ``attention``) whose layer config has its own head counts (:meth:`Heads.at` reads them);
    ValueError when layers that share keys and values (``is_kv_shared_layer``: they read
    those of an earlier layer of their type) differ in heads, since each rank must hold the
    same key/value heads for all of them."""
    if heads is None:
        return None
    found = [(n, h) for n in sorted(attention) if (h := _own_heads(model.get_submodule(n)))]
    if not found:
        return heads
    base = replace(heads, layers=tuple(found))
    by_type: dict[str, list[tuple[str, Heads]]] = {}
    shares = False
    for name in sorted(attention):
        mod = model.get_submodule(name)
        shares |= bool(getattr(mod, "is_kv_shared_layer", False))
        by_type.setdefault(str(getattr(mod, "layer_type", None)), []).append((name, base.at(name)))
    for kind, layers in by_type.items() if shares else ():
        first = layers[0]
        odd = next(((n, h) for n, h in layers if h != first[1]), None)
        if odd is not None:
            raise ValueError(
                f"{odd[0]}: {kind} layers share keys and values across layers, but its heads "
                f"({odd[1].q} query, {odd[1].kv} key/value of size {odd[1].dim}) differ from "
                f"{first[0]}'s ({first[1].q}, {first[1].kv}, {first[1].dim}): tensor "
                "parallelism cannot give every rank the same key/value heads for both"
            )
    return base
