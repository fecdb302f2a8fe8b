"""Sequence parallelism for HF decoders: the residual stream between the tensor-parallel
linears is sharded on the sequence (dim 1). The model computes positions, rotary tables and
masks for the full sequence; the first decoder layer's input is scattered, norms run on
shards, the attention/MLP input is all-gathered once (in its parent's input hook), row-parallel
outputs are reduce-scattered, and the final norm's output is gathered back for the head.

The hooks are small classes that, like the layers, state the activation layouts they take and
return (``input_layout`` / ``output_layout``)."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..layers.activation_layout import REPLICATED, SHARDED_SEQUENCE
from ..parallel import gathered_linears, regions
from ..parallel.mesh import Group, Mesh
from ..parallel.sharding import get_sharding, mark_sequence_parallel

if TYPE_CHECKING:
    from .modules import HFColumnLinear


def _first_input(args, kwargs):
    if args:
        return args[0], lambda x: ((x, *args[1:]), kwargs)
    for key in ("hidden_states", "x", "input"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key], lambda x, k=key: (args, {**kwargs, k: x})
    raise ValueError("tensor-parallel input hook: the module got no hidden-states input")


def check_sequence_parallel(
    model: nn.Module, layers_name: str | None, norm_name: str | None
) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers and final norm sequence parallelism hooks into (their module names
    from the plan's :class:`~neuron_tp.hf.styles.ModelStructure`), or a ValueError."""
    if layers_name is None or norm_name is None:
        raise ValueError(
            f"{type(model).__name__}: sequence_parallel needs a decoder with a "
            "list of layers and a final norm (norm / ln_f / final_layernorm)"
        )
    layers = model.get_submodule(layers_name)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: sequence_parallel needs the decoder layers "
            f"{layers_name!r} as a ModuleList, not a {type(layers).__name__}"
        )
    from .sparse_activation import refuse_stacked_residual

    refuse_stacked_residual(model, layers)
    return layers, model.get_submodule(norm_name)


class ScatterSequence:
    """Forward pre-hook of the first decoder layer: keep this rank's chunk of the sequence
    (backward: all-gather)."""

    input_layout, output_layout = REPLICATED, SHARDED_SEQUENCE

    def __init__(self, tp: Group):
        self.tp = tp

    def __call__(self, _mod: nn.Module, args, kwargs):
        x, put = _first_input(args, kwargs)
        tp = self.tp
        if x.shape[1] % tp.size:
            raise ValueError(
                f"sequence_parallel: sequence length {x.shape[1]} is not divisible "
                f"by tp={tp.size}; pad the sequence to a multiple of {tp.size} "
                "(generation with a KV cache needs sequence_parallel=False)"
            )
        return put(regions.split_fwd_all_gather_bwd(x, tp, dim=1))


class GatherSequence:
    """Forward hook of the final norm: the full sequence for the head (backward: keep this
    rank's chunk)."""

    input_layout, output_layout = SHARDED_SEQUENCE, REPLICATED

    def __init__(self, tp: Group):
        self.tp = tp

    def __call__(self, _mod: nn.Module, _args, out: torch.Tensor) -> torch.Tensor:
        return regions.all_gather_fwd_split_bwd(out, self.tp, dim=1)


# A decoder layer's own input beside the hidden states, made by the model for the whole
# sequence (Gemma-3n / Gemma-4 per-layer inputs): as sequence-sharded as the residual stream.
LAYER_INPUT = "per_layer_input"


class ScatterLayerInput:
    """Forward pre-hook of a decoder layer taking :data:`LAYER_INPUT` (second positional
    argument or keyword): keep this rank's chunk of its sequence (backward: all-gather)."""

    input_layout, output_layout = REPLICATED, SHARDED_SEQUENCE

    def __init__(self, tp: Group):
        self.tp = tp

    def __call__(self, _mod: nn.Module, args, kwargs):
        if len(args) > 1 and isinstance(args[1], torch.Tensor):
            x = regions.split_fwd_all_gather_bwd(args[1], self.tp, dim=1)
            return (args[0], x, *args[2:]), kwargs
        if isinstance(kwargs.get(LAYER_INPUT), torch.Tensor):
            x = regions.split_fwd_all_gather_bwd(kwargs[LAYER_INPUT], self.tp, dim=1)
            return args, {**kwargs, LAYER_INPUT: x}
        return None


def _takes_layer_input(layer: nn.Module) -> bool:
    import inspect

    names = list(inspect.signature(layer.forward).parameters)
    return len(names) > 1 and names[1] == LAYER_INPUT


def apply_sequence_parallel(
    model: nn.Module, mesh: Mesh, layers_name: str | None, norm_name: str | None
) -> nn.ModuleList:
    """Install the scatter/gather hooks and mark the partial-gradient parameters."""
    layers, norm = check_sequence_parallel(model, layers_name, norm_name)
    layers[0].register_forward_pre_hook(ScatterSequence(mesh.tp), with_kwargs=True)
    for layer in layers:
        if _takes_layer_input(layer):
            layer.register_forward_pre_hook(ScatterLayerInput(mesh.tp), with_kwargs=True)
    norm.register_forward_hook(GatherSequence(mesh.tp))
    for mod in (layers, norm):
        for name, _ in mod.named_parameters():
            if get_sharding(mod, name) is None:
                mark_sequence_parallel(mod, name)
    return layers


class SharedInputRegion:
    """Forward pre-hook of a module whose column-parallel children all read its input: their
    input region, applied once. Copy (backward all-reduce), or with SP all-gather of the
    sequence (backward reduce-scatter).

    With SP and ``regather`` (the default) the children save only the sequence shard and
    all-gather it again in backward, once for all of them
    (:func:`neuron_tp.parallel.gathered_linears.gather_for_shared_linears`): still one
    all-gather forward, one more in backward, and 1/tp of the gathered input's memory.
    ``regather=False`` lets the children save the gathered input (no backward all-gather)."""

    output_layout = REPLICATED

    def __init__(
        self,
        tp: Group,
        children: list[HFColumnLinear],
        sequence_parallel: bool,
        regather: bool = True,
    ):
        self.tp, self.children, self.sequence_parallel = tp, children, sequence_parallel
        self.regather = regather
        self.input_layout = SHARDED_SEQUENCE if sequence_parallel else REPLICATED

    def __call__(self, _mod: nn.Module, args, kwargs):
        x, put = _first_input(args, kwargs)
        if self.sequence_parallel and self.regather:
            x = gathered_linears.gather_for_shared_linears(x, self.tp, dim=1)
        elif self.sequence_parallel:
            x = regions.all_gather_fwd_reduce_scatter_bwd(x, self.tp, dim=1)
        else:
            x = regions.identity_fwd_all_reduce_bwd(x, self.tp)
        ref = weakref.ref(x)  # a strong reference would keep the gathered input alive
        for c in self.children:
            c.region_input = ref
        return put(x)


def install_input_region(
    parent: nn.Module,
    children: list[HFColumnLinear],
    mesh: Mesh,
    sequence_parallel: bool,
    regather: bool = True,
) -> None:
    """One input region (:class:`SharedInputRegion`) for all column-parallel children of
    ``parent``."""
    for c in children:
        c.shared_region = True
    parent.register_forward_pre_hook(
        SharedInputRegion(mesh.tp, children, sequence_parallel, regather), with_kwargs=True
    )
