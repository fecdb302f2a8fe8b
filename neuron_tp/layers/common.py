"""Shared pieces of the layers: TP-invariant parameter creation and input checks."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self, TypeVar, cast

import torch
from torch import nn

from ..errors import UserError
from ..parallel.mesh import Group, Mesh, valid_tp_degrees
from ..parallel.sharding import Sharding, get_sharding, mark_sharded, shard_of


def require_divisible(size: int, group: Group, what: str, world_size: int) -> None:
    """Raise a clear error when ``group`` cannot split ``size`` evenly."""
    if size % group.size:
        raise ValueError(
            f"{what}={size} is not divisible by {group.name} size {group.size}; "
            f"degrees that divide both it and the world size {world_size}: "
            f"{valid_tp_degrees(world_size, size)}"
        )


def require_multiple(size: int, q: int, what: str, layer: str) -> None:
    """A clear error (before any collective) when ``size`` is not a multiple of ``q`` (the
    side of a 2D grid or 3D cube)."""
    if size % q:
        raise ValueError(
            f"{layer}: {what}={size} is not divisible by {q}; use a multiple of "
            f"{q} (e.g. {size + (-size) % q})"
        )


def make_parameter(
    module: nn.Module,
    name: str,
    full_shape: tuple[int, ...],
    splits: tuple[tuple[str, int], ...],
    *,
    mesh: Mesh,
    init_fn: Callable[[torch.Tensor], object] | None,
    device=None,
    dtype=None,
    segments=None,
) -> nn.Parameter:
    """Register on ``module`` as ``name`` this rank's shard of a parameter whose *full*
    tensor is initialised by ``init_fn``, and record its sharding on ``module``.

    The full tensor is drawn on the CPU from the global RNG and then sliced, so the same seed
    gives the same full weights at every TP degree. ``init_fn=None`` or ``device='meta'``
    skips initialisation (the caller loads weights).
    """
    sharding = Sharding(tuple(splits), tuple(full_shape), tuple(segments) if segments else None)
    dtype = dtype or torch.get_default_dtype()
    if init_fn is None or torch.device(device or "cpu").type == "meta":
        shape = shard_of(torch.empty(full_shape, device="meta"), sharding, mesh).shape
        p = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
    else:
        full = torch.empty(full_shape, dtype=torch.float32)
        init_fn(full)
        # clone: a CPU shard is a view of ``full`` and would keep the whole tensor alive
        shard = shard_of(full, sharding, mesh).to(device=device, dtype=dtype)
        if shard.device.type == "cpu" and (
            shard.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        ):
            shard = shard.clone(memory_format=torch.contiguous_format)
        p = nn.Parameter(shard)
    module.register_parameter(name, p)
    mark_sharded(module, name, sharding if splits else None)
    return p


def make_linear_parameters(
    module: nn.Module,
    in_features: int,
    out_features: int,
    bias: bool,
    *,
    weight_splits: tuple[tuple[str, int], ...],
    bias_splits: tuple[tuple[str, int], ...],
    mesh: Mesh,
    init_method: Callable[[torch.Tensor], object] | None,
    device=None,
    dtype=None,
    segments=None,
) -> tuple[nn.Parameter, nn.Parameter | None]:
    """This rank's shards of a linear's ``weight`` ``[out, in]`` (``init_method``, default
    ``nn.Linear``'s) and ``bias`` ``[out]`` (``nn.Linear``'s, or None), registered on ``module``
    with :func:`make_parameter`."""
    init = linear_weight_init if init_method is None else init_method
    weight = make_parameter(
        module,
        "weight",
        (out_features, in_features),
        weight_splits,
        mesh=mesh,
        init_fn=init,
        device=device,
        dtype=dtype,
        segments=segments,
    )
    b = (
        make_parameter(
            module,
            "bias",
            (out_features,),
            bias_splits,
            mesh=mesh,
            init_fn=linear_bias_init(in_features),
            device=device,
            dtype=dtype,
            segments=segments,
        )
        if bias
        else None
    )
    return weight, b


def linear_weight_init(w: torch.Tensor) -> None:
    """nn.Linear's default initialisation of a full ``[out, in]`` weight."""
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))


def linear_bias_init(fan_in: int) -> Callable[[torch.Tensor], object]:
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
    return lambda b: nn.init.uniform_(b, -bound, bound)


