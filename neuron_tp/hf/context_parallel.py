"""Context parallelism for transformers causal LMs (Llama family): each rank of the ``cp`` ring
runs the model on 1/cp of every sequence, attention by ring attention over the ring.

:func:`context_parallel` switches a model (parallelized over tp or not) in place:

- its attention core becomes :func:`neuron_tp.layers.ring_attention.ring_attention` over
  ``mesh.cp`` (registered in transformers as ``ntp-ring-<block>``, with no mask function, so
  transformers builds no mask: the ring is causal by construction);
- its ``forward`` takes the GLOBAL ``input_ids`` / ``labels`` (every rank of the ring the same
  rows) and runs on this rank's part (:func:`~neuron_tp.layers.ring_attention.split_sequence`:
  chunks r and 2cp-1-r), with ``position_ids`` the positions of those tokens (RoPE): the
  global ones, or the given ones (packed rows: restarting with each sample);
- packed rows (several samples per row, :mod:`neuron_tp.hf.packing`) come as the GLOBAL
  ``segment_ids`` ``[b, S]`` (``model_inputs(..., segments=True)``) instead of a 4D mask: ring
  attention masks each tile by segment (a token attends the earlier tokens of its own sample,
  a padding token only itself), so no ``s x s`` mask is ever built;
- the labels are shifted on the global sequence first (the label of a chunk's last token is
  the next chunk's first token) and the loss is summed over this rank's label tokens, divided
  by the number of label tokens of the global rows (or ``num_items_in_batch``), then summed
  over the ring: every rank returns the loss of the whole sequence, and its backward gives each
  rank the gradient of its own tokens' part. Parameters are replicated over cp: their gradients
  are summed over ``mesh.replicas`` (dp x cp), as :mod:`neuron_tp.optim.grads` does.

Outputs (``logits``) are this rank's part, in the split order; gather them with
:func:`~neuron_tp.layers.ring_attention.gather_sequence`. Refused: attention masks (packed rows
come as ``segment_ids``; padding at the end of a row needs no mask: its labels are -100),
sliding-window or softcapped attention, attention dropout, and attention implementations other
than sdpa / eager / blockwise.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import UserError
from ..layers.ring_attention import check_length, ring_attention, split_sequence
from ..parallel import regions
from ..parallel.mesh import Group, Mesh
from .attention import DEFAULT_BLOCK, RING, SEGMENTS_KW, is_supported_attention
from .packing import IGNORE_INDEX, next_token_targets

if TYPE_CHECKING:
    # transformers is not analysed (pyproject): a causal LM read by its attribute names
    # (``config``, ``forward``), a documented dynamic boundary.
    from transformers import PreTrainedModel

__all__ = ["context_parallel", "ring_name", "RING"]


def _ring_forward(block: int):
    """transformers' AttentionInterface function running ring attention over the module's
    ``cp_group`` (set by :func:`context_parallel`)."""

    def attention(  # noqa: PLR0917 (transformers' attention-function signature)
        module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kw
    ):
        where = type(module).__name__
        if dropout:
            raise UserError(
                f"{where}: ring attention has no attention dropout (got {dropout}); set the "
                "model's attention_dropout to 0"
            )
        if attention_mask is not None:
            raise UserError(f"{where}: ring attention (--cp) takes no attention mask")
        for name in ("sliding_window", "softcap"):
            if kw.get(name) is not None:
                raise UserError(
                    f"{where}: {name}={kw[name]} is not supported by ring attention (--cp); "
                    "models with full causal attention (Llama, Qwen2/3, Mistral without "
                    "sliding window) work"
                )
        if is_causal is False or not getattr(module, "is_causal", True):
            raise UserError(f"{where}: ring attention (--cp) is causal only")
        out = ring_attention(
            query,
            key,
            value,
            module.cp_group,
            scale=scaling,
            block=block,
            segment_ids=kw.get(SEGMENTS_KW),
        )
        return out.transpose(1, 2).contiguous(), None

    return attention


def ring_name(block: int = DEFAULT_BLOCK) -> str:
    """Register ring attention with ``block`` in transformers; returns its name. No mask
    function is registered: transformers then passes no mask (nothing of s x s is built)."""
    from transformers import AttentionInterface

    if block < 1:
        raise UserError(f"attention block size must be positive, got {block}")
    name = f"{RING}-{block}"
    AttentionInterface.register(name, _ring_forward(block))
    return name


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [
        m
        for m in model.modules()
        if hasattr(m, "is_causal") and getattr(m, "config", None) is not None
    ]


def _check_model(model: PreTrainedModel) -> None:
    name = type(model).__name__
    impl = model.config._attn_implementation
    if not is_supported_attention(impl) or str(impl).startswith(RING):
        raise UserError(
            f"{name}: context parallelism replaces an 'sdpa', 'eager' or blockwise attention, "
            f"got attn_implementation={impl!r}"
        )
    if "CausalLM" not in name:
        raise UserError(f"{name}: context parallelism (--cp) is for causal LMs (*ForCausalLM)")
    if not _attention_modules(model):
        raise UserError(
            f"{name}: no attention modules with transformers' attention interface found; "
            "context parallelism (--cp) works with Llama-family models"
        )
    window = getattr(model.config, "sliding_window", None)
    if window is not None and getattr(model.config, "use_sliding_window", True):
        raise UserError(
            f"{name}: sliding_window={window} is not supported under --cp; models with full "
            "causal attention (Llama, Qwen2/3, Mistral with sliding_window=None) work"
        )


def context_parallel(
    model: PreTrainedModel, mesh: Mesh, block: int = DEFAULT_BLOCK
) -> PreTrainedModel:
    """Make ``model`` (a transformers causal LM, parallelized or not) context-parallel over
    ``mesh.cp``, in place (see the module doc); returns it. A no-op at cp = 1."""
    if mesh.cp_size == 1:
        return model
    _check_model(model)
    name = ring_name(block)
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and is_supported_attention(getattr(cfg, "_attn_implementation", 0)):
            cfg._attn_implementation = name
    model.config._attn_implementation = name
    for module in _attention_modules(model):
        # a plain attribute (nn.Module.__setattr__ is typed for tensors and modules only)
        module.cp_group = mesh.cp  # type: ignore[assignment]
    model.forward = _split_forward(model.forward, mesh.cp)
    return model


def split_rows(group: Group, **rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's part of every ``[batch, seq]`` row tensor of ``rows`` over the cp ring
    ``group`` (its chunks ``r`` and ``2 cp - 1 - r``; shift targets on the whole row before:
    :func:`~neuron_tp.hf.packing.next_token_targets`). The one split of a model's inputs, for
    the whole model (:func:`context_parallel`) and for a pipeline stage."""
    return {name: split_sequence(t, group, 1) for name, t in rows.items()}


