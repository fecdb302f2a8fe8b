"""How a parameter is laid out over the mesh, recorded on the parameter itself.

Layers call :func:`mark_sharded`; gradient clipping, checkpointing and ``gather_full`` read the
record. A parameter without a record is replicated over the tensor-parallel group.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import comm
from .mesh import Mesh

_ATTR = "_ntp_sharding"
_SP_ATTR = "_ntp_sequence_parallel"


@dataclass(frozen=True)
class Sharding:
    """``splits``: (mesh axis, tensor dim) pairs, outermost first; ``full_shape``: the
    unsharded shape (smaller than shards x chunk when the dim was padded, e.g. a vocab).
    ``segments``: for a packed projection (fused QKV, gate_up), the sizes of the pieces of the
    split dim that are each split separately; a rank holds its chunk of every piece."""

    splits: tuple[tuple[str, int], ...]
    full_shape: tuple[int, ...]
    segments: tuple[int, ...] | None = None


def mark_sharded(param: torch.Tensor, splits: tuple[tuple[str, int], ...],
                 full_shape: tuple[int, ...], segments: tuple[int, ...] | None = None) -> None:
    setattr(param, _ATTR, Sharding(tuple(splits), tuple(full_shape),
                                   tuple(segments) if segments else None))


def set_sharding(param: torch.Tensor, sharding: Sharding | None) -> None:
    if sharding is not None:
        setattr(param, _ATTR, sharding)


def get_sharding(param: torch.Tensor) -> Sharding | None:
    return getattr(param, _ATTR, None)


def mark_sequence_parallel(param: torch.Tensor) -> None:
    """Tag a replicated parameter that is used on sequence shards: its gradient is partial on
    each tp rank and must be summed over tp (see :func:`neuron_tp.grads.sync_sequence_parallel_grads`)."""
    setattr(param, _SP_ATTR, True)


def is_sequence_parallel(param: torch.Tensor) -> bool:
    return getattr(param, _SP_ATTR, False)


def num_shards(param: torch.Tensor, mesh: Mesh) -> int:
    """How many distinct pieces of ``param`` the tp group holds (1 = replicated)."""
    sh = get_sharding(param)
    n = 1
    for axis, _ in (sh.splits if sh else ()):
        n *= mesh.group(axis).size
    return n


def gather_full(param: torch.Tensor, mesh: Mesh, sharding: Sharding | None = None) -> torch.Tensor:
    """The unsharded tensor, assembled on every rank (collective over the split axes).

    ``sharding`` defaults to the record on ``param``; pass it for tensors laid out like a
    parameter (its gradient, optimizer states)."""
    sh = sharding or get_sharding(param)
    t = param.detach()
    if sh is None:
        return t
    for axis, dim in reversed(sh.splits):
        group = mesh.group(axis)
        t = comm.all_gather(t.contiguous(), group, dim)
        if sh.segments:
            per_rank = [s // group.size for s in sh.segments]
            pieces = [c.split(per_rank, dim) for c in t.chunk(group.size, dim)]
            t = torch.cat([pieces[r][i] for i in range(len(per_rank))
                           for r in range(group.size)], dim)
    for dim, size in enumerate(sh.full_shape):
        if t.shape[dim] != size:
            t = t.narrow(dim, 0, size)
    return t


def shard_of(full: torch.Tensor, sharding: Sharding, mesh: Mesh) -> torch.Tensor:
    """This rank's piece of the unsharded tensor ``full`` (padding with zeros where needed)."""
    t = full
    if sharding.segments:
        (axis, dim), = sharding.splits
        unpacked = Sharding(sharding.splits, sharding.full_shape)
        return torch.cat([shard_of(piece, unpacked, mesh)
                          for piece in full.split(list(sharding.segments), dim)], dim)
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

