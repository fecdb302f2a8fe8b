"""int8 weights for a whole sharded model: its column/row-parallel linears
(:mod:`neuron_tp.layers.quantized`) and its routed experts (:mod:`neuron_tp.moe.quantized`),
with the same per-output-channel symmetric scales. ``neuron_tp.quantize`` and ``--quantize
int8`` call :func:`quantize`."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UserError
from ..layers.quantized import (
    DEFAULT_NOT_CONVERT,
    check_dtype,
    check_quantizable,
    excluded,
    is_quantized,
    quantize_int8,
    quantize_targets,
)
from ..moe.quantized import expert_targets, expert_weights, quantize_experts, quantized_experts
from ..parallel.mesh import Mesh, get_mesh


def check_model(model: nn.Module, not_convert: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    """The experts modules to quantize; UserError (before any collective) for a model
    :func:`quantize` cannot convert."""
    done = quantized_experts(model)
    if done:
        raise UserError(f"{type(model).__name__} is already quantized ({done[0]} is int8)")
    targets = expert_targets(model, lambda name: excluded(name, not_convert))
    if quantize_targets(model, not_convert) or not targets:
        check_quantizable(model, not_convert)
    elif is_quantized(model):
        raise UserError(f"{type(model).__name__} is already quantized")
    for name, mod in targets:
        for w in expert_weights(mod):
            p = getattr(w.owner, w.name)
            if p.is_meta or not p.is_floating_point():
                raise UserError(
                    f"{name}.{w.name}: int8 quantization needs loaded float expert weights, "
                    f"got {p.dtype} on {p.device}"
                )
    return targets


@torch.no_grad()
def quantize(
    model: nn.Module,
    mesh: Mesh | None = None,
    dtype: str = "int8",
    modules_to_not_convert=DEFAULT_NOT_CONVERT,
    device: torch.device | str | None = None,
) -> nn.Module:
    """``neuron_tp.quantize``: weight-only int8 of a sharded model for inference, in place:
    every column/row-parallel linear and every routed experts module (per expert) not named
    (or under a module named) in ``modules_to_not_convert``. Only ``dtype="int8"``. Collective
    over tp (one all-reduce(max) for the row-parallel linears, one for the experts' down
    weights): every tp rank calls it with the same model. ``device``: where those
    all-reduces run (default: the CPU on a gloo mesh, the XLA device otherwise). Refuses
    (UserError, before any collective) an already quantized model, one with neither
    parallel linears nor sharded experts, a tied weight."""
    check_dtype(dtype)
    not_convert = tuple(modules_to_not_convert or ())
    experts = check_model(model, not_convert)
    mesh = get_mesh(mesh)
    if device is None and mesh.tp_size > 1:
        device = torch.device("cpu") if mesh.tp.process_group is not None else _xla_device()
    if quantize_targets(model, not_convert):
        quantize_int8(model, mesh, not_convert, device)
    if experts:
        quantize_experts(experts, mesh, device)
    return model


def _xla_device() -> torch.device:
    from ..backend import xla as _xla

    return _xla.device()
