"""Turning saved tensor-parallel shards back into full tensors and into the shards of a
(possibly different) layout, without collectives: everything is read from the files."""

from __future__ import annotations

import torch

from ..mesh import Mesh
from ..sharding import ParamMeta, Sharding, join_shards, shard_of, trim_padding


def sharding_record(meta: ParamMeta) -> dict | None:
    """JSON record of a parameter's tensor-parallel layout (None = replicated)."""
    sh = meta.sharding
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


def assemble(shards: list[torch.Tensor], record: dict | None) -> torch.Tensor:
    """The unsharded tensor from the tp group's shards (in tp-rank order), the offline
    equivalent of :func:`neuron_tp.sharding.gather_full` for 1D tensor parallelism."""
    if record is None:
        return shards[0]
    splits = [tuple(s) for s in record["splits"]]
    if len(splits) != 1 or splits[0][0] != "tp":
        raise ValueError(
            f"cannot reshard a tensor split over {splits}: only 1D tensor-parallel "
            "layouts (one split over 'tp') can be loaded at another tp degree"
        )
    t = join_shards(shards, splits[0][1], record.get("segments"))
    return trim_padding(t, record["full_shape"])


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

        return read_local(read, tuple(hf_full.shape), layout)
    sh = meta.sharding
    if sh is None:  # replicated, or a plain (unparallelized) model holding HF tensors
        return to_hf(full, hf)
    return shard_of(full, Sharding(sh.splits, sh.full_shape, sh.segments), mesh)
