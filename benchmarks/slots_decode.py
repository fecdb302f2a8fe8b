"""Decode step time of the continuous-batching SlotGenerator vs the static-batch Generator on
the XLA CPU device, for a tiny Llama (hidden 64) of L layers, replayed graphs both.

Per number of active sequences (1, 4, 8 by default): the Generator runs a batch of that size
(batch buckets = those sizes); the SlotGenerator has 8 slots (decode buckets = those sizes)
with that many active, greedy and sampled. Wall and device-execute ms per decode step, after a
warm-up (no compile is timed), and the SlotGenerator's graph count (model traces) after
``warmup()`` and after the timed steps.

Usage: ``PJRT_DEVICE=CPU python benchmarks/slots_decode.py [--layers 8] [--active 1,4,8]
[--steps 64]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from generate_latency import measure_xla, tiny_llama  # noqa: E402


def execute_ms() -> float:
    import torch_xla.debug.metrics as met

    data = met.metric_data("ExecuteTime")
    return data[1] / 1e6 if data else 0.0


def measure_slots(gen, n: int, steps: int, sampled: bool) -> dict:
    """``n`` slots prefilled with short prompts, then ``steps`` timed decode steps."""
    from neuron_tp.infer.sampling import Sampling

    for s in list(gen.in_use):
        gen.release(s)
    for i in range(n):
        slot = gen.acquire()
        sampling = Sampling(True, 0.8, 20, seed=i) if sampled else Sampling()
        gen.prefill(slot, [(7 * i + j) % 250 + 1 for j in range(5 + i % 4)], 0, sampling)
    gen.decode()  # the first step after prefills uploads the active flags
    e0, t0 = execute_ms(), time.perf_counter()
    for _ in range(steps):
        gen.decode()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    return {"wall_ms": wall, "execute_ms": (execute_ms() - e0) / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--active", default="1,4,8")
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.infer.slot_generator import SlotGenerator

    sizes = sorted(map(int, args.active.split(",")))
    model = hf.parallelize(copy.deepcopy(tiny_llama(args.layers)), ntp.Mesh(1, 0)).eval()
    model = model.to(ntp.xla_device())
    gen = SlotGenerator(model, max(sizes), max_len=args.steps + 32, chunk=16, decode_buckets=sizes)
    gen.warmup()
    warm = gen.traces
    print(f"L={args.layers}: SlotGenerator graphs after warmup(): {warm}")
    print(f"{'active':>6} {'path':<28} {'wall ms/step':>12} {'exec ms/step':>12}")
    for n in sizes:
        prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + i % 4)] for i in range(n)]
        rows = {
            f"Generator batch {n}": measure_xla(model, prompts, args.steps + 1, True),
            "SlotGenerator greedy": measure_slots(gen, n, args.steps, False),
            "SlotGenerator sampled": measure_slots(gen, n, args.steps, True),
        }
        for name, r in rows.items():
            print(f"{n:>6} {name:<28} {r['wall_ms']:>12.3f} {r['execute_ms']:>12.3f}")
    print(f"SlotGenerator graphs after the timed steps: {gen.traces} (after warmup: {warm})")


if __name__ == "__main__":
    main()
