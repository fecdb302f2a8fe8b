"""Weight-only int8 of the routed experts (:class:`~neuron_tp.moe.TPExperts`,
:class:`~neuron_tp.moe.TPInterfaceExperts`) and of the sharded shared experts
(:class:`~neuron_tp.moe.TPSharedMLP`), for inference.

Each fused expert weight (``gate_up_proj`` / ``up_proj`` and ``down_proj``, ``[E, O, I]`` or
transposed ``[E, I, O]``) is kept as an int8 buffer ``q<name>`` and one symmetric scale per
(expert, output channel), ``<name>_scale [E, O_local]`` in the compute dtype:
``q = clamp(round(W / s), -127, 127)``, ``s = max|W[e, o, :]| / 127``. Reading ``<name>``
returns ``q * s`` computed in the graph, per expert; no float copy is stored. Biases stay float.
A shared expert's three linears become ``qweight`` / ``weight_scale [O_local]`` the same way.

The scales are those of the unsharded expert, as for the linears
(:mod:`neuron_tp.layers.quantized`): the up (gate/up) weight is split over tp along its output
channels (a column shard: each rank's rows are whole, its scales are its own), the down weight
along its input (a row shard: the maxima of the rank's slices are combined by one
all-reduce(max) over tp for all the experts of the model); a shared expert's gate/up linears
are column shards, its down linear a row shard. Under expert parallelism each rank
quantizes only the experts it holds (its tp group holds the same ones): no exchange over ep.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..parallel import comm
from ..parallel.mesh import Mesh
from .experts import TPExperts
from .interface import TPInterfaceExperts
from .shared import TPSharedMLP

QMAX = 127
EXPERT_CLASSES = (TPExperts, TPInterfaceExperts, TPSharedMLP)


class ExpertWeight(NamedTuple):
    """One weight to quantize: its ``owner`` module, its attribute ``name``, the dim of its
    input features (``in_dim``: the reduced one; 2 for fused ``[E, O, I]``, 1 for transposed
    ``[E, I, O]`` or an nn.Linear ``[O, I]``) and whether tp splits that input dim
    (``in_split``: a row shard, whose scales need the full rows)."""

    owner: nn.Module
    name: str
    in_dim: int
    in_split: bool


def expert_weights(mod: nn.Module) -> list[ExpertWeight]:
    """The weights of experts module ``mod`` (routed experts: up and down fused weights; a
    shared expert: its three linears)."""
    if isinstance(mod, TPInterfaceExperts):
        lay = mod.layout
        up_in = 1 if lay.transposed else 2
        return [
            ExpertWeight(mod, lay.up_name, up_in, False),
            ExpertWeight(mod, "down_proj", up_in, True),
        ]
    if isinstance(mod, TPExperts):
        return [
            ExpertWeight(mod, "gate_up_proj", 2, False),
            ExpertWeight(mod, "down_proj", 2, True),
        ]
    if isinstance(mod, TPSharedMLP):
        return [
            ExpertWeight(mod.gate_proj, "weight", 1, False),
            ExpertWeight(mod.up_proj, "weight", 1, False),
            ExpertWeight(mod.down_proj, "weight", 1, True),
        ]
    raise TypeError(f"{type(mod).__name__} is not a neuron_tp experts module")


class Int8Experts:
    """Mixin of a quantized experts module: each fused weight reads as its int8 buffer times
    its per-(expert, channel) scales, recomputed in the graph."""

    quantized = "int8"

    def extra_repr(self) -> str:
        base = super().extra_repr()  # type: ignore[misc]
        return ", ".join(filter(None, (base, "weights=int8 per-channel symmetric")))


def _dequantized(name: str, in_dim: int) -> property:
    def read(self) -> torch.Tensor:
        scale = getattr(self, _scale_name(name))
        return getattr(self, "q" + name).to(scale.dtype) * scale.unsqueeze(in_dim)

    return property(read)


def _scale_name(name: str) -> str:
    return f"{name}_scale"


_CLASSES: dict[tuple, type] = {}


def _quantized_class(cls: type, weights: tuple[tuple[str, int], ...]) -> type:
    key = (cls, weights)
    if key not in _CLASSES:
        props = {name: _dequantized(name, in_dim) for name, in_dim in weights}
        _CLASSES[key] = type(f"Int8{cls.__name__}", (Int8Experts, cls), props)
    return _CLASSES[key]


def quantize_expert_weight(w: torch.Tensor, in_dim: int, absmax: torch.Tensor | None = None):
    """``(q int8, scale [E, O])`` of fused expert weight ``w`` (``absmax [E, O]``: the full
    rows' maxima when ``w`` holds a slice of its input dim)."""
    wf = w.detach().float()
    amax = wf.abs().amax(dim=in_dim) if absmax is None else absmax.float()
    scale = (amax / QMAX).to(w.dtype)
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero channel
    q = torch.round(wf / scale.float().unsqueeze(in_dim)).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def install_int8_experts(weights: list[ExpertWeight], tensors: list[tuple]) -> None:
    """Make each weight's owner hold ``tensors[i] = (q int8, scale)`` for ``weights[i]`` in
    place of its float parameter (sharding records stay under the parameter's name)."""
    owners: dict[int, tuple[nn.Module, list[tuple[str, int]]]] = {}
    for w, (q, scale) in zip(weights, tensors, strict=True):
        old = w.owner._parameters[w.name]
        if old is None or q.dtype != torch.int8 or q.shape != old.shape:
            want = None if old is None else tuple(old.shape)
            raise ValueError(f"int8 {w.name} {q.dtype} {tuple(q.shape)} for {want}")
        del w.owner._parameters[w.name]
        w.owner.register_buffer("q" + w.name, q)
        w.owner.register_buffer(_scale_name(w.name), scale)
        owners.setdefault(id(w.owner), (w.owner, []))[1].append((w.name, w.in_dim))
    for owner, names in owners.values():
        owner.__class__ = _quantized_class(type(owner), tuple(names))


def quantized_experts(model: nn.Module) -> list[str]:
    """Names of the experts modules of ``model`` holding int8 weights."""
    return [n for n, m in model.named_modules() if isinstance(m, Int8Experts)]


def expert_targets(model: nn.Module, excluded) -> list[tuple[str, nn.Module]]:
    """The float experts modules of ``model`` whose name ``excluded(name)`` does not reject."""
    return [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, EXPERT_CLASSES)
        and not isinstance(mod, Int8Experts)
        and not excluded(name)
    ]


@torch.no_grad()
def quantize_experts(
    targets: list[tuple[str, nn.Module]], mesh: Mesh, device: torch.device | str | None
) -> None:
    """Quantize the experts modules ``targets`` in place. Collective over tp (one
    all-reduce(max) on ``device`` for all row-split weights, when tp > 1): every tp rank
    calls it with the same modules."""
    weights = [w for _, mod in targets for w in expert_weights(mod)]
    absmax = [getattr(w.owner, w.name).detach().float().abs().amax(dim=w.in_dim) for w in weights]
    split = [i for i, w in enumerate(weights) if w.in_split]
    if split and mesh.tp_size > 1:
        local = torch.cat([absmax[i].reshape(-1) for i in split])
        full = comm.all_reduce_max(local.to(device or local.device), mesh.tp).to(local.device)
        for i, part in zip(split, full.split([absmax[i].numel() for i in split])):
            absmax[i] = part.view_as(absmax[i])
    tensors = []
    for w, amax in zip(weights, absmax):
        p = getattr(w.owner, w.name)
        q, scale = quantize_expert_weight(p, w.in_dim, amax)
        tensors.append((q.to(p.device), scale.to(p.device)))
    install_int8_experts(weights, tensors)
