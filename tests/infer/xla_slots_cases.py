"""SlotGenerator runs on N XLA CPU devices (tests/helpers/xla_dist.py), used by test_slots.py:
each rank serves the same random schedule of requests through replayed graphs."""

from __future__ import annotations

import copy
import threading
import time

import neuron_tp as ntp
from neuron_tp.backend.graphs import graph_counters
from slot_trace import eos_ids, kv1_llama, long_request, make_requests, run_long, run_schedule

_barriers: dict[int, threading.Barrier] = {}
_barrier_lock = threading.Lock()


def _barrier(n: int) -> threading.Barrier:
    with _barrier_lock:
        return _barriers.setdefault(n, threading.Barrier(n))


def serve_trace(tp: int, n_requests: int, seed: int) -> dict:
    """One rank: warm up every graph, then serve ``make_requests(seed, n_requests, ...)`` with a
    random schedule; the tokens and (traces, process-wide compiles) after warm-up and after
    the trace (every rank meets at a barrier before counting)."""
    from hf_sampling import peaked
    from neuron_tp import hf
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.job.presets import build_model
    from xla_dist import serial

    mesh = ntp.init_mesh(tp=tp)
    with serial():
        full = peaked(build_model("tiny-llama", 257, 4)).eval()  # temperature matters
    model = ntp.move_to(hf.parallelize(copy.deepcopy(full), mesh).eval(), ntp.xla_device())
    gen = SlotGenerator(model, 4, max_len=48, chunk=8, prefill_buckets=[8], decode_buckets=[2, 4])
    barrier, counts = _barrier(mesh.world_size), []
    gen.warmup()
    barrier.wait()
    counts.append((gen.traces, graph_counters()["compiles"]))
    barrier.wait()
    tokens = run_schedule(gen, make_requests(seed, n_requests, 20, 8), seed, eos_ids(full))
    barrier.wait()
    counts.append((gen.traces, graph_counters()["compiles"]))
    t0 = time.perf_counter()
    split = _split_long(mesh, barrier)
    split["seconds"] = time.perf_counter() - t0
    return {"tokens": tokens, "counts": counts, "split": split}


SPLIT_LONG = 512  # the long prompt of the sequence-split case (2 prefill chunks)


def _split_long(mesh, barrier) -> dict:
    """The sequence-split KV cache (one kv head at tp 2): warm up, then a long prompt in
    chunks of 256 and a few decoded tokens; its tokens, the graphs traced and compiled after
    warm-up and after the prompt, and the KV bytes per rank (sequence vs heads)."""
    from neuron_tp import hf
    from neuron_tp.infer.slot_generator import SlotGenerator
    from xla_dist import serial

    with serial():
        full = kv1_llama()
    model = ntp.move_to(hf.parallelize(full, mesh).eval(), ntp.xla_device())
    max_len = SPLIT_LONG + 16
    gen = SlotGenerator(model, 1, max_len, chunk=256, prefill_buckets=[256], kv_split="auto")
    gen.warmup()
    barrier.wait()
    counts = [(gen.traces, graph_counters()["compiles"])]
    barrier.wait()
    tokens = run_long(gen, long_request(SPLIT_LONG), 256)
    barrier.wait()
    counts.append((gen.traces, graph_counters()["compiles"]))
    heads = SlotGenerator(model, 1, max_len, chunk=256, kv_split="heads").kv_bytes
    return {
        "tokens": tokens,
        "counts": counts,
        "bytes": (gen.kv_bytes, heads),
        "mode": gen.kv_split,
    }
