"""Time to first token with and without prefix caching, on the XLA CPU device (replayed graphs,
every graph captured before timing), for a tiny Llama (hidden 64, L layers).

Each request is a 1,024-token system prompt and a 16-token question, served alone by the
continuous-batching Engine (prefill chunk 256, blocks of 32 tokens). Side by side:

- ``no caching``: ``--no-prefix-caching``, the engine as before;
- ``0 % hits``: caching on, every system prompt new (the cost of storing blocks nobody reuses);
- ``50 % hits``: the first 512 tokens of the system prompt seen before, the rest new;
- ``100 % hits``: the whole system prompt seen before (a different question).

TTFT is submit -> the request's one token (``max_tokens`` 1), median of ``--requests`` (with
and without caching alternating, request by request); the
first tokens with and without caching are compared, and the graph count after warm-up and after
the timed requests printed.

Usage: ``PJRT_DEVICE=CPU python benchmarks/prefix_cache.py [--layers 4] [--requests 7]``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

SYSTEM, QUESTION, CHUNK, BLOCK = 1024, 16, 256, 32


def tiny_llama(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=257,
        max_position_embeddings=2048,
    )
    return LlamaForCausalLM(cfg).eval()


def make_engine(model, caching: bool):
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.prefix_cache import PrefixCache
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.job.data import ByteTokenizer

    gen = SlotGenerator(
        model,
        slots=2,
        max_len=SYSTEM + QUESTION + 16,
        chunk=CHUNK,
        prefill_buckets=[16, CHUNK],
        decode_buckets=[1, 2],
    )
    blocks = 2 * (SYSTEM + QUESTION) // BLOCK
    prefix = PrefixCache(gen, blocks=blocks, block=BLOCK, index=True) if caching else None
    engine = Engine()
    engine.attach(gen, ByteTokenizer(), [], 1, prefix)
    engine.warmup(every_shape=True)
    engine.start()
    return engine


def ttft(engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from submit to the request's end (its one token), and that token."""
    from neuron_tp.infer.sampling import Sampling
    from neuron_tp.infer.schedule import Done

    done = threading.Event()

    def sink(ev) -> None:
        if isinstance(ev, Done):
            done.set()

    t0 = time.perf_counter()
    req = engine.submit(prompt, 1, Sampling(), [], sink=sink)
    done.wait(300)
    return time.perf_counter() - t0, req.tokens[0]


def prompts(rng: random.Random, hits: float, n: int) -> tuple[list[int], list[list[int]]]:
    """A priming prompt and ``n`` timed ones sharing its first ``hits`` of the system prompt."""

    def words(k: int) -> list[int]:
        return [rng.randrange(1, 256) for _ in range(k)]

    system, shared = words(SYSTEM), int(SYSTEM * hits)
    timed = [system[:shared] + words(SYSTEM - shared) + words(QUESTION) for _ in range(n)]
    return system + words(QUESTION), timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--requests", type=int, default=7)
    args = p.parse_args()
    import neuron_tp as ntp
    from neuron_tp import hf

    model = hf.parallelize(tiny_llama(args.layers), ntp.Mesh(1, 0)).eval()
    model = model.to(ntp.xla_device())
    engines = {"off": make_engine(model, False), "on": make_engine(model, True)}
    warm = {k: e.gen.traces for k, e in engines.items()}
    print(f"L={args.layers}, prompt {SYSTEM} + {QUESTION} tokens, chunk {CHUNK}, block {BLOCK}")
    print(f"{'hits':>6} {'no caching ms':>14} {'caching ms':>11} {'speed-up':>9} {'same':>5}")
    for hits in (0.0, 0.5, 1.0):
        rng = random.Random(int(hits * 100))
        prime, timed = prompts(rng, hits, args.requests)
        got = {name: [] for name in engines}
        for engine in engines.values():
            ttft(engine, prime)
        for q in timed:  # alternating: the machine's load changes both sides alike
            for name, engine in engines.items():
                got[name].append(ttft(engine, q))
        off = statistics.median(t for t, _ in got["off"]) * 1e3
        on = statistics.median(t for t, _ in got["on"]) * 1e3
        same = [t for _, t in got["off"]] == [t for _, t in got["on"]]
        print(f"{hits:>6.0%} {off:>14.1f} {on:>11.1f} {off / on:>8.2f}x {str(same):>5}")
    stats = engines["on"].prefix_stats()
    print(f"prefix cache: hit rate {stats.hit_rate:.2f}, {stats.cached_blocks} blocks cached")
    for k, e in engines.items():
        print(f"graphs ({k}): after warm-up {warm[k]}, after the timed requests {e.gen.traces}")
        e.shutdown(30)


if __name__ == "__main__":
    main()
