"""The loss of a ``parallel_loss`` model, computed from its vocab-sharded logits (the LM head
output is never gathered in training), and :func:`full_logits` to gather them when needed."""

from __future__ import annotations

import contextlib
import functools

from torch import nn

from ..layers import parallel_cross_entropy
from ..parallel.mesh import Mesh
from .moe import aux_loss_over_all_tokens, recorded_router_logits


@contextlib.contextmanager
def full_logits(model: nn.Module):
    """Inside this context a ``parallel_loss`` model returns full (gathered) logits, e.g. for
    ``generate()`` or evaluation; outside it the LM head output stays vocab-sharded."""
    head = model.get_output_embeddings()
    if not hasattr(head, "gather_output"):
        raise ValueError(f"{type(model).__name__} is not parallelized (no sharded LM head)")
    before = head.gather_output
    head.gather_output = True
    try:
        yield model
    finally:
        head.gather_output = before


def is_causal(model: nn.Module) -> bool:
    """A causal LM (labels shifted): a decoder's LM head, or a multimodal decoder's (Gemma-3's
    ``ForConditionalGeneration`` without an encoder-decoder config)."""
    n = type(model).__name__
    if "ForConditionalGeneration" in n:
        return not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
    return "CausalLM" in n or "LMHead" in n or n in _causal_lm_classes()


def _causal_lm_classes() -> set[str]:
    """The class names transformers maps as causal LMs (e.g. ``BertGenerationDecoder``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found: set[str] = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        found.update([v] if isinstance(v, str) else v)
    return found


def wrap_loss(model: nn.Module, mesh: Mesh) -> None:
    """With ``labels``: loss from the vocab-sharded logits (HF's shift for causal LMs, or
    ``shift_labels`` as given, already shifted, as transformers' loss functions take it), plus
    an MoE model's router auxiliary loss times ``router_aux_loss_coef`` when it returns one
    (with a 4-D packed attention mask, computed over every position)."""
    forward = model.forward
    vocab = model.config.get_text_config(decoder=True).vocab_size
    causal = is_causal(model)

    @functools.wraps(forward)
    def wrapped(*args, labels=None, shift_labels=None, **kwargs):
        mask = kwargs.get("attention_mask")
        router = kwargs.get("output_router_logits")
        router = getattr(model.config, "output_router_logits", False) if router is None else router
        if router and mask is not None and mask.dim() == 4:
            # transformers' load-balancing loss cannot read a 4-D (packed) mask: count every
            # position instead, from the router logits recorded here.
            with recorded_router_logits(model) as logits:
                out = forward(*args, **{**kwargs, "output_router_logits": False})
            out.aux_loss = aux_loss_over_all_tokens(model, logits)
        else:
            out = forward(*args, **kwargs)
        if labels is not None:
            logits = out.logits
            if shift_labels is not None:  # already shifted (transformers' loss argument)
                labels = shift_labels
            elif causal:
                labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            # HF gradient accumulation (causal LMs' loss_function): sum / num_items_in_batch
            n_items = kwargs.get("num_items_in_batch") if causal else None
            out.loss = parallel_cross_entropy(
                logits,
                labels.to(logits.device),
                mesh=mesh,
                vocab_size=vocab,
                reduction="mean" if n_items is None else "sum",
            )
            if n_items is not None:
                out.loss = out.loss / n_items
            aux = getattr(out, "aux_loss", None)
            if aux is not None:  # MoE load balancing: transformers adds it to the loss
                coef = getattr(model, "router_aux_loss_coef", model.config.router_aux_loss_coef)
                out.loss = out.loss + coef * aux.to(out.loss.device)
        return out

    model.forward = wrapped
