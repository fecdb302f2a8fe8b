"""How each parameter is laid out over the mesh, recorded on the module that owns it.

A record lives in the owning module's ``_ntp_params`` dict, keyed by the parameter's attribute
name, never on the Parameter object: ``module.to(xla_device)``, ``load_state_dict``-style
replacement and re-tying all make or swap Parameter objects, and anything stored on them would
be silently lost (``../shared/PLATFORM.md``). Layers record their parameters when they create
them; gradient sync and clipping, checkpoints and ``gather_full`` read the records through
:func:`get_param_meta` / :func:`named_parameter_meta`. No record = replicated over tp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from . import comm
from .mesh import Mesh, get_mesh

_META = "_ntp_params"


@dataclass(frozen=True)
class Sharding:
    """``splits``: (mesh axis, tensor dim) pairs, outermost first; ``full_shape``: the
    unsharded shape (smaller than shards x chunk when the dim was padded, e.g. a vocab).
    ``segments``: for a packed projection (fused QKV, gate_up), the sizes of the pieces of the
    innermost (last) split's dim that are each split separately; a rank holds its chunk of
    every piece. An ``("ep", dim)`` split spreads MoE experts over the expert-parallel group."""

    splits: tuple[tuple[str, int], ...]
    full_shape: tuple[int, ...]
    segments: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ParamMeta:
    """Everything neuron_tp knows about one parameter slot of a module.

    ``sharding``: how it is split (None = replicated over tp). ``sum_grad_over_tp``: a
    replicated parameter whose gradient is partial on each tp rank (used on sequence shards,
    or ``replicated_with_grad_allreduce`` in an HF plan): summed over tp after backward.
    ``hf_layout``: where its rows come from in the HF checkpoint (:mod:`neuron_tp.hf.slice_map`).
    """

    sharding: Sharding | None = None
    sum_grad_over_tp: bool = False
    hf_layout: Any = None


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    if not isinstance(module, nn.Module) or not isinstance(name, str):
        raise TypeError(
            "parameter records live on the owning module: pass (module, "
            "'weight') or (model, 'layers.0.mlp.up_proj.weight'), not a tensor"
        )
    parent, _, local = name.rpartition(".")
    return (module.get_submodule(parent) if parent else module), local


def get_param_meta(module: nn.Module, name: str) -> ParamMeta:
    """The record of parameter ``name`` (dotted names resolve to the owning submodule)."""
    owner, local = _owner(module, name)
    return owner.__dict__.get(_META, {}).get(local, ParamMeta())


def set_param_meta(module: nn.Module, name: str, **changes) -> None:
    """Update fields of the record of parameter ``name`` of ``module``."""
    owner, local = _owner(module, name)
    records = owner.__dict__.setdefault(_META, {})
    records[local] = replace(records.get(local, ParamMeta()), **changes)


def copy_param_meta(src: nn.Module, src_name: str, dst: nn.Module, dst_name: str) -> None:
    """Give parameter slot ``dst_name`` of ``dst`` the record of ``src_name`` of ``src`` (a
    tied parameter must be described the same way under all its names)."""
    owner, local = _owner(dst, dst_name)
    owner.__dict__.setdefault(_META, {})[local] = get_param_meta(src, src_name)


def get_sharding(module: nn.Module, name: str) -> Sharding | None:
    """How parameter ``name`` of ``module`` is split (None = replicated over tp)."""
    return get_param_meta(module, name).sharding


def mark_sharded(module: nn.Module, name: str, sharding: Sharding | None) -> None:
    set_param_meta(module, name, sharding=sharding)


def mark_sequence_parallel(module: nn.Module, name: str | None = None) -> None:
    """Mark replicated parameters used on sequence shards (norm weights, row-parallel biases
    under SP): their gradients are summed over tp by
    :func:`neuron_tp.optim.grads.sync_sequence_parallel_grads`. ``name=None`` marks every parameter
    of ``module`` and its submodules."""
    names = [name] if name is not None else [n for n, _ in module.named_parameters()]
    for n in names:
        set_param_meta(module, n, sum_grad_over_tp=True)


def named_parameter_meta(model: nn.Module) -> list[tuple[str, nn.Parameter, ParamMeta]]:
    """``(name, parameter, record)`` for every distinct parameter of ``model`` (tied ones once,
    under their first name, as ``named_parameters`` gives them)."""
    return [(n, p, get_param_meta(model, n)) for n, p in model.named_parameters()]


def num_shards(sharding: Sharding | None, mesh: Mesh) -> int:
    """How many distinct pieces of a tensor laid out by ``sharding`` the tp group holds."""
    n = 1
    for axis, _ in sharding.splits if sharding else ():
        n *= mesh.group(axis).size
    return n


def gather_full(
    t: torch.Tensor, sharding: Sharding | None, mesh: Mesh | None = None
) -> torch.Tensor:
    """The unsharded tensor from this rank's piece ``t`` laid out by ``sharding`` (a
    parameter, its gradient or an optimizer state), on every rank. Collective over the split
    axes: every rank of the group must call it."""
    t = t.detach()
    if sharding is None:
        return t
    mesh = get_mesh(mesh)
    for i, (axis, dim) in enumerate(reversed(sharding.splits)):
        group = mesh.group(axis)
        t = comm.all_gather(t.contiguous(), group, dim)
        if sharding.segments and i == 0:
            t = join_shards(list(t.chunk(group.size, dim)), dim, sharding.segments)
    return trim_padding(t, sharding.full_shape)


def expert_split(sharding: Sharding | None) -> int | None:
    """The dim a parameter is split along over the expert-parallel (``ep``) group, or None."""
    for axis, dim in sharding.splits if sharding else ():
        if axis == "ep":
            return dim
    return None


def without_experts(sharding: Sharding | None) -> Sharding | None:
    """``sharding`` without its ``ep`` split: the layout of the tensor holding every expert
    (what checkpoints store, so they do not depend on the expert-parallel degree)."""
    if sharding is None or expert_split(sharding) is None:
        return sharding
    splits = tuple(s for s in sharding.splits if s[0] != "ep")
    return Sharding(splits, sharding.full_shape, sharding.segments) if splits else None


def experts_piece(t: torch.Tensor, sharding: Sharding | None, mesh: Mesh) -> torch.Tensor:
    """This rank's ``ep`` chunk of ``t``, a tensor holding every expert (laid out by
    :func:`without_experts`); ``t`` itself when ``sharding`` has no ``ep`` split."""
    dim = expert_split(sharding)
    if dim is None:
        return t
    g = mesh.group("ep")
    chunk = t.shape[dim] // g.size
    return t.narrow(dim, g.rank * chunk, chunk)


def gather_experts(t: torch.Tensor, sharding: Sharding | None, mesh: Mesh) -> torch.Tensor:
    """The tensor holding every expert from this rank's ``ep`` chunk ``t`` (collective over
    ``ep``; the inverse of :func:`experts_piece`); ``t`` when there is no ``ep`` split."""
    dim = expert_split(sharding)
    if dim is None:
        return t
    return comm.all_gather(t.detach().contiguous(), mesh.group("ep"), dim)


def join_shards(
    shards: list[torch.Tensor], dim: int, segments: tuple[int, ...] | list[int] | None = None
) -> torch.Tensor:
    """The tensor split along ``dim`` into ``shards`` (in rank order). For a packed projection
    each shard holds its chunk of every segment, so the chunks are put back segment by
    segment (all ranks' q, then all ranks' k, ...)."""
    if not segments:
        return torch.cat(shards, dim)
    n = len(shards)
    per_rank = [s // n for s in segments]
    pieces = [s.split(per_rank, dim) for s in shards]
    return torch.cat([pieces[r][i] for i in range(len(per_rank)) for r in range(n)], dim)


def trim_padding(t: torch.Tensor, full_shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """``t`` without the zero padding a dim the group does not divide was given
    (see :func:`shard_of`)."""
    for dim, size in enumerate(full_shape):
        if t.shape[dim] != size:
            t = t.narrow(dim, 0, size)
    return t


def gather_params(
    model: nn.Module, mesh: Mesh | None = None, grads: bool = False
) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient, when set) of ``model`` unsharded, by name, in
    neuron_tp's layout (HF models: :func:`neuron_tp.hf.saving.gather_hf_state_dict`)."""
    out = {}
    for name, p, meta in named_parameter_meta(model):
        t = p.grad if grads else p
        if t is not None:
            out[name] = gather_full(t, meta.sharding, mesh)
    return out


