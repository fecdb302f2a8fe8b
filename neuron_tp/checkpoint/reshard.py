"""Turning saved tensor-parallel shards back into full tensors and into the shards of a
(possibly different) layout, without collectives: everything is read from the files."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..parallel.mesh import Mesh
from ..parallel.sharding import (
    ParamMeta,
    Sharding,
    experts_piece,
    join_shards,
    shard_of,
    trim_padding,
    without_experts,
)


def sharding_record(meta: ParamMeta) -> dict | None:
    """JSON record of a parameter's tensor-parallel layout (None = replicated). An expert-
    parallel parameter is saved with every expert (:func:`~.writer.save` gathers it over
    ``ep``), so its record is the layout without the ``ep`` split."""
    sh = without_experts(meta.sharding)
    rec = None
    if sh is not None:
        rec = {
            "splits": [list(s) for s in sh.splits],
            "full_shape": list(sh.full_shape),
            "segments": list(sh.segments) if sh.segments else None,
        }
    return rec


def hf_record(meta: ParamMeta) -> dict | None:
    """JSON record of how the gathered parameter maps to the HF tensor (rank-independent)."""
    lay = meta.hf_layout
    if lay is None:
        return None
    return {
        "transpose": lay.transpose,
        "keep_rows": list(lay.keep_rows) if lay.keep_rows is not None else None,
    }


def full_shape(p: torch.Tensor, meta: ParamMeta) -> tuple[int, ...]:
    sh = meta.sharding
    return tuple(sh.full_shape) if sh is not None else tuple(p.shape)


def logical_shape(p: torch.Tensor, meta: ParamMeta) -> tuple[int, ...]:
    """The shape of the unsharded tensor as a model without tensor parallelism holds it (the
    HF tensor for HF-parallelized parameters): comparable across tp degrees."""
    shape = list(full_shape(p, meta))
    rec = hf_record(meta)
    if rec is not None:
        if rec["keep_rows"] is not None:
            shape[0] = len(rec["keep_rows"])
        if rec["transpose"]:
            shape = shape[::-1]
    return tuple(shape)


def _tp_groups(tp: int, tp_mode: str, axis: str) -> tuple[tuple[int, ...], ...]:
    """Every group of mesh axis ``axis`` of a tensor-parallel group of ``tp`` ranks laid out as
    ``tp_mode``, as tp-rank lists in group order (the saved layout: dp 1, world = tp)."""
    return Mesh(tp, 0, tp=tp, tp_mode=tp_mode).group(axis).all_groups


def _members(axis_groups: tuple[tuple[int, ...], ...], ranks: set[int]) -> set[int]:
    """Every member of the groups that hold one of ``ranks``."""
    return {r for g in axis_groups if set(g) & ranks for r in g}


def assemble(
    shards: list[torch.Tensor] | Callable[[int], torch.Tensor],
    record: dict | None,
    tp: int | None = None,
    tp_mode: str = "1d",
) -> torch.Tensor:
    """The unsharded tensor from the saved tp ranks' pieces, offline: the equivalent of
    :func:`neuron_tp.parallel.sharding.gather_full` for the layout the checkpoint was saved in.

    ``shards``: every saved tp rank's piece in tp-rank order, or ``get(tp_rank)`` returning
    it (then only the ranks needed are read: a piece replicated over an axis is read once);
    ``tp``/``tp_mode``: the saved mesh (default ``len(shards)``, 1D). The splits are undone in
    gather_full's order (innermost first): within each group of the split's mesh axis the
    members' pieces are joined in group order along the split dim, and the members then share
    that one tensor, so at most about one full tensor (plus the pieces) is held.
    """
    get = shards if callable(shards) else shards.__getitem__
    if record is None:
        return get(0)
    if tp is None:
        if callable(shards):
            raise ValueError("assemble: pass the saved tp degree with a shard reader")
        tp = len(shards)
    splits = [(str(a), int(d)) for a, d in record["splits"]]
    segments = record.get("segments")
    if len(splits) == 1 and splits[0][0] == "tp":  # 1D: one group, every rank in order
        t = join_shards([get(r) for r in range(tp)], splits[0][1], segments)
        return trim_padding(t, record["full_shape"])
    try:
        groups = {axis: _tp_groups(tp, tp_mode, axis) for axis, _ in splits}
    except ValueError as e:
        raise ValueError(
            f"cannot assemble a tensor split over {splits} at tp={tp} tp_mode={tp_mode!r}: {e}"
        ) from None
    # after[k]: the ranks whose tensors are still needed once split k is undone (splits are
    # undone innermost first, so split 0 last and rank 0 then holds the full tensor).
    after = [{0}]
    for axis, _ in splits[:-1]:
        after.append(_members(groups[axis], after[-1]))
    held = {r: get(r) for r in sorted(_members(groups[splits[-1][0]], after[-1]))}
    for k in range(len(splits) - 1, -1, -1):
        axis, dim = splits[k]
        for g in groups[axis]:
            if set(g) & after[k]:
                joined = join_shards([held[r] for r in g], dim, segments)
                for r in g:
                    held[r] = joined
        held = {r: t for r, t in held.items() if r in after[k]}
    return trim_padding(held[0], record["full_shape"])


def to_hf(full: torch.Tensor, hf: dict | None) -> torch.Tensor:
    """The HF-named tensor from an assembled one (drops replicated kv rows, un-transposes)."""
    if hf is None:
        return full
    from ..hf.slice_map import HFSliceMap
    from ..hf.slice_map import to_hf as _to_hf

    keep = tuple(hf["keep_rows"]) if hf["keep_rows"] is not None else None
    return _to_hf(full, HFSliceMap(0, (), hf["transpose"], keep))


def local_piece(full: torch.Tensor, hf: dict | None, meta: ParamMeta, mesh: Mesh) -> torch.Tensor:
    """This rank's piece, for a parameter of the current model recorded as ``meta``, of the
    saved tensor ``full`` (assembled; ``hf`` its HF record or None)."""
    layout = meta.hf_layout
    if layout is not None:  # an HF-parallelized parameter: slice the HF tensor like loading
        from ..hf.slice_map import read_local

        hf_full = to_hf(full, hf)

        def read(dim, start, stop):
            return hf_full if dim is None else hf_full.narrow(dim, start, stop - start)

        return experts_piece(read_local(read, tuple(hf_full.shape), layout), meta.sharding, mesh)
    sh = meta.sharding
    if sh is None:  # replicated, or a plain (unparallelized) model holding HF tensors
        return to_hf(full, hf)
    # A layout without an HF slice map shards the HF tensor itself (2D/3D layers of an HF
    # model, or a model that is not an HF one): a tensor saved by an HF-parallelized 1D model
    # (replicated kv rows, transposed) is turned back into the HF tensor first.
    full = to_hf(full, hf)
    return shard_of(full, Sharding(sh.splits, sh.full_shape, sh.segments), mesh)
