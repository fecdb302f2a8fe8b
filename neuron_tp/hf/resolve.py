"""A plan applied to one model: ``{module name: Style}`` for every module to shard and the
model's :class:`~neuron_tp.hf.styles.ModelStructure`, every path checked to exist (a clear
ValueError otherwise, before anything is modified); and the check that every split output
has a consumer."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from torch import nn

from . import mla
from .fallback import guess_structure, output_embeddings, shipped_styles
from .head_params import split_param_entries
from .plans import arch_plan
from .styles import STYLES, ArchPlan, ModelStructure, Style


@dataclass(frozen=True)
class ModelPlan:
    """What ``parallelize`` does to one model."""

    targets: dict[str, Style]  # module name -> style, in module order
    structure: ModelStructure
    head_params: tuple[str, ...] = ()  # per-head parameters split with their heads (sinks)
    latent: frozenset[str] = frozenset()  # multi-head latent attention modules (hf.mla)


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + r"[^.]+".join(re.escape(p) for p in pattern.split("*")) + "$")


def _base_prefix(model: nn.Module) -> str:
    """The base model's name in ``model`` (``"model"`` in a ``LlamaForCausalLM``), or ``""``."""
    prefix = getattr(model, "base_model_prefix", "")
    return prefix if prefix and hasattr(model, prefix) else ""


def _join(*parts: str | None) -> str:
    return ".".join(p for p in parts if p)


def _checked_styles(model: nn.Module, plan: dict[str, str]) -> dict[str, Style]:
    bad = {k: v for k, v in plan.items() if v not in STYLES}
    if bad:
        raise ValueError(
            f"{type(model).__name__}: unsupported tensor-parallel styles {bad}; "
            f"supported styles: {STYLES}"
        )
    return {k: Style(v) for k, v in plan.items()}


def _arch_styles(model: nn.Module, arch: ArchPlan, lm_head: str | None) -> dict[str, Style]:
    base = _base_prefix(model)
    styles = {_join(base, arch.embedding): Style.VOCAB_EMBEDDING}
    styles.update({_join(base, arch.layers, "*", k): v for k, v in arch.layer_styles.items()})
    if lm_head is not None:
        styles[lm_head] = Style.COLUMN_GATHER_OUTPUT
    return styles


def resolve_plan(
    model: nn.Module, plan: dict[str, str] | None = None, latent: list[str] | None = None
) -> dict[str, Style]:
    """The plan for ``model`` as ``{full module-name pattern: style}``: ``plan`` if given,
    else the explicit one for its architecture, else the one transformers ships (without its
    per-head parameter entries: :func:`neuron_tp.hf.head_params.split_param_entries`, and
    without its entries inside the ``latent`` attention modules, which :mod:`.mla` plans)."""
    if plan is not None:
        return _checked_styles(model, split_param_entries(model, plan)[0])
    arch = arch_plan(model.config)
    if arch is None:
        shipped = split_param_entries(model, shipped_styles(model))[0]
        if latent:
            inner = [n for n, _ in model.named_modules() if mla.within(n, latent)]
            shipped = {
                k: v for k, v in shipped.items() if not any(_compile(k).match(n) for n in inner)
            }
        return _checked_styles(model, shipped)
    if arch.unsupported:
        raise ValueError(arch.unsupported)
    return _arch_styles(model, arch, _explicit_structure(model, arch).lm_head)


def match_modules(model: nn.Module, plan: dict[str, Style]) -> dict[str, Style]:
    """``{module name: style}`` for every module a plan pattern names (exact full names)."""
    compiled = [(_compile(k), v) for k, v in plan.items()]
    found: dict[str, Style] = {}
    for name, _ in model.named_modules():
        for rx, style in compiled:
            if rx.match(name):
                found[name] = style
    return found


