"""transformers' MoE layers under tensor parallelism (style ``moe_tp_experts``, planned on
the block's ``experts`` module), two ways:

* the blocks of :data:`BLOCKS` become :class:`neuron_tp.moe.ParallelMoEBlock` (routing
  re-implemented, shared experts sharded, expert parallelism);
* every other block keeps its own forward, router, shared experts and gates (replicated) and
  only its ``experts`` module is replaced by :class:`neuron_tp.moe.TPInterfaceExperts`, which
  takes the same call (transformers 5's experts interface) and reduces once: the layout comes
  from the flags transformers declares on the experts class (``use_experts_implementation``:
  concatenated / interleaved gate-up, transposed weights, biases, gate or not, the class's own
  ``_apply_gate``), or from a declared adapter (:data:`ADAPTERS`, Llama-4's dense call). What
  neither describes (a post-expert norm, extra parameters) is refused by name before
  anything is built. Under expert parallelism each rank holds ``E/ep`` of those experts and
  tokens reach them by all-to-all (:mod:`neuron_tp.moe.expert_parallel`), either way.

Which transformers block and router classes take the first way, and where their router, shared
expert(s) and shared-expert gate sit, is written here once (:data:`BLOCKS`, :data:`ROUTERS`);
the block keeps transformers' own router module (replicated,
so its routing is exactly transformers' and its logits are recorded for the auxiliary loss)
and its shared-expert gate; the fused experts and the shared expert MLP are sharded by their
intermediate dimension, each parameter with its :class:`~neuron_tp.parallel.sharding.Sharding`
and its :class:`~neuron_tp.hf.slice_map.HFSliceMap` (checkpoint slices to load, and how to
save the gathered tensor back)."""

from __future__ import annotations

import contextlib
import copy
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from ..moe import ExpertsLayout, ParallelMoEBlock, TPExperts, TPInterfaceExperts, TPSharedMLP
from ..parallel.mesh import Mesh, divisors, valid_tp_degrees
from ..parallel.sharding import get_sharding, set_param_meta
from .slice_map import HFSliceMap, even_pieces, set_slice_map

if TYPE_CHECKING:
    # transformers is not analysed (pyproject): a model read by its attribute names
    # (``config``), a documented dynamic boundary.
    from transformers import PreTrainedModel


class _FusedExperts(Protocol):
    """A transformers (>= 5) experts module of a known block, as :func:`check_moe` checked it."""

    gate_up_proj: torch.Tensor  # [E, 2I, H]
    down_proj: torch.Tensor  # [E, H, I]
    act_fn: nn.Module


@dataclass(frozen=True)
class BlockSpec:
    """Where a transformers MoE block keeps its parts (attribute names; None = absent)."""

    router: str = "gate"
    shared: str | None = None  # a gated MLP (gate_proj, up_proj, down_proj, act_fn)
    shared_gate: str | None = None  # Linear(H, 1); its sigmoid scales the shared expert
    jitter: str | None = None  # the block's attribute holding the training input jitter


_ROUTED = BlockSpec()
_SHARED = BlockSpec(shared="shared_experts")
# Block class -> its layout. Each one's forward is: optional training jitter of the input,
# router, routed experts, plus the (gated) shared expert.
BLOCKS: dict[str, BlockSpec] = {
    "MixtralSparseMoeBlock": BlockSpec(jitter="jitter_noise"),
    "MiniMaxSparseMoeBlock": BlockSpec(jitter="jitter_noise"),
    "Qwen3MoeSparseMoeBlock": _ROUTED,
    "OlmoeSparseMoeBlock": _ROUTED,
    "Qwen2MoeSparseMoeBlock": BlockSpec(shared="shared_expert", shared_gate="shared_expert_gate"),
    "Glm4MoeMoE": _SHARED,
    "DeepseekV3MoE": _SHARED,
    "Dots1MoE": _SHARED,
}
# Router class -> its kind (neuron_tp.moe.routing.ROUTER_KINDS).
ROUTERS: dict[str, str] = {
    "MixtralTopKRouter": "softmax_topk",
    "MiniMaxTopKRouter": "softmax_topk",
    "Qwen2MoeTopKRouter": "softmax_topk",
    "Qwen3MoeTopKRouter": "softmax_topk",
    "OlmoeTopKRouter": "softmax_topk",
    "Glm4MoeTopkRouter": "sigmoid_group_topk",
    "DeepseekV3TopkRouter": "sigmoid_group_topk",
    "Dots1TopkRouter": "sigmoid_group_topk",
}


