"""Random request traces for the continuous-batching engine and their independent reference
(transformers' own ``generate`` on the unsharded model, one request at a time), shared by
tests/infer/test_engine.py on one process, gloo ranks and XLA CPU device threads."""

from __future__ import annotations

import random
import threading
import time

import torch

from hf_sampling import hf_sample
from neuron_tp.infer.sampling import Sampling
from neuron_tp.infer.schedule import Done, Failed

VOCAB, SEED = 257, 4
EOS = [131, 215]
SLOTS, CHUNK, MAX_NEW, MAX_PROMPT = 3, 8, 12, 20
SHAPES = dict(
    slots=SLOTS,
    max_len=MAX_PROMPT + MAX_NEW,
    chunk=CHUNK,
    prefill_buckets=[4, CHUNK],
    decode_buckets=[1, SLOTS],
)


def make_trace(seed: int, n: int, cancel: float = 0.1) -> list[dict]:
    """``n`` requests: random gaps (several arrive at once, others while some decode),
    prompt lengths 1..MAX_PROMPT (up to three prefill chunks), max_tokens 1..MAX_NEW, a third
    sampled with their own seed (temperature, top_k), some cancelled by their client."""
    rng = random.Random(seed)
    items = []
    for _ in range(n):
        sampled = rng.random() < 1 / 3
        items.append(
            {
                "gap": rng.choice([0.0, 0.0, 0.002, 0.01]),
                "prompt": [rng.randrange(1, 256) for _ in range(rng.randint(1, MAX_PROMPT))],
                "max_tokens": rng.randint(1, MAX_NEW),
                "sampling": (rng.choice([0.7, 1.3]), rng.choice([0, 5]), rng.randrange(10**6))
                if sampled
                else None,
                "cancel": rng.random() < cancel,
            }
        )
    return items


def sampling(item: dict) -> Sampling:
    if item["sampling"] is None:
        return Sampling()
    temperature, top_k, seed = item["sampling"]
    return Sampling(True, temperature, top_k, seed)


def reference(full, item: dict) -> list[int]:
    """The request's tokens from transformers alone: up to and including the first EOS."""
    p, n = item["prompt"], item["max_tokens"]
    if item["sampling"] is None:
        ids = torch.tensor([p])
        out = full.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=0,
        )[0, len(p) :].tolist()
    else:
        temperature, top_k, seed = item["sampling"]
        out = hf_sample(full, [p], n, temperature, top_k, seed, eos_token_id=EOS)[0]
    ends = [i for i, t in enumerate(out) if t in EOS]
    return out[: ends[0] + 1] if ends else out


def drive(engine, items: list[dict], timeout: float = 300) -> list[dict]:
    """Submit ``items`` at their gaps; a request marked ``cancel`` is cancelled by its client
    at its first text. Returns per request its tokens, events and whether it was cancelled,
    once every other one has ended and no slot is held."""
    finished = threading.Semaphore(0)
    results = [{"events": [], "cancelled": False} for _ in items]
    reqs = []

    def sink(i: int):
        def take(ev) -> None:
            results[i]["events"].append(ev)
            if isinstance(ev, (Done, Failed)):
                finished.release()
            elif items[i]["cancel"] and not results[i]["cancelled"]:
                results[i]["cancelled"] = True
                reqs[i].cancel()
                finished.release()

        return take

    # start() may run on another thread right after this one was started
    assert engine.wait_ready(timeout), "the engine did not become ready"
    for i, it in enumerate(items):
        time.sleep(it["gap"])
        s = sampling(it)
        reqs.append(
            engine.submit(it["prompt"], it["max_tokens"], s, [], sink=sink(i), seeded=s.do_sample)
        )
    deadline = time.monotonic() + timeout
    for _ in items:
        assert finished.acquire(timeout=max(0.0, deadline - time.monotonic())), "a request hung"
    while engine.slots_in_use() or engine.queue_depth():
        assert time.monotonic() < deadline, "cancelled requests still hold slots"
        time.sleep(0.01)
    for r, req in zip(results, reqs):
        r["tokens"] = list(req.tokens)
    return results


def check(results: list[dict], items: list[dict], refs: list[list[int]]) -> None:
    """Every finished request equals its reference; a cancelled one is a prefix of it."""
    for i, (r, item, ref) in enumerate(zip(results, items, refs)):
        what = f"request {i} ({item})"
        if r["cancelled"]:
            assert r["tokens"] == ref[: len(r["tokens"])], f"{what}: {r['tokens']} vs {ref}"
            continue
        done = r["events"][-1]
        assert isinstance(done, Done), f"{what}: {r['events'][-1]}"
        assert r["tokens"] == ref, f"{what}: got {r['tokens']}, transformers {ref}"
        assert done.completion_tokens == len(ref), what
        reason = "stop" if ref[-1] in EOS else "length"
        assert done.finish_reason == reason, f"{what}: {done.finish_reason}"
