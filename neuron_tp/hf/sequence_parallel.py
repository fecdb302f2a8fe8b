"""Sequence parallelism for HF decoders: the residual stream between the tensor-parallel
linears is sharded on the sequence (dim 1). The model computes positions, rotary tables and
masks for the full sequence; the first decoder layer's input is scattered, norms run on
shards, the attention/MLP input is all-gathered once (in its parent's input hook), row-parallel
outputs are reduce-scattered, and the final norm's output is gathered back for the head."""
from __future__ import annotations

import torch
from torch import nn

from .. import regions
from ..mesh import Mesh
from ..sharding import get_sharding, mark_sequence_parallel

_FINAL_NORMS = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "decoder.final_layer_norm")


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The decoder-layer list of ``model`` (the longest ModuleList)."""
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and (best is None or len(mod) > len(best[1])):
            best = (name, mod)
    return best


def find_final_norm(model: nn.Module) -> nn.Module | None:
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    for attr in _FINAL_NORMS:
        mod = base
        for part in attr.split("."):
            mod = getattr(mod, part, None)
        if isinstance(mod, nn.Module):
            return mod
    return None


def _first_input(args, kwargs):
    if args:
        return args[0], lambda x: ((x, *args[1:]), kwargs)
    for key in ("hidden_states", "x", "input"):
        if isinstance(kwargs.get(key), torch.Tensor):
            return kwargs[key], lambda x, k=key: (args, {**kwargs, k: x})
    raise ValueError("tensor-parallel input hook: the module got no hidden-states input")


def check_sequence_parallel(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layers and final norm sequence parallelism hooks into, or a ValueError."""
    found, norm = find_layers(model), find_final_norm(model)
    if found is None or norm is None:
        raise ValueError(f"{type(model).__name__}: sequence_parallel needs a decoder with a "
                         "list of layers and a final norm (norm / ln_f / final_layernorm)")
    return found[1], norm


def apply_sequence_parallel(model: nn.Module, mesh: Mesh) -> nn.ModuleList:
    """Install the scatter/gather hooks and mark the partial-gradient parameters."""
    layers, norm = check_sequence_parallel(model)
    tp = mesh.tp

    def scatter(_mod, args, kwargs):
        x, put = _first_input(args, kwargs)
        if x.shape[1] % tp.size:
            raise ValueError(f"sequence_parallel: sequence length {x.shape[1]} is not divisible "
                             f"by tp={tp.size}; pad the sequence to a multiple of {tp.size} "
                             "(generation with a KV cache needs sequence_parallel=False)")
        return put(regions.scatter_to_sequence_parallel(x, tp, 1))

    def gather(_mod, _args, out):
        return regions.gather_from_tensor_parallel(out, tp, 1)

    layers[0].register_forward_pre_hook(scatter, with_kwargs=True)
    norm.register_forward_hook(gather)
    for mod in (layers, norm):
        for name, _ in mod.named_parameters():
            if get_sharding(mod, name) is None:
                mark_sequence_parallel(mod, name)
    return layers


def install_input_region(parent: nn.Module, children: list[nn.Module], mesh: Mesh,
                         sequence_parallel: bool) -> None:
    """One input region for all column-parallel children of ``parent``: copy (backward
    all-reduce), or with SP all-gather of the sequence (backward reduce-scatter)."""
    tp = mesh.tp

    def hook(_mod, args, kwargs):
        x, put = _first_input(args, kwargs)
        if sequence_parallel:
            x = regions.gather_from_sequence_parallel(x, tp, 1)
        else:
            x = regions.copy_to_tensor_parallel(x, tp)
        for c in children:
            c.region_input = x
        return put(x)

    for c in children:
        c.shared_region = True
    parent.register_forward_pre_hook(hook, with_kwargs=True)
