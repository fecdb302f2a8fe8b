"""Activation recompute: trade compute for the memory of saved activations.

- ``full``: each decoder layer keeps only its input; its activations are recomputed in backward.
- ``selective``: only the attention core (softmax(QK^T)V, the activations that grow with the
  sequence squared) is recomputed, Megatron's choice (Korthikanti et al.).

On XLA the whole step is one graph, and the compiler's common-subexpression elimination would
merge a plain recompute with the forward and keep the activations after all. torch-xla's
``checkpoint`` passes the recompute's inputs through an optimization barrier, which the
compiler may not look through: the recompute really happens (see the HLO test). Eager devices
(gloo ranks) use ``torch.utils.checkpoint`` (non-reentrant).
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable

import torch

from ..backend import xla as _xla
from .dropout import resumable

__all__ = ["Recompute", "checkpoint", "apply_activation_checkpointing"]


class Recompute(str, enum.Enum):
    """What to recompute in backward."""

    NONE = "none"
    FULL = "full"  # every decoder layer
    SELECTIVE = "selective"  # the attention core only


def checkpoint(fn: Callable, *args: torch.Tensor):
    """``fn(*args)`` without saving its activations: recomputed in backward. Keyword arguments
    go in a ``functools.partial``; on XLA at least one of ``args`` must require grad."""
    fn = resumable(fn)
    if any(isinstance(a, torch.Tensor) and _xla.is_xla(a) for a in args):
        from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

        return xla_checkpoint(fn, *args)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return torch_checkpoint(fn, *args, use_reentrant=False)


def _attention_core(original: str):
    """An attention function (transformers' AttentionInterface signature) that runs
    ``original`` under :func:`checkpoint` while training."""

    def core(module, query, key, value, attention_mask, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if original == "eager":  # the model's own eager function lives in its modeling file
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[original]
        if not (module.training and torch.is_grad_enabled()):
            return fn(module, query, key, value, attention_mask, **kwargs)

        def run(q, k, v):
            return fn(module, q, k, v, attention_mask, **kwargs)[0]

        return checkpoint(run, query, key, value), None

    return core


def _set_attention(model, original: str) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = f"ntp-recompute-{original}"
    AttentionInterface.register(name, _attention_core(original))
    # The same attention mask as the wrapped implementation (eager: additive float; an
    # unregistered name would get sdpa's boolean mask, added to eager's scores as 0/1).
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
    model.config._attn_implementation = name
    # neuron_tp.parallelize gives each attention module its own config copy (local head
    # counts): those read the implementation from their copy.
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and getattr(cfg, "_attn_implementation", None) == original:
            cfg._attn_implementation = name


def apply_activation_checkpointing(model, mode: str | Recompute) -> None:
    """Recompute ``mode`` ("none", "full" or "selective") in ``model``, a transformers model
    (sharded by :func:`neuron_tp.parallelize` or not), in place; effective in training mode."""
    mode = Recompute(mode)
    if mode is Recompute.NONE:
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support activation checkpointing "
            "(transformers marks it supports_gradient_checkpointing=False)"
        )
    if mode is Recompute.FULL:
        model._set_gradient_checkpointing(enable=True, gradient_checkpointing_func=checkpoint)
        return
    original = model.config._attn_implementation or "eager"
    if original.startswith(("ntp-recompute-", "ntp-blockwise-", "ntp-ring-")):
        return  # blockwise and ring attention recompute their tiles already
    if original.startswith("flash") or original.startswith("paged"):
        raise ValueError(
            f"selective recompute wraps the eager/sdpa attention core, got "
            f"attn_implementation={original!r}; use 'eager' or 'sdpa'"
        )
    _set_attention(model, original)
