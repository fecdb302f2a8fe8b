"""Tokenization + packing throughput of instruction data (neuron_tp.job.sft_data.load_data) on
a generated set of conversations: samples/s, host memory (peak RSS growth), rows and padding
with and without packing, and the time a --data-cache entry takes to read. Not a test.

    python benchmarks/sft_data.py [--n 100000] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))
from build_sft_example import _task  # noqa: E402


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args()
    from neuron_tp.job.data import load_tokenizer
    from neuron_tp.job.sft_data import load_data

    tok = load_tokenizer(os.path.join(REPO, "examples", "sft", "tokenizer"))
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "chats.jsonl")
        with open(path, "w") as f:
            for _ in range(args.n):
                msgs = []
                for _ in range(rng.randint(1, 3)):
                    q, a = _task(rng)
                    msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
                f.write(json.dumps({"messages": msgs}) + "\n")
        for packing in (True, False):
            before, t0 = _rss_mb(), time.perf_counter()
            data = load_data(path, tok, args.seq_len, 1, packing=packing)
            dt = time.perf_counter() - t0
            print(
                f"packing={packing}: {args.n} conversations in {dt:.1f} s = "
                f"{args.n / dt:,.0f} samples/s; peak RSS +{_rss_mb() - before:.0f} MiB "
                f"(total {_rss_mb():.0f} MiB); {'; '.join(data.notes)}"
            )
        cache = os.path.join(tmp, "cache")
        load_data(path, tok, args.seq_len, 1, cache=cache)  # written
        t0 = time.perf_counter()
        data = load_data(path, tok, args.seq_len, 1, cache=cache)
        print(f"--data-cache read (mapped): {time.perf_counter() - t0:.2f} s; {data.notes[-1]}")


if __name__ == "__main__":
    main()
