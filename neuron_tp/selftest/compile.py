"""Check 4: compile behaviour of a short training run and of generation (the tiny Llama of the
model check) against what neuron_tp promises, compile time, and the Neuron compile cache.

Promises: a training step compiles its graphs once (no graph after the first step); greedy
generation compiles one prefill graph per (batch, length) bucket and one decode graph per
batch bucket, and a second call with the same shapes compiles nothing. On Neuron the compile
cache directory is counted before and after: a second selftest run adds no entry (cache hit).
"""

from __future__ import annotations

import os

from .context import Context
from .env import compile_cache
from .report import Check

GENERATION_GRAPHS = 2  # one prefill (batch 2, length bucket) + one decode (batch 2)


def cache_entries(path: str) -> int:
    """Compiled graphs (NEFF files) under the Neuron compile cache ``path``."""
    n = 0
    for _root, _dirs, files in os.walk(path):
        n += sum(1 for f in files if f.endswith(".neff"))
    return n


def check_compile(ctx: Context) -> Check:
    c = Check("compile")
    if not ctx.on_xla:
        c.summary = "n/a: gloo ranks run eagerly (no graphs)"
        return c
    cache = compile_cache() if ctx.on_neuron else ""
    before = cache_entries(cache) if cache else 0
    if "compiles" not in ctx.measured or "train step 0" not in ctx.measured["compiles"]:
        from .model import greedy, tiny_llama, train

        base = tiny_llama(ctx)
        train(ctx, base)
        greedy(ctx, base)
    m = ctx.measured["compiles"]
    steps = sorted(k for k in m if k.startswith("train step"))
    first, later = m[steps[0]], [m[k][0] for k in steps[1:]]
    gen1, gen2 = m["generate (first call)"], m["generate (second call)"]
    if any(later):
        c.fail(f"training compiled {later} graphs in steps 2..{len(steps)} (promise: 0)")
    if round(gen1[0]) != GENERATION_GRAPHS:
        c.fail(f"generation compiled {gen1[0]:g} graphs (promise: {GENERATION_GRAPHS})")
    if gen2[0]:
        c.fail(f"a second generation call compiled {gen2[0]:g} graphs (promise: 0)")
    new = cache_entries(cache) - before if cache else None
    c.numbers = {
        "train_first_step_graphs": first[0],
        "train_first_step_compile_s": first[1],
        "train_later_step_graphs": later,
        "generate_graphs": gen1[0],
        "generate_compile_s": gen1[1],
        "generate_again_graphs": gen2[0],
        "cache_dir": cache or None,
        "new_cache_entries": new,
    }
    cached = (
        "n/a (not on Neuron)"
        if new is None
        else f"{new} new entries in {cache}" + (" (cache hit)" if new == 0 else "")
    )
    c.summary = (
        f"train: {first[0]:g} graphs in step 1 ({first[1]:.1f} s compiling), then {sum(later):g}; "
        f"generate: {gen1[0]:g} graphs ({gen1[1]:.1f} s), again {gen2[0]:g}; cache: {cached}"
    )
    if not c.ok:
        c.hint = (
            "a graph that changes every step recompiles on Neuron (minutes each): a Python "
            "value that varies per step entered the graph; report it with --json"
        )
    return c
