"""Speculative decoding vs plain decoding on the XLA CPU device, replayed graphs both.

A random tiny Llama target (hidden 64, ``--layers`` 8; the residual branches of its layers past
the first scaled by ``--damp`` 0.07, so that, as in a trained model, its first layer decides
much of the prediction) and drafts made of its first layer (and
2 layers: ``--two-layers``) + its head (no training: they agree with the target only as far
as its first layers decide), and the target itself as its own draft (every proposal
accepted: the upper bound of K + 1 tokens per target step), and n-gram prompt lookup (no
draft: ``NgramGenerator``, ``--prompt-lookup-max`` 4 / min 1; it pays where outputs repeat,
as a random model's greedy loops do). Per number of running slots
(1, 4, 8): greedy requests, each decoding ``--tokens`` tokens; tokens per target step (per
slot) and wall ms per token of one request (wall time / tokens per slot, best of 3), plain
SlotGenerator vs SpeculativeGenerator, after an untimed run of each size captured its graphs
(no compile is timed).

Usage: ``PJRT_DEVICE=CPU python benchmarks/speculative.py [--layers 8] [--k 4]
[--active 1,4,8] [--tokens 48] [--two-layers] [--optimized]``; unoptimised XLA:CPU compiles
unless ``--optimized`` (both paths alike).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
if "--optimized" not in sys.argv:  # unoptimised LLVM: compiles ~40% cheaper (as the tests)
    os.environ.setdefault(
        "XLA_FLAGS",
        "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    )
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_latency import tiny_llama  # noqa: E402


def first_layers(full, n: int):
    """``full`` with its first ``n`` decoder layers only (embeddings, final norm, head kept)."""
    draft = copy.deepcopy(full)
    draft.model.layers = draft.model.layers[:n]
    draft.config.num_hidden_layers = n
    return draft.eval()


def damped(model, factor: float):
    """``model`` with the residual branches (attention and MLP outputs) of every layer past
    the first scaled by ``factor``: a random model whose first layer decides most of the
    prediction, as in a trained one, so a 1-layer draft agrees often but not always."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(factor)
            layer.mlp.down_proj.weight.mul_(factor)
    return model


def run(gen, n: int, tokens: int) -> dict:
    """``n`` slots prefilled with short prompts, then decode steps until each has ``tokens``
    new tokens; the wall ms per token of one slot and the steps taken."""
    for s in list(gen.in_use):
        gen.release(s)
    got = {}
    for i in range(n):
        slot = gen.acquire()
        gen.prefill(slot, [(7 * i + j) % 250 + 1 for j in range(5 + i % 4)], 0, _greedy())
        got[slot] = 1
    steps, t0 = 0, time.perf_counter()
    while min(got.values()) < tokens:
        for slot, new in gen.decode().items():
            got[slot] += len(new)
        steps += 1
    wall = (time.perf_counter() - t0) * 1e3
    per_slot = sum(got.values()) / n - 1
    return {"ms_per_token": wall / per_slot, "per_step": per_slot / steps}


def _greedy():
    from neuron_tp.infer.sampling import Sampling

    return Sampling()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--active", default="1,4,8")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument(
        "--damp", type=float, default=0.07, help="residual scale of the target's layers 2.."
    )
    p.add_argument("--optimized", action="store_true", help="optimised XLA:CPU compiles")
    p.add_argument("--two-layers", action="store_true", help="also a draft of 2 layers")
    args = p.parse_args()
    import neuron_tp as ntp
    from neuron_tp.infer.ngram import NgramGenerator
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.infer.speculative import SpeculativeGenerator

    sizes = sorted(map(int, args.active.split(",")))
    dev = ntp.xla_device()
    full = damped(tiny_llama(args.layers), args.damp)
    target = copy.deepcopy(full).to(dev)
    # a slot may run ahead of the slowest one by K + 1 tokens a step: room for that
    shape = dict(max_len=(args.k + 1) * args.tokens + 16, chunk=16, decode_buckets=sizes)
    gens = {"plain": SlotGenerator(target, max(sizes), **shape)}
    for name, draft in (
        ("draft 1 layer", first_layers(full, 1).to(dev)),
        *([("draft 2 layers", first_layers(full, 2).to(dev))] if args.two_layers else []),
        ("self-draft (bound)", target),
    ):
        gens[name] = SpeculativeGenerator(target, draft, max(sizes), k=args.k, **shape)
    gens["ngram (no draft)"] = NgramGenerator(target, max(sizes), k=args.k, **shape)
    print(f"target L={args.layers}, K={args.k}, greedy, {args.tokens} tokens per request")
    print(f"{'slots':>5} {'path':<20} {'tokens/target step':>18} {'ms/token':>9} {'accepted':>9}")
    for n in sizes:
        for name, gen in gens.items():
            run(gen, n, 2 * args.k)  # captures this size's graphs: no compile is timed
            stats = getattr(gen, "stats", None)
            before = (stats.accepted, stats.proposed) if stats else (0, 0)
            r = min((run(gen, n, args.tokens) for _ in range(3)), key=lambda x: x["ms_per_token"])
            rate = "-"
            if stats is not None:
                rate = f"{(stats.accepted - before[0]) / (stats.proposed - before[1]):.0%}"
            row = f"{r['per_step']:>18.2f} {r['ms_per_token']:>9.2f} {rate:>9}"
            print(f"{n:>5} {name:<20} {row}", flush=True)
    traces = {name: gen.traces for name, gen in gens.items()}
    print(f"graphs captured: {traces}")


if __name__ == "__main__":
    main()
