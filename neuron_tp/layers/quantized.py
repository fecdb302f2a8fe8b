"""Weight-only int8 quantization of the tensor-parallel linear layers (inference).

Each :class:`ColumnParallelLinear` / :class:`RowParallelLinear` of a sharded model keeps its
weight as an int8 buffer ``qweight`` (``[out_local, in_local]``) and one symmetric scale per
output row, ``weight_scale`` (``[out_local]``, in the layer's compute dtype), instead of the
float parameter ``weight``: ``q = clamp(round(W / s), -127, 127)``, ``s = max|W[row, :]| / 127``.
``layer.weight`` then reads ``q * s`` computed inside the forward graph (the int8 tensor is what
lives in device memory; the float weight is an intermediate of the matmul's graph).

The scales are the ones of the UNSHARDED weight, so a quantized shard equals the matching slice
of the quantized full layer:

- column-parallel shards hold whole rows: each rank's scales come from its own rows;
- row-parallel shards hold a slice of every row: the row maxima of the shards are combined
  with ONE all-reduce(max) over tp for all row-parallel layers of the model (a vector of
  ``out`` values per layer), at load time, before any scale is used. Quantizing from the full
  weight before slicing would need the full weight on every rank, which the slice-by-slice
  loading of a HF directory or a checkpoint never builds.

The names follow NxD Inference (``quantization_dtype="int8"``,
``quantization_type="per_channel_symmetric"``, ``modules_to_not_convert``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import UserError
from ..parallel import comm
from ..parallel.mesh import Mesh, get_mesh
from .common import LayerMixin
from .linear import ColumnParallelLinear, RowParallelLinear

QMAX = 127
DEFAULT_NOT_CONVERT = ("lm_head",)


class Int8WeightLinear(LayerMixin):
    """Mixin of a quantized parallel linear: ``weight`` is the dequantized int8 weight,
    recomputed in the graph at each read (no float copy is stored)."""

    quantized = "int8"
    qweight: torch.Tensor
    weight_scale: torch.Tensor

    @property
    def weight(self) -> torch.Tensor:
        return self.qweight.to(self.weight_scale.dtype) * self.weight_scale.unsqueeze(1)

    def extra_repr(self) -> str:
        return super().extra_repr() + ", weight=int8 per-channel symmetric"


_CLASSES: dict[type, type] = {}


def _quantized_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Int8{cls.__name__}", (Int8WeightLinear, cls), {})
    return _CLASSES[cls]


def is_quantized(model: nn.Module) -> bool:
    """True when some layer of ``model`` holds int8 weights."""
    return any(isinstance(m, Int8WeightLinear) for m in model.modules())


def excluded(name: str, not_convert: tuple[str, ...]) -> bool:
    """True when module ``name`` is, or sits under, a module named in ``not_convert``."""
    parts = name.split(".")
    return any(
        name == m or name.endswith("." + m) or m in parts or name.startswith(m + ".")
        for m in not_convert
    )


def quantize_targets(
    model: nn.Module, not_convert=DEFAULT_NOT_CONVERT
) -> list[tuple[str, ColumnParallelLinear | RowParallelLinear]]:
    """The ``(name, layer)`` pairs :func:`quantize_int8` converts: every column/row-parallel
    linear not named (or under a module named) in ``not_convert``."""
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, (ColumnParallelLinear, RowParallelLinear))
        and not excluded(name, tuple(not_convert))
    ]


def check_quantizable(model: nn.Module, not_convert=DEFAULT_NOT_CONVERT) -> None:
    """UserError, before any collective, for a model :func:`quantize_int8` cannot convert."""
    if is_quantized(model):
        raise UserError(f"{type(model).__name__} is already quantized")
    targets = quantize_targets(model, not_convert)
    if not targets:
        raise UserError(
            f"{type(model).__name__}: no column/row-parallel linear layer to quantize (int8 "
            "weights apply to a model sharded by neuron_tp.parallelize with the 1D layers; "
            f"excluded: {', '.join(not_convert) or 'none'})"
        )
    owners: dict[int, list[str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(f"{mname}.{pname}" if mname else pname)
    for name, mod in targets:
        w = mod.weight
        if w.is_meta or not w.is_floating_point():
            raise UserError(f"{name}: int8 quantization needs a loaded float weight, got {w}")
        if len(owners.get(id(w), [])) > 1:
            raise UserError(
                f"{name}: its weight is tied to {', '.join(owners[id(w)])}; add {name} to "
                "modules_to_not_convert (tied weights stay unquantized)"
            )


@torch.no_grad()
def quantize_int8(
    model: nn.Module,
    mesh: Mesh | None = None,
    modules_to_not_convert=DEFAULT_NOT_CONVERT,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Quantize the parallel linear layers of ``model`` (in place) to int8 weights with one
    symmetric scale per output row; the LM head (``modules_to_not_convert``) and embeddings
    stay as they are. Collective over tp (one all-reduce(max) when the model has row-parallel
    layers and tp > 1): every tp rank calls it with the same model. ``device``: where that
    all-reduce runs (default: the CPU on a gloo mesh, the XLA device otherwise); the weights
    are converted where they are. Refuses (UserError, before any collective) an already
    quantized model, one without parallel linears, and a tied weight."""
    not_convert = tuple(modules_to_not_convert or ())
    check_quantizable(model, not_convert)
    mesh = get_mesh(mesh)
    targets = quantize_targets(model, not_convert)
    absmax = [m.weight.detach().float().abs().amax(dim=1) for _, m in targets]
    rows = [i for i, (_, m) in enumerate(targets) if isinstance(m, RowParallelLinear)]
    if rows and mesh.tp_size > 1:
        local = torch.cat([absmax[i] for i in rows])
        where = device or (
            torch.device("cpu") if mesh.tp.process_group is not None else _xla_device()
        )
        full = comm.all_reduce_max(local.to(where), mesh.tp).to(local.device)
        for i, part in zip(rows, full.split([absmax[i].numel() for i in rows])):
            absmax[i] = part
    for (_, mod), amax in zip(targets, absmax):
        _convert(mod, amax)
    return model


