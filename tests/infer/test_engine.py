"""Continuous batching (:class:`neuron_tp.infer.engine.Engine` over a
:class:`~neuron_tp.infer.slot_generator.SlotGenerator`): under random arrival traces (requests
joining while others decode, prompts longer than a prefill chunk, slots reused, clients cancelling,
seeded sampling beside greedy) every finished request's tokens equal transformers' own
``generate`` for that request alone, at tp 1 in this process, tp 2 on gloo ranks and tp 2 on two
XLA CPU devices (where no graph is compiled after warm-up); a short request that arrives while
long ones run ends first; a failing step fails its requests, not the engine."""

from __future__ import annotations

import copy
import os
import sys
import threading

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import engine_cases as ec  # noqa: E402

import gloo_dist  # noqa: E402


def _engine(model, group=None, **kw):
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.job.data import ByteTokenizer

    engine = Engine(group, **kw)
    engine.attach(SlotGenerator(model, **ec.SHAPES), ByteTokenizer(), ec.EOS, ec.MAX_NEW)
    return engine


@pytest.fixture(scope="module")
def full():
    from neuron_tp.job.presets import build_model

    return build_model("tiny-llama", ec.VOCAB, ec.SEED).eval()


def test_random_trace_equals_transformers_per_request_tp1(full):
    from neuron_tp import hf, init_mesh

    model = hf.parallelize(copy.deepcopy(full), init_mesh(tp=1)).eval()
    engine = _engine(model)
    engine.warmup()
    engine.start()
    items = ec.make_trace(1, 30)
    try:
        results = ec.drive(engine, items)
    finally:
        engine.shutdown(30)
    ec.check(results, items, [ec.reference(full, it) for it in items])
    assert engine.stats["max_batch"] == ec.SLOTS, "the slots were never all in use"
    assert sum(r["cancelled"] for r in results) >= 1


def test_a_short_request_joins_and_leaves_while_long_ones_run(full):
    """Two long requests decode; a short one submitted once they have their first tokens is
    done before either long one (a static batch would hold it until both end)."""
    import time

    from neuron_tp import hf, init_mesh
    from neuron_tp.infer.sampling import Sampling
    from neuron_tp.infer.schedule import Done

    model = hf.parallelize(copy.deepcopy(full), init_mesh(tp=1)).eval()
    engine = _engine(model)
    engine.start()
    order, lock = [], threading.Lock()

    def sink(name: str):
        def take(ev):
            if isinstance(ev, Done):
                with lock:
                    order.append(name)

        return take

    prompt = [72, 101, 108, 108, 111]  # no EOS among its first MAX_NEW greedy tokens
    long_ref = ec.reference(full, {"prompt": prompt, "max_tokens": ec.MAX_NEW, "sampling": None})
    assert len(long_ref) == ec.MAX_NEW
    try:
        longs = [engine.submit(prompt, ec.MAX_NEW, Sampling(), [], sink=sink("long")) for _ in "ab"]
        while not all(r.tokens for r in longs):
            time.sleep(0.001)
        engine.submit([65, 66], 2, Sampling(), [], sink=sink("short"))
        while len(order) < 3:
            time.sleep(0.01)
    finally:
        engine.shutdown(30)
    assert order[0] == "short", order
    assert all(r.tokens == long_ref for r in longs)


class _FailingDecode:
    """A SlotGenerator whose decode fails once (e.g. a device error)."""

    def __init__(self, gen):
        self.gen, self.failed = gen, False

    def __getattr__(self, name):
        return getattr(self.gen, name)

    def decode(self):
        if not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return self.gen.decode()


def test_a_failed_step_fails_its_requests_and_serving_goes_on(full):
    from neuron_tp import hf, init_mesh

    model = hf.parallelize(copy.deepcopy(full), init_mesh(tp=1)).eval()
    engine = _engine(model)
    engine.gen = _FailingDecode(engine.gen)
    engine.start()
    items = [{"gap": 0.0, "prompt": [5, 6, 7], "max_tokens": 6, "sampling": None, "cancel": False}]
    try:
        first = ec.drive(engine, items)
        assert isinstance(first[0]["events"][-1], ec.Failed), first
        assert "device lost" in first[0]["events"][-1].message
        assert engine.ready and engine.error is None
        items = ec.make_trace(2, 6, cancel=0)
        again = ec.drive(engine, items)
    finally:
        engine.shutdown(30)
    ec.check(again, items, [ec.reference(full, it) for it in items])


# -- tp 2: gloo ranks and XLA CPU devices ------------------------------------------------------


def _tp2_trace(case: str) -> None:
    from neuron_tp import hf, init_mesh
    from neuron_tp.job.presets import build_model

    mesh = init_mesh(tp=2)
    full = build_model("tiny-llama", ec.VOCAB, ec.SEED).eval()
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()
    engine = _engine(model, mesh.group("world"), lease_steps=3)
    engine.warmup()
    if mesh.rank != 0:
        engine.follow()
        return
    engine.start()
    items = ec.make_trace(3, 24)
    try:
        results = ec.drive(engine, items)
    finally:
        engine.shutdown(60)
    ec.check(results, items, [ec.reference(full, it) for it in items])


def test_random_trace_equals_transformers_per_request_tp2_gloo():
    gloo_dist.run_case(_tp2_trace, "trace", cases=["trace"], world_size=2)


def test_random_trace_on_two_xla_devices_compiles_nothing_after_warmup():
    """tp=2 on two XLA CPU devices with replayed graphs: a random trace of 200 requests, each
    equal to transformers alone; every graph captured at warm-up, none traced or compiled
    while serving."""
    import engine_xla_cases

    import xla_dist

    r0, r1 = xla_dist.run(engine_xla_cases.job, 2, 200, True, devices=2)
    for r in (r0, r1):
        assert r["traces"][0] == r["traces"][1] > 0, r
    assert r0["compiles"][0] == r0["compiles"][1], r0
    assert r0["max_batch"] == ec.SLOTS and r0["cancelled"] >= 1, r0
