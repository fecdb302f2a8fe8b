"""What the static and the slot generator share about one step of the model: the bucket a
length runs in, the model kwargs that turn off outputs generation never reads, the name the
model takes its cache under, the attention mask in the form the model's attention takes, and
the check that every layer's static cache holds the whole sequence."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import UserError

if TYPE_CHECKING:
    from torch import nn


def pick_bucket(length: int, buckets: Sequence[int], what: str = "prompt") -> int:
    """The smallest bucket that holds ``length`` (ValueError when none does)."""
    for b in sorted(buckets):
        if length <= b:
            return b
    unit = "tokens" if what == "prompt" else "sequences"
    raise ValueError(
        f"{what} of {length} {unit} is longer than the largest bucket {max(buckets)}"
        f" (buckets: {', '.join(map(str, sorted(buckets)))})"
    )


def no_aux_outputs(config) -> dict:
    """Model kwargs that turn off outputs generation never uses: an MoE model whose config asks
    for router logits (its training auxiliary loss) would compute that loss from the 4D
    attention mask, which transformers' load-balancing loss cannot read."""
    return {"output_router_logits": False} if hasattr(config, "output_router_logits") else {}


def cache_kwargs(model, cache) -> dict:
    """``{name: cache}`` for the model's forward: ``cache`` where it takes that argument
    (transformers >= 5.24, which deprecates ``past_key_values=`` for removal in 5.40), else
    ``past_key_values``. A peft wrapper is looked through to its base model."""
    base = getattr(model, "get_base_model", None)
    cls: type[nn.Module] = type(base() if callable(base) else model)
    return {_cache_name(cls.forward): cache}


def attention_mask_for(model, allowed: torch.Tensor) -> torch.Tensor:
    """A boolean ``[batch, 1, queries, keys]`` mask (True: visible) as ``model``'s attention
    takes it: transformers hands a 4-D mask to the attention function as it is, and eager
    attention (GPT-OSS's, with its sinks) adds it to the scores, so it gets 0 where visible
    and the dtype's minimum elsewhere; sdpa and blockwise attention take the boolean."""
    if getattr(model.config, "_attn_implementation", None) != "eager":
        return allowed
    dtype = model.get_input_embeddings().weight.dtype
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


@functools.cache
def _cache_name(forward: Callable[..., object]) -> str:
    """Keyed by the class's forward function (a class object is not Hashable to mypy)."""
    params = inspect.signature(forward).parameters  # follows functools.wraps wrappers
    return "cache" if "cache" in params else "past_key_values"


def check_cache(config, total: int, what: str) -> None:
    """ValueError unless every layer of the model's static cache holds the whole sequence:
    full-attention layers, or sliding windows at least as long as the cache. A shorter
    window rolls (its keys no longer line up with the in-graph attention mask) and counts
    positions in a host int, which a replayed graph would freeze. ``what``: where the
    ``total`` positions come from and what to change."""
    from transformers import StaticCache

    try:
        layers = StaticCache(config=config, max_cache_len=total).layers
    except KeyError as e:
        raise UserError(
            f"layer type {e} has no static cache in transformers: generation with a fixed "
            f"graph set needs full or sliding attention layers"
        ) from None
    short = {
        layer.max_cache_len
        for layer in layers
        if getattr(layer, "max_cache_len", total) < total  # a layer with no cache: none
    }
    if "local" in (getattr(config, "attention_layers", None) or []):  # GPT-Neo's local layers
        short |= {config.window_size} if config.window_size < total else set()
    if short:
        raise ValueError(
            f"the model's sliding window ({min(short)} positions) is shorter than the "
            f"{total}-position cache {what}"
        )