# Experts classes that do not declare transformers' experts-interface flags: their layout.
# Llama-4: the block scales every token for every expert and calls experts(x [E*T, H]).
ADAPTERS: dict[str, ExpertsLayout] = {
    "Llama4TextExperts": ExpertsLayout(transposed=True, call="dense"),
}


def is_experts_module(mod: nn.Module) -> bool:
    """``mod`` is a transformers experts module neuron_tp can shard behind its interface
    (it declares ``use_experts_implementation`` flags, or has an adapter)."""
    if type(mod).__name__ in ADAPTERS:
        return True
    return all(hasattr(mod, f) for f in ("has_gate", "has_bias", "is_transposed"))


def _is_generic(model: nn.Module, name: str) -> bool:
    """``name`` (an experts module) sits in a block outside :data:`BLOCKS`."""
    block = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    return type(block).__name__ not in BLOCKS


def _layout(experts: nn.Module, name: str) -> ExpertsLayout:
    """The layout of a transformers experts module; ValueError for what cannot be sharded."""
    cls = type(experts).__name__
    if cls in ADAPTERS:
        return ADAPTERS[cls]
    flags = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
    if not all(hasattr(experts, f) for f in flags):
        raise ValueError(
            f"{name}: {cls} follows neither transformers' experts interface (no "
            f"use_experts_implementation flags {flags}) nor a declared adapter "
            f"(neuron_tp.hf.moe.ADAPTERS: {sorted(ADAPTERS)})"
        )
    if getattr(experts, "has_post_expert_norm", False):
        raise ValueError(
            f"{name}: {cls} normalizes each expert's output (has_post_expert_norm): a norm of "
            "the full output cannot be applied to tensor-parallel partial sums"
        )
    return ExpertsLayout(
        gated=bool(experts.has_gate),
        concatenated=bool(experts.is_concatenated),
        transposed=bool(experts.is_transposed),
        bias=bool(experts.has_bias),
    )


def _generic_params(experts: nn.Module, layout: ExpertsLayout, name: str) -> dict:
    """The experts' parameters by name; ValueError when they are not the layout's."""
    want = [layout.up_name, "down_proj"]
    if layout.bias:
        want += [f"{layout.up_name}_bias", "down_proj_bias"]
    params = dict(experts.named_parameters())
    dims = {layout.up_name: 3, "down_proj": 3, f"{layout.up_name}_bias": 2, "down_proj_bias": 2}
    bad = [n for n in want if n not in params or params[n].dim() != dims[n]]
    extra = sorted(set(params) - set(want))
    if bad or extra:
        raise ValueError(
            f"{name}: {type(experts).__name__} does not hold the fused experts neuron_tp "
            f"shards (expected {want} with {[dims[n] for n in want]} dims; missing or "
            f"misshapen: {bad}, unknown: {extra})"
        )
    return {n: params[n] for n in want}


def _check_generic(model: nn.Module, name: str, mesh: Mesh) -> None:
    experts = model.get_submodule(name)
    layout = _layout(experts, name)
    params = _generic_params(experts, layout, name)
    down = params["down_proj"]
    _require(down.shape[layout.down_dim], mesh, name, "expert intermediate size")
    _require_ep(down.shape[0], mesh, name)


def _gate_fn(experts: nn.Module, layout: ExpertsLayout):
    """The original's gating (``_apply_gate``, or ``act_fn``), on a copy holding no weights."""
    proxy: Any = copy.copy(experts)  # a transformers experts module, read by attribute name
    proxy._parameters = {}
    if layout.call == "dense":  # Llama-4: up * act(gate), halves

        def gate(h: torch.Tensor) -> torch.Tensor:
            g, u = h.chunk(2, dim=-1)
            return u * proxy.act_fn(g)

        return gate
    return proxy._apply_gate if layout.gated else proxy.act_fn