def refuse_latent_attention(model: nn.Module, plan: dict[str, str] | None) -> None:
    """ValueError when ``plan`` shards anything inside a multi-head latent attention module
    (without ``plan`` :mod:`.mla` plans those modules): the message gives the plan without
    those entries."""
    if plan is None:
        return
    latent = mla.latent_modules(model)
    if not latent:
        return
    within = [n for n, _ in model.named_modules() if mla.within(n, latent)]
    inside = sorted(k for k in plan if any(_compile(k).match(n) for n in within))
    if not inside:
        return
    rest = {k: v for k, v in plan.items() if k not in inside and v in STYLES}
    cls = type(model.get_submodule(latent[0])).__name__
    raise ValueError(
        f"{type(model).__name__}: multi-head latent attention ({latent[0]}: {cls}, low-rank "
        "q_a_proj/q_b_proj and kv_a_proj_with_mqa/kv_b_proj with their norms) is sharded by "
        f"neuron_tp's own plan only (plan=None), and the plan shards {inside}; keep the "
        f"attention replicated: plan={rest}"
    )


def plan_model(model: nn.Module, plan: dict[str, str] | None = None) -> ModelPlan:
    """The modules to shard and the structure of ``model``. ``plan`` replaces the styles; the
    structure comes from the architecture's explicit plan, else it is guessed."""
    refuse_latent_attention(model, plan)
    every_latent = mla.latent_modules(model) if plan is None else []
    latent = _shardable_latent(model, every_latent)
    styles = resolve_plan(model, plan, every_latent)
    targets = _absorb_moe(match_modules(model, styles))
    if latent:
        targets.update(mla.latent_styles(model, latent))
        order = {n: i for i, (n, _) in enumerate(model.named_modules())}
        targets = dict(sorted(targets.items(), key=lambda kv: order[kv[0]]))
    if plan is not None:
        unmatched = [k for k in styles if not match_modules(model, {k: styles[k]})]
        if unmatched:
            raise ValueError(
                f"{type(model).__name__}: plan patterns {unmatched} match no "
                "module (nothing would be sharded for them); module names look "
                f"like {[n for n, _ in model.named_modules()][1:6]}"
            )
    arch = arch_plan(model.config)
    structure = guess_structure(model) if arch is None else _explicit_structure(model, arch)
    head_params: tuple[str, ...] = ()
    if plan is not None or arch is None:
        head_params = split_param_entries(model, shipped_styles(model) if plan is None else plan)[1]
    if latent:  # split by heads in hf.mla, their input prepared once
        structure = replace(
            structure,
            attention=structure.attention - set(latent),
            prepares_input=structure.prepares_input | set(latent),
            units=structure.units | set(latent),
        )
    return ModelPlan(targets, structure, head_params, frozenset(latent))


def _shardable_latent(model: nn.Module, latent: list[str]) -> list[str]:
    """The latent attention modules :mod:`.mla` shards; one with other parts stays
    replicated, refused (UserError) when the plan transformers ships shards it."""
    odd = [a for a in latent if mla.extra_parts(model, a)]
    if odd and arch_plan(model.config) is None:
        try:
            shipped = shipped_styles(model)
        except ValueError:
            shipped = {}
        inner = [n for n, _ in model.named_modules() if mla.within(n, odd)]
        touched = [n for n in inner if any(_compile(k).match(n) for k in shipped)]
        if touched:
            mla.refuse_extra_parts(model, next(a for a in odd if mla.within(touched[0], [a])))
    return [a for a in latent if a not in odd]


def _absorb_moe(targets: dict[str, Style]) -> dict[str, Style]:
    """``targets`` without the modules inside an MoE block (a shipped plan's shared-expert
    projections): the block (parent of a ``moe_tp_experts`` module) shards them itself."""
    blocks = [n.rpartition(".")[0] + "." for n, s in targets.items() if s is Style.MOE_EXPERTS]
    return {
        n: s
        for n, s in targets.items()
        if s is Style.MOE_EXPERTS or not any(n.startswith(b) for b in blocks)
    }


_MISSING = object()