def _xla_device() -> torch.device:
    from ..backend import xla as _xla

    return _xla.device()


def quantize_weight(w: torch.Tensor, absmax: torch.Tensor | None = None, dtype=None):
    """``(q int8 [out, in], scale [out] in dtype)`` of ``w`` (row maxima ``absmax`` when given:
    those of the full rows of a row-parallel shard)."""
    dtype = dtype or w.dtype
    w = w.detach().float()
    amax = w.abs().amax(dim=1) if absmax is None else absmax.float()
    scale = (amax / QMAX).to(dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero (padding) row
    q = torch.round(w / scale.float().unsqueeze(1)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def _convert(mod: ColumnParallelLinear | RowParallelLinear, absmax: torch.Tensor) -> None:
    w = mod.weight
    q, scale = quantize_weight(w, absmax, w.dtype)
    install_int8(mod, q.to(w.device), scale.to(w.device))


def install_int8(mod: nn.Module, qweight: torch.Tensor, scale: torch.Tensor) -> None:
    """Make parallel linear ``mod`` an int8 layer holding ``qweight`` (int8, its weight's
    local shape) and ``scale`` (one per local output row, in the compute dtype) in place of
    its float (or meta) ``weight`` parameter; its sharding record stays under ``weight``."""
    w = mod._parameters["weight"]
    if w is None:
        raise ValueError(f"{type(mod).__name__} has no weight parameter to quantize")
    if qweight.dtype != torch.int8 or tuple(qweight.shape) != tuple(w.shape):
        raise ValueError(f"int8 weight {qweight.dtype} {tuple(qweight.shape)} for {tuple(w.shape)}")
    if tuple(scale.shape) != (w.shape[0],):
        raise ValueError(f"scale {tuple(scale.shape)} for a weight of {w.shape[0]} rows")
    del mod._parameters["weight"]
    mod.register_buffer("qweight", qweight)
    mod.register_buffer("weight_scale", scale)
    mod.__class__ = _quantized_class(type(mod))


def check_dtype(dtype: str) -> None:
    """UserError for a quantization dtype other than ``"int8"``."""
    if dtype != "int8":
        raise UserError(
            f"quantization dtype {dtype!r} is not supported: use 'int8' (fp8 brings no compute "
            "gain on Trn1/Inf2 and F8E4M3FN is not supported there)"
        )
