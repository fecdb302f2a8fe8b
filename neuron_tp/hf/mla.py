"""Multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, GLM-4-MoE-lite) sharded by heads.

One such module computes, per token, a low-rank query ``q_a_proj -> q_a_layernorm`` (or none:
``q_proj`` straight from the input) and one latent key/value ``kv_a_proj_with_mqa`` whose last
``qk_rope_head_dim`` features are the rotary key shared by every head and whose other features
go through ``kv_a_layernorm``. Only then do the per-head projections ``q_b_proj`` (or
``q_proj``) and ``kv_b_proj`` expand them to every head, and ``o_proj`` mixes the heads.

Under tensor parallelism the per-head projections are column-parallel by heads and ``o_proj``
row-parallel; the low-rank projections, their norms and the rotary key are replicated. The
attention module's input region (copy, or with sequence parallelism all-gather of the sequence)
is applied once at its input, so the replicated projections see the whole (gathered) input;
``q_b_proj`` and ``kv_b_proj`` read the replicated latents without an input region of their
own, so every replicated parameter's gradient (and the input's) holds only this rank's heads'
part: the parameters' are summed over tp after backward, the input's by the region. The
DeepSeek-V3.2 / GLM-MoE-DSA sparse-attention indexer runs replicated too. The
transformers cache keeps the latents (one replicated "head"), so generation needs no cache
split by heads.
"""

from __future__ import annotations

import copy

from torch import nn

from ..errors import UserError
from ..parallel.mesh import Mesh, valid_tp_degrees
from .styles import Style

# Children that mark a multi-head latent attention module.
MARKERS = ("kv_a_proj_with_mqa", "kv_b_proj")
# Column-parallel projections that read a replicated latent (no input region of their own).
FROM_LATENT = ("q_b_proj", "kv_b_proj")
# Replicated: the low-rank projections, their norms and DeepSeek-V3.2's sparse-attention
# ``indexer`` (its top-k key choice, from replicated inputs, is the same on every rank).
_REPLICATED = ("q_a_proj", "q_a_layernorm", "kv_a_proj_with_mqa", "kv_a_layernorm", "indexer")
_KNOWN = (*_REPLICATED, "q_proj", *FROM_LATENT, "o_proj")


def latent_modules(model: nn.Module) -> list[str]:
    """The names of the multi-head latent attention modules of ``model``, in module order."""
    return [
        n
        for n, m in model.named_modules()
        if n and all(isinstance(getattr(m, a, None), nn.Module) for a in MARKERS)
    ]


def within(name: str, modules: list[str] | frozenset[str]) -> bool:
    """``name`` is one of ``modules`` or inside one."""
    return any(name == a or name.startswith(a + ".") for a in modules)


def extra_parts(model: nn.Module, att: str) -> list[str]:
    """The children of latent attention module ``att`` holding parameters that this sharding
    does not know (an output gate, attention sinks): it cannot be split by heads."""
    names = {n.partition(".")[0] for n, _ in model.get_submodule(att).named_parameters()}
    return sorted(names - set(_KNOWN))


def refuse_extra_parts(model: nn.Module, att: str) -> None:
    """UserError: the plan shards latent attention module ``att``, which has parts this
    sharding does not know (they would be applied to every head on every rank, or split
    wrongly)."""
    raise UserError(
        f"{type(model).__name__}: multi-head latent attention with unknown parts "
        f"{extra_parts(model, att)} ({att}: {type(model.get_submodule(att)).__name__}; "
        "neuron_tp shards by heads only the low-rank projections, their norms, q_b_proj / "
        "kv_b_proj and o_proj); keep the attention replicated (pass plan= without its "
        "projections)"
    )


def latent_styles(model: nn.Module, modules: list[str]) -> dict[str, Style]:
    """The styles of every projection and norm of each latent attention module (full names;
    modules without :func:`extra_parts`)."""
    styles: dict[str, Style] = {}
    for att in modules:
        children = dict(model.get_submodule(att).named_children())
        for child in _KNOWN:
            if children.get(child) is None:
                continue
            style = Style.REPLICATED_GRAD_ALLREDUCE if child in _REPLICATED else Style.COLUMN
            styles[f"{att}.{child}"] = Style.ROW if child == "o_proj" else style
    return styles


def _num_heads(mod: nn.Module) -> int:
    heads = getattr(mod, "num_heads", None) or getattr(mod.config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise UserError(f"{type(mod).__name__}: latent attention without a head count")
    return heads


def check_latent(model: nn.Module, modules: frozenset[str], mesh: Mesh) -> None:
    """UserError unless tp splits every latent attention module's heads evenly (each rank
    owns whole heads of ``q_b_proj`` / ``kv_b_proj`` / ``o_proj``), before any collective."""
    tp = mesh.tp_size
    for att in sorted(modules):
        heads = _num_heads(model.get_submodule(att))
        if heads % tp:
            raise UserError(
                f"{att}: multi-head latent attention with {heads} heads cannot be split over "
                f"tp={tp} (each rank must own whole heads); tp degrees that work with world "
                f"size {mesh.world_size}: {valid_tp_degrees(mesh.world_size, heads)}"
            )


def reads_latent(name: str, modules: frozenset[str]) -> bool:
    """``name`` is a column projection of a latent attention module that reads a replicated
    latent made inside it (``q_b_proj``, ``kv_b_proj``), not the module's input."""
    parent, _, leaf = name.rpartition(".")
    return parent in modules and leaf in FROM_LATENT


def patch_latent_heads(attn: nn.Module, tp: int) -> None:
    """Set this rank's head count on a latent attention module (and its own config copy),
    and one head per key/value group: every head expands its own key and value from the
    latents (a config's ``num_key_value_heads`` below the head count would otherwise repeat
    them past the query heads wherever attention gets a mask tensor, as generation's)."""
    local = _num_heads(attn) // tp
    if isinstance(getattr(attn, "num_key_value_groups", None), int):
        vars(attn)["num_key_value_groups"] = 1
    for name in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(attn, name, None), int):
            setattr(attn, name, local)
    cfg = getattr(attn, "config", None)
    if cfg is not None and isinstance(cfg.__dict__.get("num_attention_heads"), int):
        cfg = copy.copy(cfg)
        cfg.__dict__["num_attention_heads"] = local
        attn.config = cfg


def latent_cache_dims(module: nn.Module) -> tuple[int, int] | None:
    """``(key dim, value dim)`` of what a latent attention module writes to its transformers
    cache (its ``kv_lora_rank`` latent and its rotary key, one replicated "head" each), None
    for any other module."""
    if not all(isinstance(getattr(module, a, None), nn.Module) for a in MARKERS):
        return None
    if isinstance(getattr(module, "indexer", None), nn.Module):
        raise UserError(
            f"{type(module).__name__}: a latent attention with a sparse-attention indexer "
            "(DeepSeek-V3.2, GLM-MoE-DSA) keeps a cache of its own that the slot cache does "
            "not hold, so generation is refused for it; training and forward passes shard "
            "it (neuron_tp.hf.mla)"
        )
    k, v = getattr(module, "kv_lora_rank", None), getattr(module, "qk_rope_head_dim", None)
    if not (isinstance(k, int) and isinstance(v, int) and isinstance(module.layer_idx, int)):
        raise UserError(f"{type(module).__name__}: latent attention without its cache sizes")
    return k, v
