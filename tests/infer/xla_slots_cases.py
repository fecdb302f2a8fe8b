"""SlotGenerator runs on N XLA CPU devices (tests/helpers/xla_dist.py), used by test_slots.py:
each rank serves the same random schedule of requests through replayed graphs."""

from __future__ import annotations

import copy
import threading

import neuron_tp as ntp
from neuron_tp.backend.graphs import graph_counters
from slot_trace import eos_ids, make_requests, run_schedule

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
    return {"tokens": tokens, "counts": counts}
