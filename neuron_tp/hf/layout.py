"""Where each rank's parameter comes from in the unsharded HF tensor (loading) and how the
gathered parameter maps back to it (saving). Recorded with the parameter's other metadata on
its owning module (:mod:`neuron_tp.sharding`), so moving or reloading the model keeps it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..sharding import get_param_meta, set_param_meta


@dataclass(frozen=True)
class HFLayout:
    """``pieces``: this rank's ``(start, stop)`` ranges along ``dim`` of the stored HF tensor,
    concatenated in order (``stop`` past the end = zero padding); ``transpose``: the stored
    tensor is ``[in, out]`` (GPT-2's Conv1D); ``keep_rows``: rows of the gathered parameter
    that form the HF tensor (replicated kv heads appear once per copy), or None."""

    dim: int | None
    pieces: tuple[tuple[int, int], ...] = ()
    transpose: bool = False
    keep_rows: tuple[int, ...] | None = None


def set_layout(module: nn.Module, name: str, layout: HFLayout) -> None:
    set_param_meta(module, name, hf_layout=layout)


def get_layout(module: nn.Module, name: str) -> HFLayout:
    return get_param_meta(module, name).hf_layout or HFLayout(None)


def even_pieces(size: int, rank: int, tp: int, offset: int = 0) -> list[tuple[int, int]]:
    """This rank's contiguous chunk of ``size`` rows (ceil-sized; the last may be padded)."""
    chunk = -(-size // tp)
    return [(offset + rank * chunk, offset + (rank + 1) * chunk)]


def head_pieces(heads: list[int], head_dim: int, offset: int = 0) -> list[tuple[int, int]]:
    return [(offset + h * head_dim, offset + (h + 1) * head_dim) for h in heads]


def read_local(get_slice, shape: tuple[int, ...], layout: HFLayout) -> torch.Tensor:
    """This rank's tensor from a stored one; ``get_slice(dim, start, stop)`` reads a range."""
    if layout.dim is None:
        t = get_slice(None, 0, 0)
    else:
        size, parts = shape[layout.dim], []
        for start, stop in layout.pieces:
            real = get_slice(layout.dim, min(start, size), min(stop, size))
            if stop > size:
                pad = list(real.shape)
                pad[layout.dim] = stop - max(start, size)
                real = torch.cat([real, real.new_zeros(pad)], layout.dim)
            parts.append(real)
        t = torch.cat(parts, layout.dim) if len(parts) > 1 else parts[0]
    return t.t() if layout.transpose else t


def to_hf(gathered: torch.Tensor, layout: HFLayout) -> torch.Tensor:
    """The HF tensor from a gathered (unsharded, our-layout) parameter."""
    t = gathered
    if layout.keep_rows is not None:
        t = t.index_select(0, torch.tensor(layout.keep_rows, dtype=torch.long, device=t.device))
    return t.t().contiguous() if layout.transpose else t.contiguous()
