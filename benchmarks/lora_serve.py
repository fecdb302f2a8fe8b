"""Decode throughput with many LoRA adapters in one batch vs the merged single model, on the
XLA CPU device (replayed graphs), and the time to put an adapter into the bank.

A Llama of ``--layers`` layers and ``--hidden`` width (4 heads, 2 kv heads), 8 slots all
decoding. Rows side by side: the model without a bank (what a server with one merged adapter
runs), then the same model with a bank of ``--max-loras`` slots of rank ``--rank`` on every
attention and MLP projection, its rows naming no adapter, one adapter (all rows) and 4 distinct
adapters. Tokens/s is active rows / wall time per decode step; the graph count must not grow
while timing (writing adapters into the bank is data). Also: ``LoraBank.write`` (this rank's
slices, host stacks, upload) and ``read_adapter`` (a PEFT directory) times.

Usage: ``PJRT_DEVICE=CPU python benchmarks/lora_serve.py [--layers 4] [--hidden 256]
[--rank 16] [--steps 48] [--repeats 3]``; each row is the fastest of its repeats, run
interleaved with the others.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time

import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from int8_weights import tiny_llama  # noqa: E402
from slots_decode import measure_slots  # noqa: E402

SLOTS = 8


def random_adapter(bank, rank: int, seed: int):
    """An adapter of ``rank`` on every projection of ``bank`` (full tensors, like read_adapter)."""
    from neuron_tp.hf.lora_bank import AdapterWeights

    g = torch.Generator().manual_seed(seed)
    mods = {
        n: (
            torch.randn(rank, t.in_full, generator=g) * 0.05,
            torch.randn(t.out_full, rank, generator=g) * 0.05,
        )
        for n, t in bank.targets.items()
    }
    return AdapterWeights(f"random-{seed}", rank, mods)


def timed_slots(gen, adapters: list[int], steps: int) -> dict:
    """measure_slots with each row's adapter (bank slot, -1 none) given at prefill."""
    prefill = gen.prefill

    def with_adapter(slot, *a, **kw):
        return prefill(slot, *a, **kw, **({"adapter": adapters[slot]} if adapters else {}))

    gen.prefill = with_adapter
    try:
        return measure_slots(gen, SLOTS, steps, False)
    finally:
        gen.prefill = prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.hf.lora_bank import LoraBank, read_adapter
    from neuron_tp.infer.slot_generator import SlotGenerator

    base = tiny_llama(args.hidden, args.layers)
    shape = dict(max_len=args.steps + 32, chunk=16, decode_buckets=[SLOTS])
    plain = hf.parallelize(copy.deepcopy(base), ntp.Mesh(1, 0)).eval().to(ntp.xla_device())
    gen0 = SlotGenerator(plain, SLOTS, **shape)
    gen0.warmup()
    lora = hf.parallelize(copy.deepcopy(base), ntp.Mesh(1, 0)).eval().to(ntp.xla_device())
    bank = LoraBank(lora, args.max_loras, args.rank)
    gen = SlotGenerator(lora, SLOTS, **shape, lora=bank)
    gen.warmup()
    warm = gen.traces
    writes = []
    for s in range(args.max_loras):
        w = random_adapter(bank, args.rank, s)
        t0 = time.perf_counter()
        bank.write(s, w)
        writes.append(time.perf_counter() - t0)
    runs = {
        "merged single model (no bank)": lambda: measure_slots(gen0, SLOTS, args.steps, False),
        "bank, 0 adapters in the batch": lambda: timed_slots(gen, [-1] * SLOTS, args.steps),
        "bank, 1 adapter (all rows)": lambda: timed_slots(gen, [0] * SLOTS, args.steps),
        "bank, 4 distinct adapters": lambda: timed_slots(
            gen, [i % 4 for i in range(SLOTS)], args.steps
        ),
    }
    rows: dict[str, dict] = {}
    for _ in range(args.repeats):  # interleaved; the fastest of each (a shared machine)
        for name, run in runs.items():
            r = run()
            if name not in rows or r["wall_ms"] < rows[name]["wall_ms"]:
                rows[name] = r
    mib = sum(t.numel() * t.element_size() for t in bank.tensors) / 2**20
    print(
        f"L={args.layers} hidden={args.hidden}: bank of {args.max_loras} x rank {args.rank} on "
        f"{len(bank.targets)} projections ({mib:.1f} MiB); {SLOTS} slots decoding"
    )
    ref = rows["merged single model (no bank)"]["wall_ms"]
    print(
        f"{'path':<32} {'wall ms/step':>12} {'exec ms/step':>12} {'tokens/s':>9} {'vs merged':>9}"
    )
    for name, r in rows.items():
        tps = SLOTS * 1e3 / r["wall_ms"]
        print(
            f"{name:<32} {r['wall_ms']:>12.3f} {r['execute_ms']:>12.3f} {tps:>9.0f} "
            f"{ref / r['wall_ms']:>8.2f}x"
        )
    print(f"graphs after warmup {warm}, after timing {gen.traces} (a write compiles nothing)")
    mean = 1e3 * sum(writes) / len(writes)
    print(f"LoraBank.write: {mean:.1f} ms per adapter (mean of {len(writes)})")
    with tempfile.TemporaryDirectory() as d:
        _save_peft(base, d, args.rank)
        t0 = time.perf_counter()
        read_adapter(d)
        print(
            f"read_adapter (PEFT directory, safetensors): {1e3 * (time.perf_counter() - t0):.1f} ms"
        )


def _save_peft(base, path: str, rank: int) -> None:
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, target_modules=targets)).save_pretrained(
        path
    )


if __name__ == "__main__":
    main()
