"""MoE expert tensors as checkpoints store them: transformers 5 keeps each layer's experts fused
(``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) but checkpoints on the
Hub, and those transformers 5 itself writes, hold one tensor per expert:
``mlp.experts.{e}.gate_proj / up_proj / down_proj.weight`` (Qwen-MoE, OLMoE, DeepSeek-style) or
``block_sparse_moe.experts.{e}.w1 / w3 / w2.weight`` (Mixtral, w1 = gate, w3 = up, w2 = down).
:func:`read_per_expert` reads this rank's slices of a fused parameter from such files: per
expert only its rows of gate and up and its columns of down, stacked over experts."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .slice_map import HFSliceMap

# (the block's name in the files, or None = as in the model; gate, up, down names)
LAYOUTS = ((None, "gate_proj", "up_proj", "down_proj"), ("block_sparse_moe", "w1", "w3", "w2"))

Reader = Callable[[str, int, int, int], torch.Tensor]  # (name, dim, start, stop) -> slice


def _experts_base(prefix: str, rename: str | None) -> str:
    if rename is None:
        return prefix
    block, _, _ = prefix.rpartition(".")  # "model.layers.0.mlp"
    return f"{block.rpartition('.')[0]}.{rename}.experts"


def stored_name(name: str, files: dict) -> str:
    """``name`` as the checkpoint stores it: itself, or with the MoE block under its legacy
    name (Mixtral's ``block_sparse_moe`` for the model's ``mlp``) when only that exists."""
    if name in files:
        return name
    for rename, *_ in LAYOUTS:
        if rename is not None and ".mlp." in name:
            legacy = name.replace(".mlp.", f".{rename}.", 1)
            if legacy in files:
                return legacy
    return name


def per_expert_layout(name: str, files: dict) -> tuple[str, str, str, str, int] | None:
    """``(experts base name, gate, up, down, number of experts)`` when the fused parameter
    ``name`` (``...experts.gate_up_proj`` / ``...experts.down_proj``) is stored per expert
    in ``files`` (tensor name -> file); None otherwise."""
    prefix, _, kind = name.rpartition(".")
    if kind not in ("gate_up_proj", "down_proj") or not prefix.endswith(".experts"):
        return None
    for rename, gate, up, down in LAYOUTS:
        base = _experts_base(prefix, rename)
        n = 0
        while f"{base}.{n}.{down}.weight" in files:
            n += 1
        if n:
            return base, gate, up, down, n
    return None


def read_per_expert(
    name: str,
    files: dict,
    read: Reader,
    shape_of: Callable[[str], tuple],
    slice_map: HFSliceMap,
    experts: tuple[int, int] | None = None,
) -> torch.Tensor | None:
    """This rank's slice of the fused expert parameter ``name`` read from per-expert tensors
    (``read(tensor, dim, start, stop)`` reads a range, ``shape_of(tensor)`` its stored shape),
    laid out by ``slice_map`` (dim 1 pieces of gate_up: gate rows below I, up rows from I;
    dim 2 pieces of down), for the ``experts`` range (expert parallelism; None: all); None when
    ``files`` do not hold ``name`` per expert."""
    layout = per_expert_layout(name, files)
    if layout is None:
        return None
    base, gate, up, down, n = layout
    out = []
    for e in range(*(experts or (0, n))):
        if name.endswith("gate_up_proj"):
            inter = shape_of(f"{base}.{e}.{gate}.weight")[0]
            parts = [
                read(f"{base}.{e}.{gate}.weight", 0, a, b)
                if b <= inter
                else read(f"{base}.{e}.{up}.weight", 0, a - inter, b - inter)
                for a, b in slice_map.pieces
            ]
            out.append(torch.cat(parts, 0))
        else:
            parts = [read(f"{base}.{e}.{down}.weight", 1, a, b) for a, b in slice_map.pieces]
            out.append(torch.cat(parts, 1))
    return torch.stack(out)
