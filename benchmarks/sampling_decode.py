"""Decode step time of the SlotGenerator per sampling path on the XLA CPU device, for a tiny
Llama (hidden 64) of L layers and a vocabulary of V tokens, replayed graphs: greedy; sampled;
sampled with min_p and the penalties (the same sampled graph, other row data); with top_p too
(the sampled graph that sorts the vocabulary); greedy with the log-probabilities read back
every step. Wall and device-execute ms per decode step after
a warm-up, and the graph count after ``warmup()`` and after the timed steps (no value adds
one).

Usage: ``PJRT_DEVICE=CPU python benchmarks/sampling_decode.py [--layers 8] [--vocab 32000]
[--active 4] [--steps 64]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slots_decode import execute_ms  # noqa: E402


def measure(gen, n: int, steps: int, sampling, logprobs: bool) -> dict:
    """``n`` slots prefilled with short prompts, then ``steps`` timed decode steps."""
    for s in list(gen.in_use):
        gen.release(s)
    for i in range(n):
        slot = gen.acquire()
        prompt = [(7 * i + j) % 250 + 1 for j in range(5 + i % 4)]
        if logprobs:
            gen.logprob_slots.add(slot)
        gen.prefill(slot, prompt, 0, sampling(i), prompt=prompt)
    gen.decode()  # the first step after prefills uploads the active flags
    e0, t0 = execute_ms(), time.perf_counter()
    for _ in range(steps):
        gen.decode()
    wall = (time.perf_counter() - t0) * 1e3 / steps
    return {"wall_ms": wall, "execute_ms": (execute_ms() - e0) / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--active", type=int, default=4)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.infer.sampling import Sampling
    from neuron_tp.infer.slot_generator import SlotGenerator

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    model = hf.parallelize(copy.deepcopy(LlamaForCausalLM(cfg).eval()), ntp.Mesh(1, 0)).eval()
    model = model.to(ntp.xla_device())
    gen = SlotGenerator(model, args.active, max_len=args.steps + 32, chunk=16, top_p=True)
    gen.warmup()
    warm = gen.traces
    paths = {
        "greedy": (lambda i: Sampling(), False),
        "sampled (temperature 0.8)": (lambda i: Sampling(True, 0.8, 0, i), False),
        "sampled + min_p + penalties": (
            lambda i: Sampling(
                True,
                0.8,
                0,
                i,
                min_p=0.05,
                presence_penalty=0.5,
                frequency_penalty=0.5,
                repetition_penalty=1.2,
            ),
            False,
        ),
        "top_p 0.9 + min_p + penalties": (
            lambda i: Sampling(
                True,
                0.8,
                0,
                i,
                top_p=0.9,
                min_p=0.05,
                presence_penalty=0.5,
                frequency_penalty=0.5,
                repetition_penalty=1.2,
            ),
            False,
        ),
        "greedy + logprobs (20 top)": (lambda i: Sampling(), True),
    }
    print(f"L={args.layers}, vocab {args.vocab}, {args.active} active slots")
    print(f"{'path':<32} {'wall ms/step':>12} {'exec ms/step':>12}")
    for name, (sampling, logprobs) in paths.items():
        best = min(
            (measure(gen, args.active, args.steps, sampling, logprobs) for _ in range(3)),
            key=lambda r: r["wall_ms"],
        )
        print(f"{name:<32} {best['wall_ms']:>12.3f} {best['execute_ms']:>12.3f}")
    print(f"graphs after warmup(): {warm}, after the timed steps: {gen.traces}")


if __name__ == "__main__":
    main()