def _lookup(model: nn.Module, path: str) -> object:
    """The attribute at dotted ``path`` (``_MISSING`` where a component does not exist)."""
    obj: object = model
    for part in path.split(".") if path else ():
        obj = getattr(obj, part, _MISSING) if isinstance(obj, nn.Module) else _MISSING
        if obj is _MISSING:
            break
    return obj


def _module(
    model: nn.Module, path: str, field: str, source: str, may_be_none: bool = False
) -> nn.Module | None:
    """The module at ``path``, or a ValueError naming the plan field and what exists there.
    ``may_be_none``: an attribute set to None (a config without that module) gives None."""
    obj = _lookup(model, path)
    if isinstance(obj, nn.Module) or (may_be_none and obj is None):
        return obj
    parent = path
    while parent and not isinstance(_lookup(model, parent), nn.Module):
        parent = parent.rpartition(".")[0]
    children = [n for n, _ in model.get_submodule(parent).named_children()]
    what = "does not exist" if obj is _MISSING else f"is a {type(obj).__name__}, not a module"
    raise ValueError(
        f"{source}: {field} {path!r} {what} in {type(model).__name__}; "
        f"{parent or 'the model'} has {children}; fix the plan"
    )


def _explicit_structure(model: nn.Module, arch: ArchPlan) -> ModelStructure:
    """The structure an :class:`ArchPlan` states, every path checked against ``model``."""
    model_type = getattr(model.config, "model_type", None)
    source = f"plan for model_type {model_type!r} (neuron_tp.hf.plans.ARCH_PLANS)"
    base = _base_prefix(model)
    layers = _join(base, arch.layers)
    layer_list = _module(model, layers, "layers", source)
    if not isinstance(layer_list, nn.ModuleList):
        raise ValueError(
            f"{source}: layers {layers!r} is a {type(layer_list).__name__}, not "
            "the ModuleList of decoder layers; fix the plan"
        )
    _module(model, _join(base, arch.embedding), "embedding", source)
    final_norm = None
    if arch.final_norm is not None:
        final_norm = _join(base, arch.final_norm)
        if _module(model, final_norm, "final_norm", source, may_be_none=True) is None:
            final_norm = None
    attention, prepares, units = set[str](), set[str](), set[str]()
    for i in range(len(layer_list)):
        layer = f"{layers}.{i}"
        paths = [("attention", arch.attention), ("mlp", arch.mlp)]
        paths += [("prepares_input", p) for p in arch.prepares_input]
        paths += [("layer_styles", p) for p in arch.layer_styles if p not in arch.optional]
        for field, rel in paths:
            if rel is not None:
                _module(model, _join(layer, rel), field, source)
        attention.add(_join(layer, arch.attention))
        prepares.update(_join(layer, p) for p in arch.prepares_input)
        units.update(
            _join(layer, p)
            for p in (arch.attention, arch.mlp, *arch.prepares_input)
            if p is not None
        )
    return ModelStructure(
        source=source,
        layers=layers,
        final_norm=final_norm,
        lm_head=_explicit_lm_head(model, arch, source),
        attention=frozenset(attention),
        prepares_input=frozenset(prepares),
        units=frozenset(units),
    )


