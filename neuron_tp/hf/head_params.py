"""Per-head parameters that a plan splits with their attention's heads: a bare ``nn.Parameter``
of an attention module with one entry per query head (GPT-OSS-style attention sinks, planned
by transformers as ``layers.*.self_attn.sinks: colwise`` next to ``layers.*.self_attn:
local_params``). Each rank keeps the entries of its query heads; ``local_params`` (run the
module with its own parameters as local tensors) is what every sharded module of neuron_tp
does already, so it needs no module of its own."""

from __future__ import annotations

import re

import torch
from torch import nn

from ..parallel.mesh import Mesh
from ..parallel.sharding import Sharding, set_param_meta
from .attention import Heads
from .slice_map import HFSliceMap

# transformers' style for a module whose own parameters (the entries below) are split.
LOCAL_PARAMS = "local_params"


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + r"[^.]+".join(re.escape(p) for p in pattern.split("*")) + "$")


def split_param_entries(
    model: nn.Module, plan: dict[str, str]
) -> tuple[dict[str, str], tuple[str, ...]]:
    """``plan`` without ``local_params`` entries and without ``colwise`` entries that name a
    parameter rather than a module; and the full names of those parameters."""
    modules = {n for n, _ in model.named_modules()}
    params = [n for n, _ in model.named_parameters() if n not in modules]
    rest: dict[str, str] = {}
    found: list[str] = []
    for pattern, style in plan.items():
        if style == LOCAL_PARAMS:
            continue
        rx = _compile(pattern)
        hits = [n for n in params if rx.match(n)]
        if style == "colwise" and hits and not any(rx.match(m) for m in modules):
            found += hits
        else:
            rest[pattern] = style
    return rest, tuple(found)


def check_head_params(
    model: nn.Module, names: tuple[str, ...], attention: frozenset[str], heads: Heads | None
) -> None:
    """ValueError unless every name is a 1-D parameter of an attention module with one entry per
    query head (before anything is changed)."""
    for name in names:
        owner = name.rpartition(".")[0]
        p = model.get_parameter(name)
        if owner not in attention or heads is None or tuple(p.shape) != (heads.q,):
            have = "no head counts" if heads is None else f"{heads.q} query heads"
            raise ValueError(
                f"{name}: the plan splits this parameter {tuple(p.shape)} per head, but it is "
                f"not a per-query-head vector of an attention module ({have}); fix the plan"
            )


def shard_head_params(model: nn.Module, names: tuple[str, ...], mesh: Mesh, heads: Heads) -> None:
    """Keep this rank's query heads' entries of each parameter (rank r: heads
    ``[r * q/tp, (r+1) * q/tp)``), recorded as split over tp like a column projection's rows."""
    local = heads.q // mesh.tp_size
    start = mesh.tp_rank * local
    for name in names:
        owner_name, _, pname = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        p = owner.get_parameter(pname)
        with torch.no_grad():
            mine = nn.Parameter(p[start : start + local].clone(), requires_grad=p.requires_grad)
        setattr(owner, pname, mine)
        set_param_meta(
            owner,
            pname,
            sharding=Sharding((("tp", 0),), (heads.q,)),
            hf_layout=HFSliceMap(0, ((start, start + local),)),
        )
