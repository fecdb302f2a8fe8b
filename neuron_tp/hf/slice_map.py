"""How an HF-parallelized parameter relates to its tensor in a HuggingFace checkpoint: which
slices of the stored tensor this rank holds (loading) and how the gathered parameter maps back
to it (saving). Recorded with the parameter's other metadata on its owning module
(:mod:`neuron_tp.parallel.sharding`), so moving or reloading the model keeps it.

Not to be confused with a parameter's :class:`neuron_tp.parallel.sharding.Sharding` (how it is split
over the mesh) or with activation layouts (:mod:`neuron_tp.layers.activation_layout`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..parallel.sharding import get_param_meta, set_param_meta


@dataclass(frozen=True)
class HFSliceMap:
    """``pieces``: this rank's ``(start, stop)`` ranges along ``dim`` of the stored HF tensor,
    concatenated in order (``stop`` past the end = zero padding; ``dim`` None = the whole
    tensor); ``transpose``: the stored tensor is ``[in, out]`` (GPT-2's Conv1D); ``keep_rows``:
    rows of the gathered parameter that form the HF tensor (replicated kv heads appear once per
    copy), or None. Packed projections (fused qkv, gate_up) hold one piece per packed part."""

    dim: int | None
    pieces: tuple[tuple[int, int], ...] = ()
    transpose: bool = False
    keep_rows: tuple[int, ...] | None = None


WHOLE = HFSliceMap(None)  # a parameter that is the whole stored tensor (replicated)


def set_slice_map(module: nn.Module, name: str, slice_map: HFSliceMap) -> None:
    """Record how ``module.<name>`` maps to its HF checkpoint tensor."""
    set_param_meta(module, name, hf_layout=slice_map)


def get_slice_map(module: nn.Module, name: str) -> HFSliceMap:
    """How ``module.<name>`` maps to its HF checkpoint tensor (:data:`WHOLE` if unrecorded)."""
    return get_param_meta(module, name).hf_layout or WHOLE


def even_pieces(size: int, rank: int, tp: int, offset: int = 0) -> list[tuple[int, int]]:
    """This rank's contiguous chunk of ``size`` rows (ceil-sized; the last may be padded)."""
    chunk = -(-size // tp)
    return [(offset + rank * chunk, offset + (rank + 1) * chunk)]


def read_local(get_slice, shape: tuple[int, ...], slice_map: HFSliceMap) -> torch.Tensor:
    """This rank's tensor from a stored one; ``get_slice(dim, start, stop)`` reads a range."""
    if slice_map.dim is None:
        t = get_slice(None, 0, 0)
    else:
        dim = slice_map.dim
        size, parts = shape[dim], []
        for start, stop in slice_map.pieces:
            real = get_slice(dim, min(start, size), min(stop, size))
            if stop > size:
                pad = list(real.shape)
                pad[dim] = stop - max(start, size)
                real = torch.cat([real, real.new_zeros(pad)], dim)
            parts.append(real)
        t = torch.cat(parts, dim) if len(parts) > 1 else parts[0]
    return t.t() if slice_map.transpose else t


def to_hf(gathered: torch.Tensor, slice_map: HFSliceMap) -> torch.Tensor:
    """The HF tensor from a gathered (unsharded, our-layout) parameter."""
    t = gathered
    if slice_map.keep_rows is not None:
        t = t.index_select(0, torch.tensor(slice_map.keep_rows, dtype=torch.long, device=t.device))
    return t.t().contiguous() if slice_map.transpose else t.contiguous()