def _explicit_lm_head(model: nn.Module, arch: ArchPlan, source: str) -> str | None:
    """``arch.lm_head`` when it is the model's output embedding; None for a model without
    one (a base model, a classifier)."""
    out = output_embeddings(model)
    if out is None:
        return None
    if _lookup(model, arch.lm_head) is out:
        return arch.lm_head
    actual = next((n for n, m in model.named_modules() if m is out), None)
    raise ValueError(
        f"{source}: lm_head {arch.lm_head!r} is not the output embedding of "
        f"{type(model).__name__} ({actual!r}); fix the plan"
    )


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def check_split_pairs(
    model: nn.Module,
    targets: dict[str, Style],
    units: frozenset[str],
    gathered: tuple[str, ...] = (),
) -> None:
    """Refuse a plan whose split activations have no consumer (ValueError naming the module
    and the plan entry that would work): a projection whose output stays split over tp
    (``colwise``) needs a ``rowwise`` one after it, and a ``rowwise`` one needs a split
    producer before it. Judged on the module tree: the nearest ancestor of a projection that
    contains a partner decides; its partners must come after (before) it in registration order
    unless the ancestor is an attention / MLP module (in ``units``), which is self contained.
    ``gathered``: modules whose output is gathered whatever their style (LM head)."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}

    def linear(n: str) -> bool:  # other modules are refused with their own error later
        w = getattr(model.get_submodule(n), "weight", None)
        return isinstance(w, torch.Tensor) and w.dim() == 2

    linears = {n for n in targets if n not in gathered and linear(n)}
    # Partners by every scope that contains them ("" = the model), for consumers (rowwise)
    # and producers (split output): one pass, not one per projection (large models).
    by_scope: dict[bool, dict[str, list[str]]] = {True: {}, False: {}}
    for n in linears:
        s = targets[n]
        kind = True if s is Style.ROW else (False if s.splits_output else None)
        if kind is None:
            continue
        parts = n.split(".")
        for depth in range(len(parts)):
            by_scope[kind].setdefault(".".join(parts[:depth]), []).append(n)

    for name, style in targets.items():
        if name not in linears or not (style.splits_output or style is Style.ROW):
            continue
        producer = bool(style.splits_output)
        parts = name.split(".")
        ok = False
        for depth in range(len(parts) - 1, -1, -1):
            scope = ".".join(parts[:depth])
            inside = by_scope[producer].get(scope, [])
            if inside:
                ok = scope in units or any((order[n] > order[name]) == producer for n in inside)
                break
        if ok:
            continue
        home = next(
            (
                ".".join(parts[:d])
                for d in range(len(parts) - 1, 0, -1)
                if ".".join(parts[:d]) in units
            ),
            ".".join(parts[:-1]),
        )
        where = f"{home} ({type(model.get_submodule(home)).__name__})" if home else "the model"
        cands = [
            _pattern(n)
            for n, m in model.get_submodule(home).named_modules(prefix=home)
            if n != name and n in order and linear(n) and (order[n] > order[name]) == producer
        ]
        if producer:
            fix = (
                f"put {{{cands[-1]!r}: 'rowwise'}} (the projection that reads its output)"
                if cands
                else "put the projection that reads its output as 'rowwise'"
            )
            raise ValueError(
                f"plan: {name} is {style.value!r} (its output stays split over tp) but nothing "
                f"after it in {where} is 'rowwise' to consume the split features, so the next "
                f"module would get 1/tp of them; {fix} in the plan, or use "
                f"'colwise_gather_output' for {_pattern(name)!r}"
            )
        entries = ", ".join(f"{c!r}: 'colwise'" for c in cands)
        fix = (
            f"mark the projection(s) feeding it 'colwise' ({{{entries}}})"
            if cands
            else "mark the projection feeding it 'colwise'"
        )
        raise ValueError(
            f"plan: {name} is 'rowwise' (it expects its input split over tp) but nothing before "
            f"it in {where} is colwise; {fix}, or use 'rowwise_split_input' for "
            f"{_pattern(name)!r} to split a replicated input"
        )


def column_role(name: str, style: Style, mp: ModelPlan) -> str:
    """How a column-style module is sharded: ``"head"`` (vocab padded, gathered unless
    parallel_loss), ``"gathered"`` (output gathered), ``"attention"`` (split per head) or
    ``"plain"`` (contiguous split, of each packed part)."""
    if name == mp.structure.lm_head or (
        style is Style.COLUMN_GATHER_OUTPUT and not mp.structure.in_layers(name)
    ):
        return "head"
    if style is Style.COLUMN_GATHER_OUTPUT:
        return "gathered"
    return "attention" if name.rpartition(".")[0] in mp.structure.attention else "plain"
