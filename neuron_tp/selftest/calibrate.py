"""``--calibrate PATH``: the selftest's measurements as the planner's calibration file
(:mod:`neuron_tp.plan.calibration` reads it)."""

from __future__ import annotations

import json
import os

from ..plan.calibration import FORMAT
from .context import Context
from .report import Check


def figures(results: list[Check], ctx: Context) -> dict:
    """The calibration's figures from the bandwidth and compute checks (None: not measured):
    the tp all-reduce's busbw inside a node at its largest message (NeuronLink per core), the
    same across nodes turned into bytes/s per node as the planner models EFA, the small
    all-reduce's latency, and the best bf16 matmul rate."""
    by_name = {c.name: c for c in results}
    out: dict = {
        "link_bandwidth_per_core": None,
        "network_bandwidth_per_node": None,
        "collective_latency_s": None,
        "bf16_flops_per_core": None,
    }
    bw = by_name.get("bandwidth")
    if bw is not None and bw.ok:
        rows = [r for r in bw.numbers["rows"] if r["op"] == "all_reduce"]
        inside = [r for r in rows if r["nodes"] == 1]
        across = [r for r in rows if r["nodes"] > 1]
        if inside:
            best = max(inside, key=lambda r: r["busbw"][-1])
            out["link_bandwidth_per_core"] = best["busbw"][-1]
            out["collective_latency_s"] = min(r["latency_s"] for r in inside)
        if across:
            # one rank per node in the group (dp across nodes): the node's EFA is shared by
            # ranks_per_node such groups, as plan.predict models it
            per_node = [
                r["busbw"][-1] * ctx.ranks_per_node * r["nodes"] / r["size"] for r in across
            ]
            out["network_bandwidth_per_node"] = max(per_node)
    comp = by_name.get("compute")
    if comp is not None and comp.ok:
        out["bf16_flops_per_core"] = comp.numbers["best_flops"]
    return out


def write_calibration(path: str, results: list[Check], ctx: Context) -> str:
    """Write the calibration JSON to ``path``; returns the path."""
    facts = ctx.facts
    data = {
        "format": FORMAT,
        "measured_on": f"{facts.get('device', '?')} x {ctx.world} ({ctx.ranks_per_node}/node)",
        **figures(results, ctx),
        "instance": ctx.options.instance or None,
        "facts": facts,
        "bandwidth": next((c.numbers for c in results if c.name == "bandwidth"), None),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(data, fh, indent=1, default=str)
    return path
