"""Run on 2 XLA CPU devices by tests/infer/test_multi_lora.py (one thread per device, see
tests/helpers/xla_dist.py): lora_cases' trace through the engine at tp=2 with replayed graphs,
every graph captured at warm-up; returns the graph counts after warm-up and at the end, and
how long the bank's adapter writes took."""

from __future__ import annotations

import threading
import time

import lora_cases as lc
import torch_xla
import transformers  # noqa: F401  (imported before the device threads start)

import neuron_tp as ntp
from neuron_tp import hf
from neuron_tp.backend.graphs import graph_counters
from neuron_tp.infer.engine import Engine
from neuron_tp.infer.slot_generator import SlotGenerator
from neuron_tp.parallel.sharding import move_to
from xla_dist import serial

BARRIER = threading.Barrier(2)  # compile counts are per process: read them in step


def _timed_writes(bank) -> list[float]:
    """Record the seconds of each ``bank.write``."""
    seconds, write = [], bank.write

    def timed(slot, weights):
        t0 = time.perf_counter()
        write(slot, weights)
        seconds.append(time.perf_counter() - t0)

    bank.write = timed
    return seconds


def job(paths: dict[str, str], requests: int) -> dict:
    import engine_cases as ec

    dev = torch_xla.device()
    mesh = ntp.init_mesh(tp=2)
    with serial():
        base = lc.base_copy()
    model = hf.parallelize(base, mesh).eval()  # collective: not under serial()
    move_to(model, dev)
    engine = Engine(mesh.group("world"), lease_steps=3)
    with serial():
        lc.attach(engine, SlotGenerator(model, **ec.SHAPES), paths)
    writes = _timed_writes(engine.gen.lora)
    engine.warmup(every_shape=True)
    traces = engine.gen.traces
    BARRIER.wait()
    compiles = graph_counters()["compiles"]
    out: dict = {}
    if mesh.rank != 0:
        engine.follow()
    else:
        items = lc.make_trace(5, requests)

        def driver() -> None:
            try:
                out["results"] = lc.drive(engine, items, paths)
            finally:
                engine.shutdown()

        thread = threading.Thread(target=driver)
        thread.start()
        engine.start(thread=False)  # the device work on this rank's own thread
        thread.join()
    BARRIER.wait()
    return {
        **out,
        "traces": [traces, engine.gen.traces],
        "compiles": [compiles, graph_counters()["compiles"]],
        "loads": engine.rows.lora.loads,
        "load_ms": 1000 * sum(writes) / max(len(writes), 1),
    }