def _build_generic(
    model: nn.Module, name: str, mesh: Mesh, sequence_parallel: bool
) -> TPInterfaceExperts:
    experts = model.get_submodule(name)
    layout = _layout(experts, name)
    params = _generic_params(experts, layout, name)
    new = TPInterfaceExperts(params, layout, _gate_fn(experts, layout), mesh, sequence_parallel)
    tp, r = mesh.tp_size, mesh.tp_rank
    inter = params["down_proj"].shape[layout.down_dim]
    if layout.gated and layout.concatenated:
        up_pieces = tuple(even_pieces(inter, r, tp)) + tuple(even_pieces(inter, r, tp, inter))
    else:
        up_pieces = tuple(even_pieces(params[layout.up_name].shape[layout.up_dim], r, tp))
    set_slice_map(new, layout.up_name, HFSliceMap(layout.up_dim, up_pieces))
    if layout.bias:
        set_slice_map(new, f"{layout.up_name}_bias", HFSliceMap(1, up_pieces))
    set_slice_map(new, "down_proj", HFSliceMap(layout.down_dim, tuple(even_pieces(inter, r, tp))))
    new.train(experts.training)
    return new


def _parts(model: nn.Module, name: str) -> tuple[str, nn.Module, BlockSpec, _FusedExperts]:
    """The block's name, the block, its spec and its experts module; ValueError for an unknown
    block or router class."""
    block_name = name.rpartition(".")[0]
    block = model.get_submodule(block_name)
    cls = type(block).__name__
    spec = BLOCKS.get(cls)
    if spec is None or name.rpartition(".")[2] != "experts":
        raise ValueError(
            f"{name}: 'moe_tp_experts' planned in a {cls}, which is not a known MoE block; "
            f"known blocks (with an 'experts' child): {sorted(BLOCKS)}"
        )
    router = getattr(block, spec.router, None)
    rcls = type(router).__name__
    if rcls not in ROUTERS:
        raise ValueError(
            f"{block_name}.{spec.router}: unknown router type {rcls}; the routers neuron_tp "
            f"shards exactly: {sorted(ROUTERS)}"
        )
    # a transformers experts module, read by its attribute names (checked by check_moe)
    return block_name, block, spec, cast(_FusedExperts, model.get_submodule(name))


def _require(size: int, mesh: Mesh, name: str, what: str) -> None:
    if size % mesh.tp_size:
        raise ValueError(
            f"{name}: {what} {size} cannot be split over tp={mesh.tp_size}; tp degrees that "
            f"work with world size {mesh.world_size}: {valid_tp_degrees(mesh.world_size, size)}"
        )


def _require_ep(experts: int, mesh: Mesh, name: str) -> None:
    if experts % mesh.ep_size:
        ok = [d for d in divisors(mesh.dp_size) if experts % d == 0]
        raise ValueError(
            f"{name}: {experts} experts cannot be spread over ep={mesh.ep_size}; ep "
            f"degrees that work with dp={mesh.dp_size}: {ok}"
        )


