"""The refusals of :func:`neuron_tp.hf.parallelize.parallelize`: everything that cannot be
sharded exactly is found here, before any module is built or changed, and the keyword arguments
of each column projection (its rows per rank, segments, head layout) that both the checks and
the build use."""

from __future__ import annotations

import re

from torch import nn

from ..errors import UserError
from ..parallel.mesh import Mesh
from .attention import (
    Heads,
    check_heads,
    is_plain_split,
    is_supported_attention,
    kv_slots,
    model_heads,
)
from .grouped_qkv import grouped_qkv_rows
from .head_params import check_head_params
from .layer_heads import with_layer_heads
from .mla import check_latent
from .modules import check_column_linear, check_row_linear, check_vocab_embedding, linear_view
from .moe import check_moe
from .norms import check_sharded_norm
from .resolve import ModelPlan, check_split_pairs, column_role, plan_model
from .sequence_parallel import check_sequence_parallel
from .styles import Style


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def validate(
    model: nn.Module, mesh: Mesh, plan: dict[str, str] | None, sequence_parallel: bool
) -> tuple[ModelPlan, Heads | None]:
    """The plan and head counts for ``model``; ValueError for anything that cannot be sharded
    exactly (nothing is built or changed)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if not is_supported_attention(impl):
        raise UserError(
            f"{type(model).__name__}: attention implementation {impl!r} is not "
            "supported under tensor parallelism; load with attn_implementation="
            "'sdpa' or 'eager'"
        )
    heads = model_heads(model.config)
    mp = plan_model(model, plan)
    s = mp.structure
    check_latent(model, mp.latent, mesh)
    heads = with_layer_heads(model, s.attention, heads)
    if sequence_parallel:
        check_sequence_parallel(model, s.layers, s.final_norm)
    check_split_pairs(
        model, mp.targets, s.units, gathered=(s.lm_head,) if s.lm_head is not None else ()
    )
    for name, style in mp.targets.items():
        if style.is_column and name != s.lm_head and _parent(name) in s.attention and heads is None:
            raise ValueError(f"{name}: attention projection but the config has no head counts")
    check_head_params(model, mp.head_params, s.attention, heads)
    _refuse_unsplit_head_params(model, mp, heads)
    _refuse_layer_head_counts(model, mp, heads)
    shared_activation_params(model, mp)
    if sequence_parallel:
        _refuse_unsharded_mixers(model, mp)
    for name, style in mp.targets.items():
        _check_target(
            model,
            name,
            style,
            mp,
            mesh=mesh,
            heads=heads.at(name) if heads else None,
            sequence_parallel=sequence_parallel,
        )
    return mp, heads


# Class-name words of modules that mix tokens along the sequence (attention, SSM, convolution).
# (Convolutions are found as nn.Conv1d: transformers' GPT-2 ``Conv1D`` is a linear.)
_MIXER_WORDS = ("attention", "attn", "mamba", "mixer", "deltanet")


def _refuse_unsharded_mixers(model: nn.Module, mp: ModelPlan) -> None:
    """Under sequence parallelism every module of the decoder layers that mixes tokens must
    get the whole sequence, which only the modules whose projections the plan shards do (their
    input is all-gathered): ValueError for one the plan leaves whole (it would see only this
    rank's part of the sequence)."""
    s = mp.structure
    gathered = {_parent(n) for n, st in mp.targets.items() if st.is_column} & s.prepares_input
    for name, mod in model.named_modules():
        covered = any(
            name == g or name.startswith(g + ".") or g.startswith(name + ".") for g in gathered
        )  # inside a gathered module, or a wrapper around one (GPT-Neo's attn.attention)
        if not s.in_layers(name) or covered:
            continue
        cls = type(mod).__name__
        mixes = any(w in cls.lower() for w in _MIXER_WORDS) and not isinstance(mod, nn.Linear)
        if mixes or isinstance(mod, nn.Conv1d):
            raise ValueError(
                f"{name} ({cls}) mixes tokens along the sequence and the plan does not shard "
                "it, so under sequence_parallel it would see only this rank's part of the "
                "sequence; use sequence_parallel=False for this model"
            )


def _refuse_unsplit_head_params(model: nn.Module, mp: ModelPlan, heads: Heads | None) -> None:
    """ValueError when an attention module whose heads the plan splits holds a per-head
    parameter (a dim of size num_attention_heads or num_key_value_heads, e.g. Doge's
    dynamic-mask ``A``) that the plan does not shard: each rank would apply every head's values to
    its own heads."""
    if heads is None:
        return
    split = {
        _parent(n)
        for n, st in mp.targets.items()
        if st.is_column and _parent(n) in mp.structure.attention
    }
    for att in sorted(split):
        h = heads.at(att)
        for pname, p in model.get_submodule(att).named_parameters():
            owner = _parent(f"{att}.{pname}")
            per_head = {n for n in (h.q, h.kv) if 1 < n != h.dim}
            sharded = owner in mp.targets or f"{att}.{pname}" in mp.head_params
            if not sharded and per_head & set(p.shape):
                raise ValueError(
                    f"{att}.{pname}: a per-head parameter {tuple(p.shape)} ({h.q} heads, "
                    f"{h.kv} key/value heads) of "
                    f"{type(model.get_submodule(att)).__name__} that the plan does not shard, "
                    "while it splits the attention's heads over tp; keep this attention "
                    "replicated (pass plan= without its projections)"
                )


def _refuse_layer_head_counts(model: nn.Module, mp: ModelPlan, heads: Heads | None) -> None:
    """ValueError when an attention module whose heads the plan splits states head counts of
    its own that differ from the config's (MiMo-V2-Flash's sliding-window layers double the
    key/value heads): the per-rank counts and the kv head layout are computed from the config
    (its layer's, for a config with per-layer fields: :meth:`Heads.at`)."""
    if heads is None:
        return
    split = {_parent(n) for n, st in mp.targets.items() if st.is_column}
    for att in sorted(split & mp.structure.attention):
        mod = model.get_submodule(att)
        h = heads.at(att)
        want = {
            "num_heads": h.q,
            "num_attention_heads": h.q,
            "num_key_value_heads": h.kv,
            "num_key_value_groups": h.q // h.kv,
        }
        for attr, value in want.items():
            have = getattr(mod, attr, None)
            if isinstance(have, int) and not isinstance(have, bool) and have != value:
                raise ValueError(
                    f"{att}: {type(mod).__name__}.{attr}={have} differs from the config's "
                    f"{value} (layers with their own head counts); tensor parallelism splits "
                    "heads by the config's counts, so keep this attention replicated (pass "
                    "plan= without its projections)"
                )


def _activation_classes() -> tuple[type[nn.Module], ...]:
    from transformers import activations

    found = {v[0] if isinstance(v, tuple) else v for v in activations.ACT2CLS.values()}
    return (nn.PReLU, *sorted(found, key=lambda c: c.__name__))


def shared_activation_params(model: nn.Module, mp: ModelPlan) -> list[nn.Module]:
    """The modules inside an attention / MLP module whose projections the plan splits that hold
    parameters the plan leaves whole: each must be an activation with scalar parameters (e.g.
    Apertus' xIELU ``alpha_p`` / ``alpha_n``), applied to this rank's features between the
    column and the row projections, so its gradient is partial on each rank and is summed
    over tp (the list returned); ValueError for any other (its gradient would be partial or
    its values applied to the wrong features)."""
    s = mp.structure
    split = {_parent(n) for n, st in mp.targets.items() if st.splits_output}
    split &= s.units | s.attention
    acts = _activation_classes()
    found: list[nn.Module] = []
    for unit in sorted(split):
        for name, mod in model.get_submodule(unit).named_modules(prefix=unit):
            if name in mp.targets or any(name.startswith(t + ".") for t in mp.targets):
                continue
            params = {
                k: p
                for k, p in mod.named_parameters(recurse=False)
                if f"{name}.{k}" not in mp.head_params
            }
            if not params:
                continue
            scalar = all(p.numel() == 1 for p in params.values())
            if isinstance(mod, acts) and scalar:
                found.append(mod)
                continue
            pname, p = next(iter(params.items()))
            raise ValueError(
                f"{name}.{pname}: a parameter {tuple(p.shape)} of {type(mod).__name__} inside "
                f"{unit} ({type(model.get_submodule(unit)).__name__}), whose projections the "
                "plan splits over tp, that the plan leaves whole: each rank would apply it to "
                "its own part of the features and get a partial gradient; list it in plan= "
                f"({{{_pattern(name)!r}: 'replicated_with_grad_allreduce'}} for a weight shared "
                "by every head, applied before the row-parallel projection) or keep "
                f"{_pattern(unit)!r} replicated (plan= without its projections)"
            )
    return found


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _check_target(
    model: nn.Module,
    name: str,
    style: Style,
    mp: ModelPlan,
    *,
    mesh: Mesh,
    heads: Heads | None,
    sequence_parallel: bool,
) -> None:
    """The refusals for sharding module ``name`` as ``style``."""
    mod = model.get_submodule(name)
    if style.is_column:
        role = column_role(name, style, mp)
        args = column_args(mod, name, style, role, heads=heads, mesh=mesh, head_gathered=True)
        check_column_linear(
            mod,
            name,
            mesh,
            args.get("rows_of_rank"),
            args.get("segments"),
            args.get("pad_output", False),
        )
        parent = _parent(name)
        split_output = role in ("attention", "plain")
        if (
            split_output
            and sequence_parallel
            and mp.structure.in_layers(name)
            and parent not in mp.structure.prepares_input
        ):
            raise ValueError(
                f"{name}: sequence_parallel needs column-parallel projections inside an "
                f"attention or MLP module (this one sits in "
                f"{type(model.get_submodule(parent)).__name__}, whose sequence layout is "
                "unknown); use sequence_parallel=False for this model"
            )
    elif style in (Style.ROW, Style.ROW_SPLIT_INPUT):
        check_row_linear(mod, name, mesh)
        if style is Style.ROW_SPLIT_INPUT and sequence_parallel and mp.structure.in_layers(name):
            raise ValueError(
                f"{name}: 'rowwise_split_input' (an input gathered over tp, e.g. after a norm "
                "over all heads that the plan runs replicated) has no sequence-parallel form; "
                "use sequence_parallel=False for this model"
            )
    elif style is Style.VOCAB_EMBEDDING:
        check_vocab_embedding(mod, name)
    elif style is Style.SHARDED_NORM:
        check_sharded_norm(mod, name, mesh, heads)
    elif style is Style.MOE_EXPERTS:
        check_moe(model, name, mesh)


def _kv_rows(heads: Heads, tp: int, offset: int) -> list[list[int]]:
    return [
        [offset + h * heads.dim + i for h in slots for i in range(heads.dim)]
        for slots in kv_slots(heads, tp)
    ]


def column_args(
    mod: nn.Module,
    name: str,
    style: Style,
    role: str,
    *,
    heads: Heads | None,
    mesh: Mesh,
    head_gathered: bool,
) -> dict:
    """Keyword arguments of :func:`build_column_linear` for ``role`` (refusing head counts
    tp does not split); ``head_gathered``: the LM head's output is gathered (no
    ``parallel_loss``)."""
    if role == "head":
        return {"pad_output": True, "gather_output": head_gathered}
    if role == "gathered":
        return {"gather_output": True}
    out = linear_view(mod, name)[0].shape[0]
    if role == "plain":
        return {"segments": [out // 2] * 2 if style is Style.COLUMN_PACKED else None}
    # An attention q/k/v (or fused qkv) projection, split per head.
    if heads is None:
        raise ValueError(f"{name}: an attention projection of a model without head counts")
    tp = mesh.tp_size
    check_heads(heads, tp, mesh.world_size, name)
    if style is Style.COLUMN_GROUPED_QKV:
        return {"rows_of_rank": grouped_qkv_rows(heads, tp, mesh.world_size, name)}
    q, kv = heads.q * heads.dim, heads.kv * heads.dim
    plain = is_plain_split(kv_slots(heads, tp), heads.kv)
    if style is Style.COLUMN_PACKED_QKV:
        if out != q + 2 * kv:
            raise ValueError(f"{name}: packed_qkv expects {q}+2*{kv} output features, got {out}")
        if plain:
            return {"segments": [q, kv, kv]}
        qrows = [list(range(r * q // tp, (r + 1) * q // tp)) for r in range(tp)]
        krows, vrows = _kv_rows(heads, tp, q), _kv_rows(heads, tp, q + kv)
        return {
            "rows_of_rank": [a + b + c for a, b, c in zip(qrows, krows, vrows)],
            "segments": [q, len(krows[0]) * tp, len(vrows[0]) * tp],
            "replicated_from": q,
        }
    if out == kv and heads.kv != heads.q and not plain:
        return {"rows_of_rank": _kv_rows(heads, tp, 0), "replicated_from": 0}
    return {"segments": [out // 2] * 2 if style is Style.COLUMN_PACKED else None}
