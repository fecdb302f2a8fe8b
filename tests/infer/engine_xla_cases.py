"""Run on 2 XLA CPU devices by tests/infer/test_engine.py (one thread per device, see
tests/helpers/xla_dist.py): the continuous-batching engine at tp=2 over a random trace of 200
requests vs transformers per request, with every graph compiled at warm-up and none after."""

from __future__ import annotations

import copy
import threading
import time

import engine_cases as ec
import torch_xla
import transformers  # noqa: F401  (imported before the device threads start)

import neuron_tp as ntp
from neuron_tp import hf
from neuron_tp.backend.graphs import graph_counters
from neuron_tp.infer.engine import Engine
from neuron_tp.infer.slot_generator import SlotGenerator
from neuron_tp.job.data import ByteTokenizer
from neuron_tp.job.presets import build_model
from neuron_tp.parallel.sharding import move_to
from xla_dist import serial

BARRIERS = {n: threading.Barrier(n) for n in (1, 2)}  # the device threads of one run


def job(tp: int, requests: int, replay: bool) -> dict:
    """The engine at ``tp`` on ``tp`` devices over a trace of ``requests``: checked against
    transformers on rank 0; returns the graph counts after warm-up and at the end."""
    barrier = BARRIERS[tp]  # compile counts are per process: read them in step
    dev = torch_xla.device()
    mesh = ntp.init_mesh(tp=tp)
    with serial():
        full = build_model("tiny-llama", ec.VOCAB, ec.SEED).eval()
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()  # collective: not under serial()
    move_to(model, dev)
    engine = Engine(mesh.group("world") if tp > 1 else None, lease_steps=3)
    gen = SlotGenerator(model, **ec.SHAPES, replay=replay)
    engine.attach(gen, ByteTokenizer(), ec.EOS, ec.MAX_NEW)
    t0 = time.time()
    engine.warmup(every_shape=True)
    t1 = time.time()
    traces = engine.gen.traces
    barrier.wait()
    compiles = graph_counters()["compiles"]
    if mesh.rank != 0:
        engine.follow()
        barrier.wait()
        return {"traces": [traces, engine.gen.traces], "compiles": compiles}
    items, out = ec.make_trace(5, requests), {}

    def driver() -> None:
        try:
            out["results"] = ec.drive(engine, items)
        finally:
            engine.shutdown()

    thread = threading.Thread(target=driver)
    thread.start()
    engine.start(thread=False)  # the device work on this rank's own thread
    thread.join()
    barrier.wait()
    after = graph_counters()["compiles"]
    t2 = time.time()
    with serial():
        refs = [ec.reference(full, it) for it in items]
    ec.check(out["results"], items, refs)
    return {
        "traces": [traces, engine.gen.traces],
        "compiles": [compiles, after],
        "max_batch": engine.stats["max_batch"],
        "cancelled": sum(r["cancelled"] for r in out["results"]),
        "seconds": {"warmup": t1 - t0, "serve": t2 - t1, "reference": time.time() - t2},
    }
