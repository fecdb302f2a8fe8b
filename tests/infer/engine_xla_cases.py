"""Run on 2 XLA CPU devices by tests/infer/test_engine.py (one thread per device, see
tests/helpers/xla_dist.py): the continuous-batching engine at tp=2 over a random trace of 200
requests vs transformers per request, with every graph captured at warm-up and none after."""

from __future__ import annotations

import copy
import threading

import engine_cases as ec
import torch_xla
import transformers  # noqa: F401  (imported before the device threads start)

import neuron_tp as ntp
from neuron_tp import hf
from neuron_tp.backend.graphs import graph_counters
from neuron_tp.infer.engine import Engine
from neuron_tp.infer.slots import SlotGenerator
from neuron_tp.job.data import ByteTokenizer
from neuron_tp.job.presets import build_model
from neuron_tp.parallel.sharding import move_to
from xla_dist import serial

BARRIER = threading.Barrier(2)  # both device threads: compile counts are per process


def job(requests: int = 200) -> dict:
    dev = torch_xla.device()
    mesh = ntp.init_mesh(tp=2)
    with serial():
        full = build_model("tiny-llama", ec.VOCAB, ec.SEED).eval()
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()  # collective: not under serial()
    move_to(model, dev)
    engine = Engine(mesh.group("world"), lease_steps=3)
    engine.attach(SlotGenerator(model, **ec.SHAPES), ByteTokenizer(), ec.EOS, ec.MAX_NEW)
    engine.warmup(every_shape=True)
    traces = engine.gen.traces
    BARRIER.wait()
    compiles = graph_counters()["compiles"]
    if mesh.rank != 0:
        engine.follow()
        BARRIER.wait()
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
    BARRIER.wait()
    after = graph_counters()["compiles"]
    with serial():
        refs = [ec.reference(full, it) for it in items]
    ec.check(out["results"], items, refs)
    return {
        "traces": [traces, engine.gen.traces],
        "compiles": [compiles, after],
        "max_batch": engine.stats["max_batch"],
        "cancelled": sum(r["cancelled"] for r in out["results"]),
    }
