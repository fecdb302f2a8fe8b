"""Check 5: achieved bf16 matmul throughput per NeuronCore for transformer-sized GEMMs."""

from __future__ import annotations

import time

import torch

from ..plan.hardware import Instance
from .context import Context
from .report import Check

CHAIN = 8  # matmuls per graph: x = x @ w, one after another (no common subexpression)


def gemm_sizes(ctx: Context) -> list[tuple[int, int]]:
    """(tokens, hidden) of ``[tokens, hidden] @ [hidden, hidden]`` GEMMs: Llama-7B-like on
    Neuron, tiny elsewhere (the CPU is not what is measured)."""
    if ctx.on_neuron:
        return [(2048, 4096)] if ctx.options.quick else [(2048, 4096), (4096, 8192)]
    return [(64, 64)] if ctx.options.quick else [(64, 64), (128, 256)]


def achieved(ctx: Context, tokens: int, hidden: int) -> float:
    """FLOP/s of a chain of ``CHAIN`` bf16 matmuls (best of 2 timed runs after a warm-up)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, hidden, generator=g) * 0.1).to(torch.bfloat16).to(ctx.device)
    w = (torch.randn(hidden, hidden, generator=g) / hidden**0.5).to(torch.bfloat16)
    w = w.to(ctx.device)
    best = float("inf")
    for attempt in range(3):
        start = time.perf_counter()
        y = x
        for _ in range(CHAIN):
            y = y @ w
        ctx.sync()
        if not ctx.on_xla:
            float(y[0, 0])
        if attempt:
            best = min(best, time.perf_counter() - start)
    return 2 * tokens * hidden * hidden * CHAIN / best


def check_compute(ctx: Context, instance: Instance | None) -> Check:
    """Achieved TFLOP/s per GEMM size, next to the instance's peak per core."""
    c = Check("compute")
    rows = []
    for tokens, hidden in gemm_sizes(ctx):
        with ctx.watchdog.doing(f"bf16 matmul [{tokens}, {hidden}] x [{hidden}, {hidden}]"):
            rows.append(
                {"tokens": tokens, "hidden": hidden, "flops": achieved(ctx, tokens, hidden)}
            )
    best = max(r["flops"] for r in rows)
    peak = instance.peak_flops_per_core if instance else None
    c.numbers = {"rows": rows, "best_flops": best, "peak_flops": peak}
    c.table = [
        f"[{r['tokens']}, {r['hidden']}] @ [{r['hidden']}, {r['hidden']}]: "
        f"{r['flops'] / 1e12:.3f} TFLOP/s" + (f" ({r['flops'] / peak:.0%} of peak)" if peak else "")
        for r in rows
    ]
    c.summary = f"bf16 matmul: best {best / 1e12:.3f} TFLOP/s per core" + (
        f" of {peak / 1e12:.0f} peak ({best / peak:.0%})" if peak else " (no --instance: no peak)"
    )
    return c
