"""This rank's slices of a LoRA pair on a sharded projection (training's peft wrappers,
:mod:`neuron_tp.hf.lora`, and serving's adapter bank, :mod:`neuron_tp.hf.lora_bank`): a
column-parallel base keeps ``lora_A`` whole and takes the base weight's rows of ``lora_B``; a
row-parallel base takes its input columns of ``lora_A`` and keeps ``lora_B`` whole."""

from __future__ import annotations

import torch

from ..layers import RowParallelLinear
from ..parallel.sharding import Sharding, shard_of
from .modules import HFColumnLinear
from .slice_map import HFSliceMap, get_slice_map, read_local


def hf_out_rows(base: HFColumnLinear) -> int:
    """Rows of the HF weight a column-parallel ``base`` was sharded from (each replicated kv
    row once)."""
    keep = get_slice_map(base, "weight").keep_rows
    return len(keep) if keep is not None else int(base.out_features)


def column_lora_rows(base: HFColumnLinear, b_full: torch.Tensor) -> torch.Tensor:
    """This rank's rows of the full ``lora_B`` ``[out, r]`` of column-parallel ``base`` (the
    rows its weight holds: packed parts, replicated kv heads, padding)."""
    pieces = get_slice_map(base, "weight").pieces

    def read(dim, a, b):
        return b_full if dim is None else b_full.narrow(dim, a, b - a)

    return read_local(read, tuple(b_full.shape), HFSliceMap(0, pieces))


def row_lora_columns(base: RowParallelLinear, a_full: torch.Tensor) -> torch.Tensor:
    """This rank's input columns of the full ``lora_A`` ``[r, in]`` of row-parallel ``base``."""
    return shard_of(a_full, Sharding((("tp", 1),), tuple(a_full.shape)), base.mesh)
