"""``parallelize``: shard a transformers model in place, driven by a tensor-parallel plan.

Three steps, one function each: :func:`_validate` refuses everything that cannot be sharded
exactly before any module is changed, :func:`_build` makes the sharded replacement modules
without touching the model, :func:`_install` swaps them in and adds the hooks (shared input
regions, per-rank head counts, sequence parallelism, the parallel loss)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from ..errors import UserError
from ..layers import RowParallelLinear
from ..parallel.mesh import Mesh, get_mesh
from ..parallel.sharding import copy_param_meta, get_sharding, mark_sequence_parallel
from ..parallel.state import ParallelState, attach, is_parallel
from .attention import (
    Heads,
    check_heads,
    is_plain_split,
    is_supported_attention,
    kv_slots,
    model_heads,
    patch_attention_module,
)
from .dropout import install_split_dropout
from .meta_guard import guard_meta
from .modules import (
    HFColumnLinear,
    build_column_linear,
    build_row_linear,
    build_vocab_embedding,
    check_column_linear,
    check_row_linear,
    check_vocab_embedding,
    linear_view,
)
from .moe import build_moe, check_moe, keep_complete_grads
from .norms import build_sharded_norm, check_sharded_norm
from .parallel_loss import wrap_loss
from .plans import Style
from .resolve import ModelPlan, check_split_pairs, column_role, plan_model
from .sequence_parallel import (
    apply_sequence_parallel,
    check_sequence_parallel,
    install_input_region,
)


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def parallelize(
    model: nn.Module,
    mesh: Mesh | None = None,
    sequence_parallel: bool = False,
    parallel_loss: bool = False,
    plan: dict[str, str] | None = None,
    sequence_parallel_regather: bool = True,
) -> nn.Module:
    """Shard a transformers model over the tensor-parallel group of ``mesh`` (in place).

    Every rank must hold the same full model (same weights) or the same meta-device model.
    ``model(input_ids).logits`` stays the full logits; with ``parallel_loss`` the LM head
    output stays vocab-sharded (``[..., ceil(V/tp)]`` on each rank) and, when ``labels`` are
    given, the loss is computed by :func:`neuron_tp.parallel_cross_entropy`. With
    ``sequence_parallel`` the residual stream is sequence-sharded (sequence length must be a
    multiple of tp; generation with a KV cache needs it off). After ``backward`` call
    :func:`neuron_tp.sync_sequence_parallel_grads` (replicated parameters that saw only part of
    the data on each rank). Under sequence parallelism the column-parallel projections save
    only the sequence shard of their input and all-gather it again in backward;
    ``sequence_parallel_regather=False`` keeps the gathered input (tp times that memory, one
    all-gather per attention/MLP fewer in backward). ``plan``: ``{module-name pattern: style}``
    replacing the architecture's styles (:mod:`neuron_tp.hf.plans`). Collective over tp: first
    verifies that every tp rank holds the same model, weights (checksums; skipped for
    meta-device ones) and options (:class:`neuron_tp.parallel.agreement.RankMismatchError` on every
    rank otherwise); then raises ValueError, identically on every rank and before the model is
    changed, for what cannot be sharded exactly. On a 2d/3d mesh (``init_mesh(tp_mode=...)``)
    Llama-family models get the 2D/3D layers (:mod:`neuron_tp.hf.parallelize_nd`).
    """
    mesh = get_mesh(mesh)
    if is_parallel(model):
        raise ValueError(f"{type(model).__name__} is already parallelized")
    from . import lora  # LoRA (peft) models: wrappers out, parallelize, wrappers back

    if lora.is_peft_model(model):
        return lora.parallelize_peft(
            model,
            mesh,
            parallelize,
            sequence_parallel=sequence_parallel,
            parallel_loss=parallel_loss,
            plan=plan,
            sequence_parallel_regather=sequence_parallel_regather,
        )
    lora.refuse_peft_layers(model)
    from ..parallel.agreement import check_same_model

    check_same_model(
        model,
        mesh.tp,
        {
            "plan": plan,
            "sequence_parallel": sequence_parallel,
            "sequence_parallel_regather": sequence_parallel_regather,
            "parallel_loss": parallel_loss,
            "tp": mesh.tp_size,
            "tp_mode": mesh.tp_mode,
        },
        what=f"parallelize({type(model).__name__})",
    )
    if mesh.tp_mode != "1d":  # 2D/3D layers, never 1D layers over a 2d/3d mesh
        from .parallelize_nd import parallelize_nd

        return parallelize_nd(model, mesh, sequence_parallel, parallel_loss, plan)
    # The ranks agree on model and options, so each step below does the same on every rank.
    mp, heads = _validate(model, mesh, plan, sequence_parallel)
    built = _build(model, mp, mesh, heads, sequence_parallel, parallel_loss)
    _install(
        model,
        mp,
        built,
        mesh,
        heads=heads,
        sequence_parallel=sequence_parallel,
        parallel_loss=parallel_loss,
        sequence_parallel_regather=sequence_parallel_regather,
    )
    return model


# -- 1. validate ----------------------------------------------------------------------------


def _validate(
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
    if sequence_parallel:
        check_sequence_parallel(model, s.layers, s.final_norm)
    check_split_pairs(
        model, mp.targets, s.units, gathered=(s.lm_head,) if s.lm_head is not None else ()
    )
    for name, style in mp.targets.items():
        if style.is_column and name != s.lm_head and _parent(name) in s.attention and heads is None:
            raise ValueError(f"{name}: attention projection but the config has no head counts")
    _refuse_unsplit_head_params(model, mp, heads)
    shared_activation_params(model, mp)
    if sequence_parallel:
        _refuse_unsharded_mixers(model, mp)
    for name, style in mp.targets.items():
        _check_target(
            model, name, style, mp, mesh=mesh, heads=heads, sequence_parallel=sequence_parallel
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
        for pname, p in model.get_submodule(att).named_parameters():
            owner = _parent(f"{att}.{pname}")
            per_head = {n for n in (heads.q, heads.kv) if 1 < n != heads.dim}
            if owner not in mp.targets and per_head & set(p.shape):
                raise ValueError(
                    f"{att}.{pname}: a per-head parameter {tuple(p.shape)} ({heads.q} heads, "
                    f"{heads.kv} key/value heads) of "
                    f"{type(model.get_submodule(att)).__name__} that the plan does not shard, "
                    "while it splits the attention's heads over tp; keep this attention "
                    "replicated (pass plan= without its projections)"
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
            params = dict(mod.named_parameters(recurse=False))
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
        args = _column_args(mod, name, style, role, heads=heads, mesh=mesh, head_gathered=True)
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


def _column_args(
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


# -- 2. build -------------------------------------------------------------------------------


@dataclass
class _Built:
    """The sharded modules for one model, made without touching it."""

    replacements: dict[str, nn.Module] = field(default_factory=dict)  # name -> sharded module
    grad_allreduce: list[nn.Module] = field(default_factory=list)  # whole, grads summed
    attention: list[str] = field(default_factory=list)  # head counts to patch
    # parent name -> its column projections that read its input (one shared input region)
    input_regions: dict[str, list[HFColumnLinear]] = field(default_factory=dict)


def _build(
    model: nn.Module,
    mp: ModelPlan,
    mesh: Mesh,
    heads: Heads | None,
    sequence_parallel: bool,
    parallel_loss: bool,
) -> _Built:
    """The sharded replacement of every planned module (validated by :func:`_validate`)."""
    built = _Built(grad_allreduce=shared_activation_params(model, mp))
    s = mp.structure
    for name, style in mp.targets.items():
        mod = model.get_submodule(name)
        new: nn.Module
        if style.is_column:
            role = column_role(name, style, mp)
            new = column = build_column_linear(
                mod,
                name,
                mesh,
                **_column_args(
                    mod, name, style, role, heads=heads, mesh=mesh, head_gathered=not parallel_loss
                ),
            )
            parent = _parent(name)
            if role == "attention" and parent not in built.attention:
                built.attention.append(parent)
            if not column.gather_output and parent and parent in s.prepares_input:
                built.input_regions.setdefault(parent, []).append(column)
        elif style in (Style.ROW, Style.ROW_SPLIT_INPUT):
            new = build_row_linear(
                mod,
                name,
                mesh,
                input_is_parallel=style is Style.ROW,
                sequence_parallel=sequence_parallel and s.in_layers(name),
            )
        elif style is Style.VOCAB_EMBEDDING:
            new = build_vocab_embedding(mod, name, mesh)
        elif style is Style.REPLICATED_GRAD_ALLREDUCE:
            built.grad_allreduce.append(mod)
            continue
        elif style is Style.MOE_EXPERTS:  # the whole block is replaced
            block, new = build_moe(model, name, mesh, sequence_parallel and s.in_layers(name))
            built.replacements[block] = new
            continue
        else:
            new = build_sharded_norm(mod, mesh, heads)
        built.replacements[name] = new
    return built


# -- 3. install -----------------------------------------------------------------------------


def _install(
    model: nn.Module,
    mp: ModelPlan,
    built: _Built,
    mesh: Mesh,
    *,
    heads: Heads | None,
    sequence_parallel: bool,
    parallel_loss: bool,
    sequence_parallel_regather: bool = True,
) -> None:
    """Swap the sharded modules in and add the hooks: the only step that changes ``model``."""
    s = mp.structure
    ties = _tie_groups(model)
    for name, new in built.replacements.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
    for mod in built.grad_allreduce:
        mark_sequence_parallel(mod)
    tp = mesh.tp_size
    for name in built.attention:
        if heads is None:
            raise ValueError(f"{name}: an attention module of a model without head counts")
        patch_attention_module(model.get_submodule(name), heads, tp, len(kv_slots(heads, tp)[0]))
    for name, children in built.input_regions.items():
        install_input_region(
            model.get_submodule(name),
            children,
            mesh,
            sequence_parallel and s.in_layers(name),
            sequence_parallel_regather,
        )
    _retie(model, ties)
    columns = [
        m
        for n, m in built.replacements.items()
        if isinstance(m, HFColumnLinear) and not m.gather_output and n != s.lm_head
    ]
    rows = [m for m in built.replacements.values() if isinstance(m, RowParallelLinear)]
    end = model.get_submodule(s.final_norm) if sequence_parallel and s.final_norm else None
    install_split_dropout(model, mesh.tp, columns, rows, end)
    if sequence_parallel:
        apply_sequence_parallel(model, mesh, s.layers, s.final_norm)
        keep_complete_grads(model)
    attach(model, ParallelState(mesh, parallel_loss, sequence_parallel))
    guard_meta(model)
    if parallel_loss:
        wrap_loss(model, mesh)


def _tie_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    seen: dict[int, list[tuple[str, str]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            seen.setdefault(id(p), []).append((mname, pname))
    return [g for g in seen.values() if len(g) > 1]


def _retie(model: nn.Module, ties) -> None:
    """Re-share parameters that were tied (embedding / LM head) after sharding."""
    for group in ties:
        owners = [(model.get_submodule(m) if m else model, p) for m, p in group]
        params = [getattr(o, p) for o, p in owners]
        sharded = [p for (o, n), p in zip(owners, params) if get_sharding(o, n) is not None]
        if not sharded:
            continue
        keep = sharded[0]
        keep_owner = next(on for on, p in zip(owners, params) if p is keep)
        for (m, p), (o, n), cur in zip(group, owners, params):
            if cur is not keep:
                if get_sharding(o, n) is not None and cur.shape != keep.shape:
                    raise ValueError(
                        f"{m}.{p}: tied to a parameter sharded differently "
                        f"({tuple(cur.shape)} vs {tuple(keep.shape)})"
                    )
                setattr(o, n, keep)
                copy_param_meta(*keep_owner, o, n)
