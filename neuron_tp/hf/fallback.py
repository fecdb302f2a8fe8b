"""The fallback for architectures without an explicit :class:`~neuron_tp.hf.styles.ArchPlan`:
the styles transformers ships (``config.base_model_tp_plan`` / ``model._tp_plan``) and the
model's structure guessed from module names.

This is the only place that guesses. An architecture the guesses get wrong needs an explicit
plan in :data:`neuron_tp.hf.plans.ARCH_PLANS`, not another guess here."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from torch import nn

from .styles import STYLES, ModelStructure, Style

if TYPE_CHECKING:
    # transformers is not analysed (pyproject): a documented dynamic boundary, read by its
    # attribute names (``config``, ``_tp_plan``, ``get_input_embeddings``).
    from transformers import PreTrainedModel

# Class-name substrings (lower case) of attention modules, and of the attention / MLP modules
# whose column-parallel children all read the module's own input.
_ATTENTION_WORDS = ("attention", "attn")
_UNIT_WORDS = _ATTENTION_WORDS + ("mlp", "intermediate", "feedforward")
# Attribute paths of the final norm on the base model, tried in order.
_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "decoder.final_layer_norm")


def _class_has(mod: nn.Module, words: tuple[str, ...]) -> bool:
    name = type(mod).__name__.lower()
    return any(w in name for w in words)


def _name_of(model: nn.Module, target: nn.Module | None) -> str | None:
    return next((n for n, m in model.named_modules() if target is not None and m is target), None)


def _pattern_matches(pattern: str, name: str) -> bool:
    rx = "^" + r"[^.]+".join(re.escape(p) for p in pattern.split("*")) + "$"
    return re.match(rx, name) is not None


def shipped_styles(model: PreTrainedModel) -> dict[str, str]:
    """``{full module-name pattern: style}`` from the plan transformers ships, plus the input
    embedding (vocab-parallel) and the LM head (gathered column); ValueError if there is none."""
    prefix = getattr(model, "base_model_prefix", "")
    has_prefix = bool(prefix) and hasattr(model, prefix)
    base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    shipped = dict(getattr(model, "_tp_plan", None) or {})
    if not base and not shipped and not _unplanned_experts(model, {}):
        model_type = getattr(model.config, "model_type", None)
        raise ValueError(
            f"{type(model).__name__}: no tensor-parallel plan (model_type {model_type!r} ships "
            f"none and there is no built-in one); pass plan={{'module.pattern': style}} with "
            f"styles from {STYLES}"
        )
    emb = _name_of(model, model.get_input_embeddings())
    if emb is not None:
        shipped.setdefault(emb, Style.VOCAB_EMBEDDING.value)
    plan = {(f"{prefix}.{k}" if has_prefix else k): v for k, v in base.items()}
    plan.update(shipped)
    plan = _without_expert_params(plan)
    plan.update(_unplanned_experts(model, plan))
    head = _name_of(model, output_embeddings(model))
    if head is not None:
        plan = {
            k: v
            for k, v in plan.items()
            if not _pattern_matches(k, head) or v == Style.COLUMN_GATHER_OUTPUT.value
        }
        plan[head] = Style.COLUMN_GATHER_OUTPUT.value
    return plan


# How transformers' plans split the fused parameters of an experts module (``experts.gate_up_proj:
# packed_colwise``, Llama-4's ``packed_rowwise``...): neuron_tp's ``moe_tp_experts`` on the
# module decides that from the module's own layout (neuron_tp.hf.moe).
_EXPERT_PARAM_STYLES = ("colwise", "rowwise", "packed_colwise", "packed_rowwise")


def _without_expert_params(plan: dict[str, str]) -> dict[str, str]:
    """``plan`` without the entries that split the parameters of a ``moe_tp_experts``
    module (any other entry under it, e.g. an identity expert, stays and is refused)."""
    experts = [k + "." for k, v in plan.items() if v == Style.MOE_EXPERTS.value]
    return {
        k: v
        for k, v in plan.items()
        if not (v in _EXPERT_PARAM_STYLES and any(k.startswith(e) for e in experts))
    }


def _unplanned_experts(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``moe_tp_experts`` for the experts modules (transformers' experts interface) the shipped
    plan leaves out (gpt-oss ships none): a family that follows the interface needs no entry."""
    from .moe import is_experts_module

    found = {}
    for name, mod in model.named_modules():
        if is_experts_module(mod) and not any(_pattern_matches(k, name) for k in plan):
            found[re.sub(r"\.\d+(?=\.|$)", ".*", name)] = Style.MOE_EXPERTS.value
    return found


def output_embeddings(model: nn.Module) -> nn.Module | None:
    """The model's output embedding (its LM head), None for a model without one."""
    get = getattr(model, "get_output_embeddings", None)
    return None if get is None else get()


def _longest_module_list(model: nn.Module, home: str = "") -> str | None:
    """The decoder-layer list, guessed as the longest non-empty ModuleList (of ``home``)."""
    best: tuple[str, int] | None = None
    for name, mod in model.get_submodule(home).named_modules(prefix=home):
        if isinstance(mod, nn.ModuleList) and len(mod) and (best is None or len(mod) > best[1]):
            best = (name, len(mod))
    return None if best is None else best[0]


def _decoder_home(model: nn.Module) -> str:
    """The module holding the input embedding when it also holds a ModuleList (a multimodal
    model's ``language_model``, whose layers a longer vision tower must not outnumber), else
    ``""`` (the whole model)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = _name_of(model, get()) if callable(get) else None
    home = emb.rpartition(".")[0] if emb else ""
    if home and _longest_module_list(model, home) is not None:
        return home
    return ""


def _final_norm(model: nn.Module) -> str | None:
    """The final norm, guessed as the first of ``_FINAL_NORMS`` on the module holding the
    decoder (:func:`_decoder_home`), else on the base model."""
    prefix = getattr(model, "base_model_prefix", "")
    base_name = prefix if prefix and isinstance(getattr(model, prefix, None), nn.Module) else ""
    base_name = _decoder_home(model) or base_name
    base = model.get_submodule(base_name)
    for attr in _FINAL_NORMS:
        mod: object = base
        for part in attr.split("."):
            mod = getattr(mod, part, None)
        if isinstance(mod, nn.Module):
            return f"{base_name}.{attr}" if base_name else attr
    return None


def guess_structure(model: nn.Module) -> ModelStructure:
    """The structure of ``model`` guessed from names: the longest ModuleList holds the decoder
    layers, modules whose class name says attention / attn are attention, those that also say
    mlp / intermediate / feedforward prepare their projections' input, the final norm is the
    first of ``norm``, ``ln_f``, ... on the base model; the LM head is the output embedding."""
    attention, units = set(), set()
    for name, mod in model.named_modules():
        if _class_has(mod, _ATTENTION_WORDS):
            attention.add(name)
        if _class_has(mod, _UNIT_WORDS):
            units.add(name)
    return ModelStructure(
        source=f"the structure guessed for {type(model).__name__} (no explicit plan)",
        layers=_longest_module_list(model, _decoder_home(model)),
        final_norm=_final_norm(model),
        lm_head=_name_of(model, output_embeddings(model)),
        attention=frozenset(attention),
        prepares_input=frozenset(units),
        units=frozenset(units),
    )