def _split_forward(forward, group: Group):
    @functools.wraps(forward)
    def wrapped(  # noqa: PLR0913
        input_ids=None,
        labels=None,
        *,
        position_ids=None,
        attention_mask=None,
        segment_ids=None,
        **kw,
    ):
        if input_ids is None or kw.get("inputs_embeds") is not None:
            raise UserError("a context-parallel model takes input_ids (not inputs_embeds)")
        if attention_mask is not None:
            raise UserError(
                "a context-parallel model (--cp) takes no attention_mask: give packed rows "
                "as segment_ids [batch, seq] (neuron_tp.hf.packing.model_inputs(batch, "
                "segments=True)); padding at the end of a row needs no mask"
            )
        b, s = input_ids.shape
        check_length(s, group.size)
        if segment_ids is not None:
            if segment_ids.shape != input_ids.shape or segment_ids.is_floating_point():
                raise UserError(
                    f"segment_ids must be an integer tensor of input_ids' shape {(b, s)}, "
                    f"got {segment_ids.dtype} {tuple(segment_ids.shape)}"
                )
            kw[SEGMENTS_KW] = segment_ids
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
        local = split_rows(group, input_ids=input_ids, position_ids=position_ids)
        if labels is None:
            return forward(**local, **kw)
        shifted = next_token_targets(labels)
        items = kw.pop("num_items_in_batch", None)
        if items is None:
            items = (shifted != IGNORE_INDEX).sum().clamp(min=1)
        mine = split_rows(group, targets=shifted)["targets"]
        out = forward(**local, labels=mine, shift_labels=mine, num_items_in_batch=items, **kw)
        out.loss = regions.all_reduce_fwd_identity_bwd(out.loss, group)
        return out

    return wrapped
