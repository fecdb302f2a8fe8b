"""SlotGenerator (continuous batching): under random schedules of joins and leaves (requests
prefilled chunk by chunk into free slots while others decode, prompts longer than a chunk,
slot reuse), every request's tokens equal transformers' own generation of that request alone
(greedy ``generate``; ``hf_sample`` for a seed), at tp 1 (eager CPU) and tp 2 (gloo)."""

from __future__ import annotations

import copy

import pytest

import gloo_dist
from neuron_tp.infer.generate import MAX_TOP_K, Sampling
from neuron_tp.infer.slots import SlotGenerator
from slot_trace import Req, eos_ids, make_requests, reference, run_schedule


def _model():
    from neuron_tp.job.presets import build_model

    return build_model("tiny-llama", 257, 4).eval()


def _reuse_requests() -> list:
    """One slot: a long request, then shorter ones that reuse its cache row."""
    long = Req(list(range(30, 60)), 7, Sampling())
    short = Req([72, 101, 108], 5, Sampling())
    sampled = Req([9, 8, 7, 6], 6, Sampling(True, 0.9, 20, 3))
    return [long, short, sampled, Req([5], 4, Sampling())]


def _check_trace(model, full, slots: int, decode_buckets, reqs, seed: int) -> None:
    gen = SlotGenerator(model, slots, max_len=64, chunk=8, decode_buckets=decode_buckets)
    got = run_schedule(gen, reqs, seed, eos_ids(full))
    want = [reference(full, r) for r in reqs]
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(reqs)} requests differ (index, got, want): {bad[:3]}"


def test_random_schedule_tp1():
    full = _model()
    _check_trace(full, full, 4, [2, 4], make_requests(1, 14, 20, 8), seed=1)


def test_freed_slot_reused_by_shorter_request():
    full = _model()
    _check_trace(full, full, 1, None, _reuse_requests(), seed=0)


def test_check_names_the_limit():
    gen = SlotGenerator(_model(), 2, max_len=32, chunk=8)
    with pytest.raises(ValueError, match="max_len"):
        gen.check(30, 3, Sampling())
    with pytest.raises(ValueError, match=f"0..{MAX_TOP_K}"):
        gen.check(3, 3, Sampling(True, 1.0, MAX_TOP_K + 1))
    with pytest.raises(ValueError, match="seed"):
        gen.check(3, 3, Sampling(True, seed=2**80))
    gen.check(29, 3, Sampling(True, 1.0, MAX_TOP_K))
    assert [gen.acquire(), gen.acquire(), gen.acquire()] == [0, 1, None]
    gen.release(0)
    assert gen.acquire() == 0


CASES = ["trace", "reuse"]


def _tp2_case(case: str) -> None:
    from neuron_tp import hf

    mesh = gloo_dist.shared_mesh(2)
    full = _model()
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()
    if case == "trace":
        _check_trace(model, full, 3, [1, 3], make_requests(2, 10, 20, 6), seed=2)
    else:
        _check_trace(model, full, 1, None, _reuse_requests(), seed=0)


@pytest.mark.parametrize("case", CASES)
def test_tp2_gloo(case):
    gloo_dist.run_case(_tp2_case, case, cases=CASES, world_size=2)


def test_xla_two_devices_tp2_fixed_graphs():
    """tp=2 on 2 XLA CPU devices, replayed graphs: ~50 requests under a random schedule equal
    transformers per request; warm-up traced every graph (6: prefill bucket 8 and decode
    buckets 2, 4, greedy and sampled) and the trace compiles nothing more."""
    import xla_slots_cases

    import xla_dist

    res = xla_dist.run(xla_slots_cases.serve_trace, 2, 48, 5, devices=2)
    assert res[0]["tokens"] == res[1]["tokens"]
    (traces, compiles), after = res[0]["counts"]
    assert traces == 6 and after == (traces, compiles)
    full = _model()
    reqs = make_requests(5, 48, 20, 8)
    want = [reference(full, r) for r in reqs]
    bad = [(i, g, w, reqs[i]) for i, (g, w) in enumerate(zip(res[0]["tokens"], want)) if g != w]
    assert not bad, f"requests differ from transformers (index, got, want, request): {bad}"
