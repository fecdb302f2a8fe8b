"""Check 2b: bus bandwidth per message size and latency of small messages, nccl-tests style.

For a message of ``S`` bytes taking ``t`` seconds: algbw = S / t; busbw = algbw x 2(n-1)/n
for all_reduce, x (n-1)/n for all_gather (``S`` = its output) and reduce_scatter (``S`` = its
input): the bytes each rank's link carries, comparable across group sizes and with the link's
figure (``neuron_tp.plan.hardware``). On XLA, ``REPEAT`` collectives run in one graph (the
graph launch counts once, not per op); fp32 messages.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..parallel.mesh import Group
from ..plan.hardware import Instance
from .collectives import run_op
from .context import Context, describe_group
from .report import Check

KiB, MiB = 2**10, 2**20
REPEAT = 5
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n}
BUS_FACTOR["reduce_scatter"] = BUS_FACTOR["all_gather"]


def sizes(max_bytes: int, step: int = 4) -> list[int]:
    """Message sizes: 1 KiB, then x ``step`` up to ``max_bytes``."""
    out, s = [], KiB
    while s <= max_bytes:
        out.append(s)
        s *= step
    return out


def max_message(ctx: Context) -> int:
    """The largest message: 256 MiB on Neuron (4 MiB with --quick); off Neuron (gloo, XLA CPU
    devices: threads sharing a few cores) 1 MiB, 256 KiB with --quick."""
    if ctx.options.max_bytes:
        return ctx.options.max_bytes
    if ctx.on_neuron:
        return 4 * MiB if ctx.options.quick else 256 * MiB
    return 256 * KiB if ctx.options.quick else 1 * MiB


def theory(ctx: Context, group: Group, instance: Instance | None) -> float | None:
    """The busbw the planner assumes for ``group`` (bytes/s): NeuronLink inside a node; across
    nodes the node's EFA shared by the groups leaving it (as ``plan.predict`` models it)."""
    if instance is None:
        return None
    link = instance.link_bandwidth_per_core
    if ctx.nodes(group) == 1:
        return link
    here = sum(1 for r in group.ranks if r // ctx.ranks_per_node == ctx.rank // ctx.ranks_per_node)
    return min(link, instance.network_bandwidth * here / ctx.ranks_per_node)


def time_op(ctx: Context, op: str, group: Group, nbytes: int) -> float:
    """Seconds per ``op`` of an ``nbytes`` message on ``group`` (best of 2 timed runs)."""
    n = group.size
    numel = max(n, (nbytes // 4) // n * n)
    if op == "all_gather":
        numel //= n
    x = torch.zeros(numel, device=ctx.device)
    best = float("inf")
    for attempt in range(3):  # the first run compiles (XLA)
        start = time.perf_counter()
        outs = [run_op(op, x, group, 0) for _ in range(REPEAT)]
        ctx.sync()
        if not ctx.on_xla and outs:
            outs[-1].sum()  # gloo collectives are synchronous already
        took = (time.perf_counter() - start) / REPEAT
        if attempt:
            best = min(best, took)
    return best


def check_bandwidth(ctx: Context, instance: Instance | None) -> Check:
    """busbw per (op, group) and message size; latency at 1 KiB."""
    c = Check("bandwidth")
    top = max_message(ctx)
    msgs = sizes(top, 16 if ctx.options.quick else 4)
    ops = ("all_reduce",) if ctx.options.quick else ("all_reduce", "all_gather", "reduce_scatter")
    head = f"{'op':<15}{'group':<14}{'lat us':>8}" + "".join(f"{_size(s):>8}" for s in msgs)
    c.table = ["busbw GB/s by message size (algbw x bus factor, as nccl-tests), fp32", head]
    if instance is not None:
        c.table[-1] += f"{'theory':>8}"
    rows: list[dict[str, Any]] = []
    for group in ctx.groups():
        if group.size == 1:
            continue
        for op in ops:
            busbw, lat = [], 0.0
            for s in msgs:
                with ctx.watchdog.doing(
                    f"{op} on the {describe_group(group)}, fp32, {_size(s)} (bandwidth)",
                    ctx.stage_limit,
                ):
                    t = time_op(ctx, op, group, s)
                lat = lat or t
                busbw.append(s / t * BUS_FACTOR[op](group.size))
            th = theory(ctx, group, instance)
            line = f"{op:<15}{group.name + f'({group.size})':<14}{lat * 1e6:>8.0f}"
            line += "".join(f"{b / 1e9:>8.2f}" for b in busbw)
            line += f"{th / 1e9:>8.1f}" if th else ""
            c.table.append(line)
            rows.append(
                {
                    "op": op,
                    "group": group.name,
                    "size": group.size,
                    "nodes": ctx.nodes(group),
                    "bytes": msgs,
                    "busbw": busbw,
                    "latency_s": lat,
                    "theory_busbw": th,
                }
            )
    c.numbers = {"rows": rows}
    best = max((max(r["busbw"]) for r in rows), default=0.0)
    c.summary = f"up to {_size(top)}: best busbw {best / 1e9:.2f} GB/s" + (
        "" if instance else " (no --instance: no theoretical column)"
    )
    return c


def _size(n: int) -> str:
    return f"{n // MiB}M" if n >= MiB else f"{n // KiB}K"
