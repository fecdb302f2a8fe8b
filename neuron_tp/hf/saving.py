"""Save a consolidated transformers checkpoint of a parallelized model; its full state dict."""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any

import torch
from torch import nn

from ..backend.graphs import step_boundary
from ..errors import UserError
from ..layers.quantized import Int8WeightLinear, is_quantized
from ..moe.quantized import quantized_experts
from ..parallel.mesh import Mesh
from ..parallel.sharding import gather_full, named_parameter_meta
from ..parallel.state import mesh_of
from .quantized_files import gather_int8_state, model_format
from .slice_map import WHOLE, to_hf

INT8_BUFFERS = ("qweight", "weight_scale")


def gather_hf_state_dict(
    model: nn.Module, mesh: Mesh | None = None, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters, or their gradients, under their HF names, on every rank;
    without ``grads`` also the persistent buffers (replicated, e.g. an MoE router's
    ``e_score_correction_bias``), as transformers saves them.

    Collective over tp: every rank must call it. Gradients should be synced first
    (:func:`neuron_tp.sync_sequence_parallel_grads`)."""
    mesh = mesh_of(model, mesh)
    out = {}
    for name, p, meta in named_parameter_meta(model):
        t = p.grad if grads else p
        if t is None:
            continue
        full = gather_full(t, meta.sharding, mesh)
        out[name] = to_hf(full, meta.hf_layout or WHOLE) if meta.sharding else full.clone()
    if not grads:
        out.update((n, b.detach().clone()) for n, b in persistent_buffers(model))
        out.update(gather_int8_state(model, mesh))
    return out


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` for every buffer of ``model`` that belongs in its state dict (an int8
    layer's weight and scales are not: they are sharded, see :func:`gather_int8_state`)."""
    out = []
    for mname, mod in model.named_modules():
        int8 = INT8_BUFFERS if isinstance(mod, Int8WeightLinear) else ()
        for bname, b in mod.named_buffers(recurse=False):
            if b is not None and bname not in mod._non_persistent_buffers_set and bname not in int8:
                out.append((f"{mname}.{bname}" if mname else bname, b))
    return out


def check_int8_experts_saveable(model: nn.Module) -> None:
    """UserError (before any collective) for a model whose experts hold int8 weights: the
    int8 checkpoint format (format_version 1) stores int8 linears only."""
    names = quantized_experts(model)
    if names:
        raise UserError(
            f"cannot save {type(model).__name__}: its experts hold int8 weights ({names[0]}"
            f"{f' and {len(names) - 1} more' if len(names) > 1 else ''}) and neuron_tp's int8 "
            "checkpoint format stores int8 linears only; save the float model and quantize on "
            "load (--quantize int8 / neuron_tp.quantize)"
        )


def save_pretrained(model: nn.Module, out_dir: str, mesh: Mesh | None = None) -> None:
    """Write a consolidated transformers checkpoint (config + model.safetensors) from rank 0.

    Collective over the job (every rank calls it) and returns on every rank once the files
    are written (a failure to write raises on every rank): any rank may read them next. The
    files load with plain ``AutoModel*.from_pretrained``. A model quantized by
    :func:`neuron_tp.quantize` is written in neuron_tp's int8 format
    (:mod:`neuron_tp.hf.quantized_files`: int8 weights, float32 scales, a
    ``quantization_config``), which :func:`neuron_tp.from_pretrained` loads at any tp and
    plain transformers does not."""
    from safetensors.torch import save_file

    from ..parallel.agreement import check_agreement

    check_int8_experts_saveable(model)
    mesh = mesh_of(model, mesh)
    state = gather_hf_state_dict(model, mesh)
    # every rank executes the gathers' graph (XLA: rank 0 alone would wait in them), then
    # only rank 0 copies the full tensors to the host
    step_boundary(next((v.device for v in state.values()), torch.device("cpu")))
    error = None
    try:
        if mesh.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
            config: Any = model.config  # a transformers PretrainedConfig
            if is_quantized(model):
                config = copy.deepcopy(config)
                config.quantization_config = model_format(model).to_config()
            config.save_pretrained(out_dir)
            gen = getattr(model, "generation_config", None)
            if gen is not None:
                with contextlib.suppress(Exception):
                    gen.save_pretrained(out_dir)
            save_file(
                {k: v.cpu().contiguous() for k, v in state.items()},
                os.path.join(out_dir, "model.safetensors"),
                metadata={"format": "pt"},
            )
    except Exception as e:  # noqa: BLE001 - re-raised on every rank by check_agreement
        error = e
    check_agreement({}, mesh.group("world"), error=error, what=f"save_pretrained({out_dir!r})")
