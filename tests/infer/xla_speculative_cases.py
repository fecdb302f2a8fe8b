"""Speculative decoding on XLA CPU devices (tests/helpers/xla_dist.py), used by
test_speculative.py: each rank serves the same random schedule through replayed graphs."""

from __future__ import annotations

import copy
import threading
import time

import neuron_tp as ntp
from neuron_tp.backend.graphs import graph_counters
from slot_trace import eos_ids, make_requests, run_schedule

BARRIERS = {n: threading.Barrier(n) for n in (1, 2)}


def requests(n: int, seed: int) -> list:
    """Greedy and sampled requests (about half each)."""
    return make_requests(seed, n, 20, 10)


def job(tp: int, n: int, seed: int) -> dict:
    """One rank: a SpeculativeGenerator (tiny-llama target, its first layer + head as the
    draft, K=2) warmed up, then ``requests(n, seed)`` under a random schedule; the tokens,
    acceptance and (traces, process-wide compiles) after warm-up and after the schedule."""
    from hf_sampling import peaked
    from neuron_tp import hf
    from neuron_tp.infer.speculative import SpeculativeGenerator
    from neuron_tp.job.presets import build_model
    from spec_models import first_layers
    from xla_dist import serial

    mesh = ntp.init_mesh(tp=tp)
    with serial():
        full = peaked(build_model("tiny-llama", 257, 4)).eval()
        draft = first_layers(full, 1)
    dev = ntp.xla_device()
    model = ntp.move_to(hf.parallelize(copy.deepcopy(full), mesh).eval(), dev)
    draft = ntp.move_to(hf.parallelize(draft, mesh).eval(), dev)
    gen = SpeculativeGenerator(
        model, draft, 4, max_len=40, k=2, chunk=8, prefill_buckets=[8], decode_buckets=[4]
    )
    barrier, counts = BARRIERS[mesh.world_size], []
    t0 = time.time()
    gen.warmup()
    t1 = time.time()
    barrier.wait()
    counts.append((gen.traces, graph_counters()["compiles"]))
    barrier.wait()
    tokens = run_schedule(gen, requests(n, seed), seed, eos_ids(full))
    barrier.wait()
    counts.append((gen.traces, graph_counters()["compiles"]))
    s = gen.stats
    seconds = {"warmup": t1 - t0, "schedule": time.time() - t1}
    return {
        "tokens": tokens,
        "counts": counts,
        "accepted": s.accepted,
        "proposed": s.proposed,
        "seconds": seconds,
    }