def check_device(x: torch.Tensor, mesh: Mesh, layer: str) -> None:
    """A virtual (trace-only) mesh only makes sense on XLA tensors."""
    if mesh.virtual and x.device.type != "xla":  # type: ignore[truthy-function]
        raise RuntimeError(
            f"{layer}: {mesh} is virtual (trace-only) and needs XLA tensors, got "
            f"a {x.device} tensor; move module and input to ntp.xla_device()"
        )


def check_input(
    x: torch.Tensor, weight: torch.Tensor, features: int, dim: int, layer: str, mesh: Mesh
) -> None:
    """Device, shape and dtype checks made before any collective runs."""
    check_device(x, mesh, layer)
    if x.shape[dim] != features:
        raise ValueError(
            f"{layer}: expected {features} features on dim {dim} of the input, got "
            f"shape {tuple(x.shape)}"
        )
    check_dtype(x, weight, layer)


def check_dtype(x: torch.Tensor, weight: torch.Tensor, layer: str) -> None:
    """The input has the weight's dtype (a mismatch would fail inside the matmul)."""
    if x.dtype != weight.dtype:
        raise TypeError(
            f"{layer}: input dtype {x.dtype} does not match weight dtype "
            f"{weight.dtype}; cast the input or the module"
        )


_Layer = TypeVar("_Layer", bound=nn.Module)


def load_shards_from(layer: _Layer, full: nn.Module) -> _Layer:
    """Give ``layer`` (built on meta) this rank's slices of the same-named parameters of the
    unsharded module ``full``; the sharding records of ``layer`` say how to slice."""
    # every parallel layer keeps its mesh as ``self.mesh`` (a plain attribute, not a submodule)
    mesh = cast(Mesh, layer.mesh)
    for name, _ in list(layer.named_parameters(recurse=False)):
        src = getattr(full, name)
        sh = get_sharding(layer, name) or Sharding((), tuple(src.shape))
        setattr(
            layer,
            name,
            nn.Parameter(shard_of(src.detach(), sh, mesh).clone(), requires_grad=src.requires_grad),
        )
    return layer


WRAP_FIRST = "wrap first, then parallelize: ntp.parallelize(get_peft_model(model, cfg), mesh)"


_LORA_BASE = "_ntp_lora_base"


def mark_lora_base(module) -> None:
    """Mark a parallel layer as the base of a LoRA wrapper (see :class:`RefusesPeftWrap`)."""
    module.__dict__[_LORA_BASE] = True


if TYPE_CHECKING:
    # Base of the layer mixins, which are only ever mixed into ``nn.Module`` subclasses
    # (``class Linear2D(FromLinear, nn.Module)``): the type checker sees them as modules, at
    # run time they stay plain mixins.
    LayerMixin = nn.Module
else:
    LayerMixin = object


class RefusesPeftWrap(LayerMixin):
    """Mixin of the parallel layers: peft's ``get_peft_model`` on an already parallelized
    model is refused with the order that works. peft asks each layer it is about to wrap for
    its transformers tensor-parallel plan (``_hf_tp_plan``); a parallel layer answers with a
    :class:`~neuron_tp.errors.UserError`, unless it is the base of a LoRA wrapper that
    :func:`neuron_tp.hf.parallelize` made (:func:`mark_lora_base`: peft's layer code reads the
    attribute too, and there the answer is "no transformers plan")."""

    @property
    def _hf_tp_plan(self) -> None:
        if self.__dict__.get(_LORA_BASE, False):
            return None
        raise UserError(
            f"{type(self).__name__} is a tensor-parallel layer (the model is already "
            f"parallelized); peft cannot wrap it: {WRAP_FIRST}"
        )


class FromLinear(RefusesPeftWrap):
    """Mixin: ``from_linear`` for a layer whose constructor takes ``(in_features,
    out_features, bias=..., mesh=..., device=..., dtype=...)`` like ``nn.Linear``."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, mesh: Mesh | None = None, **kwargs: Any) -> Self:
        """Shard an existing ``nn.Linear`` (every rank holds the same full module); extra
        keyword arguments go to the constructor."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            mesh=mesh,
            device="meta",
            dtype=linear.weight.dtype,
            **kwargs,
        )
        return load_shards_from(layer, linear)
