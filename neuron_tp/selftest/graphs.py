"""Graph-compile counters of this process, per rank (torch-xla's metrics are process-wide:
under ``--xla-cpu-devices`` every rank's thread compiles its own copy of each graph)."""

from __future__ import annotations

from .context import Context


def compile_counters(ctx: Context) -> tuple[float, float]:
    """(graphs compiled, seconds spent compiling) so far, per rank of this process (zeros off
    XLA). Read between two :meth:`Context.barrier` calls for a consistent count."""
    if not ctx.on_xla:
        return 0.0, 0.0
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    seconds = data[1] / 1e9 if data else 0.0
    graphs = met.counter_value("UncachedCompile") or 0
    return graphs / ctx.local_ranks, seconds / ctx.local_ranks


def measure(ctx: Context, key: str, since: tuple[float, float]) -> tuple[float, float]:
    """Record in ``ctx.measured[key]`` the graphs and compile seconds since ``since``; returns
    the counters now."""
    ctx.barrier(key)
    now = compile_counters(ctx)
    ctx.measured.setdefault("compiles", {})[key] = (now[0] - since[0], now[1] - since[1])
    ctx.barrier(key + "-read")
    return now
