"""``parallelize``: shard a transformers model in place, driven by a tensor-parallel plan.

Three steps, one function each: :func:`neuron_tp.hf.validate.validate` refuses everything that
cannot be sharded exactly before any module is changed, :func:`_build` makes the sharded
replacement modules without touching the model, :func:`_install` swaps them in and adds the
hooks (shared input regions, per-rank head counts, sequence parallelism, the parallel loss)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..layers import RowParallelLinear
from ..parallel.mesh import Mesh, get_mesh
from ..parallel.sharding import copy_param_meta, get_sharding, mark_sequence_parallel
from ..parallel.state import ParallelState, attach, is_parallel
from .attention import Heads, kv_slots, patch_attention_module
from .dropout import install_split_dropout
from .head_bias import install_head_bias_slicing
from .head_params import shard_head_params
from .meta_guard import guard_meta
from .mla import patch_latent_heads, reads_latent
from .modules import HFColumnLinear, build_column_linear, build_row_linear, build_vocab_embedding
from .moe import build_moe, keep_complete_grads
from .norms import build_sharded_norm
from .parallel_loss import wrap_loss
from .resolve import ModelPlan, column_role
from .sequence_parallel import apply_sequence_parallel, install_input_region
from .sparse_activation import install_sharded_topk
from .styles import Style
from .validate import column_args, shared_activation_params, validate


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
    mp, heads = validate(model, mesh, plan, sequence_parallel)
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
    """The sharded replacement of every planned module (validated by :func:`validate`)."""
    built = _Built(grad_allreduce=shared_activation_params(model, mp))
    s = mp.structure
    for name, style in mp.targets.items():
        mod = model.get_submodule(name)
        new: nn.Module
        own = heads.at(name) if heads else None
        if style.is_column:
            role = column_role(name, style, mp)
            new = column = build_column_linear(
                mod,
                name,
                mesh,
                **column_args(
                    mod, name, style, role, heads=own, mesh=mesh, head_gathered=not parallel_loss
                ),
            )
            parent = _parent(name)
            if role == "attention" and parent not in built.attention:
                built.attention.append(parent)
            if not column.gather_output and parent and parent in s.prepares_input:
                region = built.input_regions.setdefault(parent, [])
                if reads_latent(name, mp.latent):  # its input is made inside the parent
                    column.input_replicated = True
                else:
                    region.append(column)
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
            new = build_sharded_norm(mod, mesh, own)
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
        own = heads.at(name)
        patch_attention_module(model.get_submodule(name), own, tp, len(kv_slots(own, tp)[0]))
        install_head_bias_slicing(model.get_submodule(name), own.q, tp, mesh.tp_rank, name)
    if heads is not None:
        shard_head_params(model, mp.head_params, mesh, heads)
    for name in sorted(mp.latent):
        patch_latent_heads(model.get_submodule(name), tp)
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
    install_sharded_topk(model, mesh.tp)
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
