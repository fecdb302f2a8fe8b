"""Many LoRA adapters through the continuous-batching engine, shared by
tests/infer/test_multi_lora.py on one process, gloo ranks and XLA CPU device threads: a random
trace of requests naming three adapters or the base model, over an engine whose bank holds TWO
adapters (a third must wait for a slot no running request uses), with an adapter loaded at
run time, one unloaded and loaded again (a new load of the same name). The reference of each
request: transformers' own generation on peft's merged model of its adapter, alone."""

from __future__ import annotations

import copy
import random
import threading
import time

import engine_cases as ec
import torch

from lora_serving import SPECS, base_model, merged
from neuron_tp.infer.schedule import Done, Failed

BANK, RANK = 2, 8  # adapters resident at once (--max-loras), --max-lora-rank
NAMES = sorted(SPECS)  # alpha, beta, gamma
AT_START = NAMES[:2]  # --lora-modules; gamma is POSTed mid-trace, beta unloaded and reloaded


def make_trace(seed: int, n: int) -> list[dict]:
    """``n`` requests of engine_cases' kind (no cancellations), each naming an adapter or
    None (the base)."""
    items = ec.make_trace(seed, n, cancel=0.0)
    rng = random.Random(seed + 1)
    for i, it in enumerate(items):
        it["adapter"] = rng.choice([None, *NAMES]) if i >= n // 3 else rng.choice([None, *AT_START])
    return items


def attach(engine, gen, paths: dict[str, str], max_cpu: int = 1) -> None:
    """Give ``engine`` the slot generator ``gen`` with a LoRA bank of BANK slots and the
    AT_START adapters known (``max_cpu``: adapters kept read in host memory)."""
    from neuron_tp.hf.lora_bank import LoraBank
    from neuron_tp.infer.lora_slots import Adapters, BankSlots, HostAdapters
    from neuron_tp.job.data import ByteTokenizer

    bank = LoraBank(gen.model, BANK, RANK)
    gen.lora = bank
    host = HostAdapters(max_cpu)
    engine.attach(gen, ByteTokenizer(), ec.EOS, ec.MAX_NEW, lora=BankSlots(bank, host))
    engine.adapters = Adapters("base", bank, host)
    for name in AT_START:
        engine.adapters.load(name, paths[name])


def drive(engine, items: list[dict], paths: dict[str, str], timeout: float = 300) -> list:
    """Rank 0: submit ``items`` at their gaps; before the first third's end ``gamma`` is
    loaded, at two thirds ``beta`` unloaded and loaded again. Returns each request's tokens
    and last event once all have ended."""
    finished = threading.Semaphore(0)
    events: list[list] = [[] for _ in items]

    def sink(i: int):
        def take(ev) -> None:
            events[i].append(ev)
            if isinstance(ev, (Done, Failed)):
                finished.release()

        return take

    assert engine.wait_ready(timeout), "the engine did not become ready"
    reqs = []
    for i, it in enumerate(items):
        if i == len(items) // 3:
            engine.adapters.load("gamma", paths["gamma"])
        if i == 2 * len(items) // 3:
            engine.adapters.unload("beta")
            engine.adapters.load("beta", paths["beta"])
        time.sleep(it["gap"])
        s = ec.sampling(it)
        ref = engine.adapters.get(it["adapter"]) if it["adapter"] else None
        reqs.append(
            engine.submit(
                it["prompt"], it["max_tokens"], s, [], sink=sink(i), seeded=s.do_sample, adapter=ref
            )
        )
    deadline = time.monotonic() + timeout
    for _ in items:
        assert finished.acquire(timeout=max(0.0, deadline - time.monotonic())), "a request hung"
    return [(list(r.tokens), ev[-1]) for r, ev in zip(reqs, events)]


def references(items: list[dict], paths: dict[str, str]) -> list[list[int]]:
    """Each request's tokens from transformers on peft's merged model of its adapter."""
    base = base_model()
    models = {None: base, **{n: merged(paths[n], base) for n in NAMES}}
    with torch.no_grad():
        return [ec.reference(models[it["adapter"]], it) for it in items]


def check(results: list, items: list[dict], refs: list[list[int]]) -> None:
    """Every request ended and equals its reference."""
    bad = []
    for i, ((tokens, last), it, ref) in enumerate(zip(results, items, refs)):
        if not isinstance(last, Done) or tokens != ref:
            bad.append((i, it["adapter"], tokens, ref, last))
    assert not bad, f"{len(bad)} of {len(items)} requests differ (i, adapter, got, want): {bad[:3]}"


def base_copy():
    """A copy of the base model (each rank shards its own)."""
    return copy.deepcopy(base_model())