def shard_of(full: torch.Tensor, sharding: Sharding, mesh: Mesh) -> torch.Tensor:
    """This rank's piece of the unsharded tensor ``full`` (padding with zeros where needed)."""
    t = full
    if sharding.segments:  # outer splits first, then the innermost one piece by piece
        *outer, (axis, dim) = sharding.splits
        if outer:
            t = shard_of(t, Sharding(tuple(outer), sharding.full_shape), mesh)
        inner = Sharding(((axis, dim),), tuple(t.shape))
        return torch.cat(
            [shard_of(piece, inner, mesh) for piece in t.split(list(sharding.segments), dim)],
            dim,
        )
    for axis, dim in sharding.splits:
        g = mesh.group(axis)
        chunk = -(-t.shape[dim] // g.size)  # ceil: a dim the group does not divide is padded
        start = g.rank * chunk
        piece = t.narrow(dim, min(start, t.shape[dim]), max(0, min(chunk, t.shape[dim] - start)))
        if piece.shape[dim] < chunk:
            pad = list(piece.shape)
            pad[dim] = chunk - piece.shape[dim]
            piece = torch.cat([piece, piece.new_zeros(pad)], dim)
        t = piece
    return t


def move_to(model: nn.Module, device: torch.device | str) -> nn.Module:
    """``model.to(device)`` that keeps tied parameters tied (returns ``model``).

    Moving CPU -> XLA makes a new Parameter per module slot, so an embedding and an LM head
    that shared one Parameter would train as two copies. Records stay valid: they live on the
    modules, keyed by slot name."""
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                slots.setdefault(id(p), []).append((mod, name))
    model.to(device)
    for group in slots.values():
        if len(group) > 1:
            keep = group[0][0]._parameters[group[0][1]]
            for mod, name in group[1:]:
                mod._parameters[name] = keep
    return model