def check_moe(model: nn.Module, name: str, mesh: Mesh) -> None:
    """The refusals for sharding the MoE block whose experts module is ``name``."""
    if _is_generic(model, name):
        _check_generic(model, name, mesh)
        return
    block_name, block, spec, experts = _parts(model, name)
    gu, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    if not (
        isinstance(gu, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gu.dim() == 3
        and down.dim() == 3
    ):
        raise ValueError(
            f"{name}: {type(experts).__name__} has no fused 3-D gate_up_proj [E, 2I, H] and "
            "down_proj [E, H, I] (transformers >= 5 layout)"
        )
    _require(down.shape[2], mesh, name, "expert intermediate size")
    _require_ep(down.shape[0], mesh, name)
    if spec.shared is not None:
        shared = getattr(block, spec.shared)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(shared, proj, None)
            if not isinstance(lin, nn.Linear) or lin.bias is not None:
                raise ValueError(
                    f"{block_name}.{spec.shared}.{proj}: expected an nn.Linear without bias"
                )
        _require(
            shared.gate_proj.out_features,
            mesh,
            f"{block_name}.{spec.shared}",
            "shared expert intermediate size",
        )


def build_moe(
    model: nn.Module, name: str, mesh: Mesh, sequence_parallel: bool
) -> tuple[str, ParallelMoEBlock | TPInterfaceExperts]:
    """``(module name, its sharded replacement)`` for the experts module ``name`` (checked by
    :func:`check_moe`): the whole block for the blocks of :data:`BLOCKS`, else the experts
    module itself; the model is not changed."""
    check_moe(model, name, mesh)
    if _is_generic(model, name):
        return name, _build_generic(model, name, mesh, sequence_parallel)
    block_name, block, spec, experts = _parts(model, name)
    tp, r = mesh.tp_size, mesh.tp_rank
    new_experts = TPExperts(experts.gate_up_proj, experts.down_proj, experts.act_fn, mesh)
    inter = experts.down_proj.shape[2]
    chunk = inter // tp
    set_slice_map(
        new_experts,
        "gate_up_proj",
        HFSliceMap(1, ((r * chunk, (r + 1) * chunk), (inter + r * chunk, inter + (r + 1) * chunk))),
    )
    set_slice_map(new_experts, "down_proj", HFSliceMap(2, tuple(even_pieces(inter, r, tp))))
    shared = None
    names = {"router": spec.router}
    if spec.shared is not None:
        old = getattr(block, spec.shared)
        shared = TPSharedMLP(
            old.gate_proj.weight, old.up_proj.weight, old.down_proj.weight, old.act_fn, mesh
        )
        s_inter = old.gate_proj.out_features
        for proj in ("gate_proj", "up_proj"):
            set_slice_map(
                getattr(shared, proj), "weight", HFSliceMap(0, tuple(even_pieces(s_inter, r, tp)))
            )
        set_slice_map(shared.down_proj, "weight", HFSliceMap(1, tuple(even_pieces(s_inter, r, tp))))
        names["shared"] = spec.shared
    gate = getattr(block, spec.shared_gate) if spec.shared_gate else None
    if gate is not None and spec.shared_gate:  # gate is set only for a named shared_gate
        names["shared_gate"] = spec.shared_gate
    new = ParallelMoEBlock(
        getattr(block, spec.router),
        new_experts,
        mesh,
        shared=shared,
        shared_gate=gate,
        names=names,
        jitter=float(getattr(block, spec.jitter, 0.0) or 0.0) if spec.jitter else 0.0,
        sequence_parallel=sequence_parallel,
    )
    new.train(block.training)
    return block_name, new


def keep_complete_grads(model: nn.Module) -> None:
    """Under sequence parallelism every replicated parameter of a decoder layer is marked to
    have its gradient summed over tp; an MoE block's router and shared-expert gate see the
    whole (gathered) sequence and get complete gradients (:mod:`neuron_tp.moe.block`): unmark
    them."""
    for block in model.modules():
        if isinstance(block, ParallelMoEBlock):
            for pname, _ in block.named_parameters():
                if get_sharding(block, pname) is None:
                    set_param_meta(block, pname, sum_grad_over_tp=False)


@contextlib.contextmanager
def recorded_router_logits(model: nn.Module):
    """Inside: the router logits of every MoE block of ``model`` (a :class:`ParallelMoEBlock`'s
    router, or the ``gate`` / ``router`` child of a block whose experts are sharded behind
    transformers' interface), in call order, appended to the yielded list."""
    logits: list = []
    routers = []
    for block in model.modules():
        if isinstance(block, ParallelMoEBlock):
            routers.append(block._child("router"))
        elif isinstance(getattr(block, "experts", None), TPInterfaceExperts):
            router = getattr(block, "gate", None) or getattr(block, "router", None)
            if isinstance(router, nn.Module):
                routers.append(router)
    hooks = [
        r.register_forward_hook(
            lambda _m, _a, out: logits.append(out[0] if isinstance(out, tuple) else out)
        )
        for r in routers
    ]
    try:
        yield logits
    finally:
        for h in hooks:
            h.remove()


def aux_loss_over_all_tokens(model: PreTrainedModel, logits: list):
    """transformers' load-balancing loss of ``model`` (its modeling module's
    ``load_balancing_loss_func``) over recorded router ``logits``, every position counted:
    what a packed (4-D) attention mask, which that function cannot read, leaves."""
    func = getattr(sys.modules[type(model).__module__], "load_balancing_loss_func", None)
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if func is None or not logits:
        return None
    return func(tuple(logits), experts, cfg.num_experts_per_tok, None)
