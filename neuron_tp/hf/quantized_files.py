"""neuron_tp's int8 checkpoint format: a HuggingFace model directory whose converted linears
store ``<module>.weight`` as int8 (in the HF layout of the float weight) and
``<module>.weight_scale`` (float32, one per output channel of the full weight), with a
``quantization_config`` in config.json (:data:`QUANT_METHOD`, per-channel symmetric int8,
weight-only, the modules not converted).

Saving gathers each shard's int8 weight and scales (:func:`gather_int8_state`); loading reads
only this rank's slices of them, at any tp, and installs them without a float copy
(:func:`load_int8_layer`): a column shard reads its rows of the weight and of the scale, a row
shard its columns of the weight and the whole scale."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UserError
from ..layers.linear import ColumnParallelLinear, RowParallelLinear
from ..layers.quantized import QMAX, Int8WeightLinear, install_int8
from ..parallel.mesh import Mesh
from ..parallel.sharding import Sharding, gather_full, get_param_meta
from .slice_map import WHOLE, HFSliceMap, get_slice_map, read_local, to_hf

QUANT_METHOD = "neuron_tp"
QUANT_DTYPE = "int8"
QUANT_TYPE = "per_channel_symmetric"
SCALE = "weight_scale"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Int8Format:
    """The ``quantization_config`` of a neuron_tp int8 directory."""

    modules_to_not_convert: tuple[str, ...]

    def to_config(self) -> dict:
        return {
            "quant_method": QUANT_METHOD,
            "quantization_dtype": QUANT_DTYPE,
            "quantization_type": QUANT_TYPE,
            "weight_only": True,
            "qmax": QMAX,
            "scale_name": SCALE,
            "scale_dtype": "float32",
            "modules_to_not_convert": list(self.modules_to_not_convert),
            "format_version": FORMAT_VERSION,
        }


def read_format(config, path: str) -> Int8Format | None:
    """The int8 format recorded in a transformers ``config`` loaded from ``path``; None for a
    float checkpoint. UserError for any other quantization (named) or another version."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = qc.get("quant_method")
    if method != QUANT_METHOD:
        raise UserError(
            f"{path}: config.json's quantization_config is quant_method {method!r}; neuron_tp "
            f"loads float checkpoints (quantized on load with --quantize int8) and its own "
            f"int8 directories (quant_method {QUANT_METHOD!r}, written by neuron_tp."
            "save_pretrained of a quantized model): use the float checkpoint of this model"
        )
    want: dict[str, object] = {
        "quantization_dtype": QUANT_DTYPE,
        "quantization_type": QUANT_TYPE,
        "format_version": FORMAT_VERSION,
    }
    got = {k: qc.get(k) for k in want}
    if got != want:
        raise UserError(
            f"{path}: a neuron_tp quantization_config with {got}; this version reads {want}"
        )
    return Int8Format(tuple(qc.get("modules_to_not_convert") or ()))


def model_format(model: nn.Module) -> Int8Format:
    """The format record of quantized ``model``: its parallel linears left in float."""
    kept = [
        name
        for name, mod in model.named_modules()
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear))
        and not isinstance(mod, Int8WeightLinear)
    ]
    return Int8Format(tuple(kept))


def _scale_sharding(weight: Sharding | None) -> Sharding | None:
    """The scale's layout: the weight's splits of dim 0 (rows), none of dim 1."""
    if weight is None:
        return None
    splits = tuple((axis, 0) for axis, dim in weight.splits if dim == 0)
    return Sharding(splits, (weight.full_shape[0],)) if splits else None


def gather_int8_state(model: nn.Module, mesh: Mesh) -> dict[str, torch.Tensor]:
    """``{<module>.weight: int8, <module>.weight_scale: float32}`` of every int8 layer,
    unsharded and in the HF layout (as the float weight is stored), on every rank.
    Collective over tp."""
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, Int8WeightLinear) or not isinstance(mod, nn.Module):
            continue
        meta = get_param_meta(mod, "weight")
        layout = meta.hf_layout or WHOLE
        q = gather_full(mod.qweight, meta.sharding, mesh)
        scale = gather_full(mod.weight_scale.float(), _scale_sharding(meta.sharding), mesh)
        if layout.keep_rows is not None:
            rows = torch.tensor(layout.keep_rows, dtype=torch.long, device=scale.device)
            scale = scale.index_select(0, rows)
        prefix = f"{name}." if name else ""
        out[prefix + "weight"] = to_hf(q, layout) if meta.sharding else q.clone()
        out[prefix + SCALE] = scale.contiguous()
    return out


def _scale_map(layout: HFSliceMap) -> HFSliceMap:
    """How this rank's scales come from the stored ``[out]`` scale: the weight's pieces when
    it is split along its output dim (dim 1 of a transposed ``[in, out]`` stored weight)."""
    out_dim = 1 if layout.transpose else 0
    if layout.dim != out_dim:
        return WHOLE
    return HFSliceMap(0, layout.pieces)


def load_int8_layer(mod: nn.Module, name: str, opened, dtype: torch.dtype) -> None:
    """Install this rank's slice of stored int8 weight ``name`` and of its scale into parallel
    linear ``mod`` (its ``weight`` still on the meta device), the scale in ``dtype``."""
    if not isinstance(mod, (ColumnParallelLinear, RowParallelLinear)):
        raise UserError(
            f"{name}: stored as int8 but the model's layer is {type(mod).__name__}; int8 "
            "checkpoints load into the 1D column/row-parallel linears (tp_mode '1d')"
        )
    scale_name = name[: -len("weight")] + SCALE
    layout = get_slice_map(mod, "weight")
    q = read_local(
        lambda d, a, b: opened.read(name, d, a, b), opened.shape(name), layout
    ).contiguous()
    scale = read_local(
        lambda d, a, b: opened.read(scale_name, d, a, b),
        opened.shape(scale_name),
        _scale_map(layout),
    )
    scale = torch.where(scale == 0, torch.ones_like(scale), scale).to(dtype)  # padding rows
    if q.dtype != torch.int8:
        raise UserError(f"{name}: has {scale_name} but is stored as {q.dtype}, not int8")
    install_int8(mod, q, scale.contiguous())
