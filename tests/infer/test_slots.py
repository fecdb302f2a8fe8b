"""SlotGenerator (continuous batching): under random schedules of joins and leaves (requests
prefilled chunk by chunk into free slots while others decode, prompts longer than a chunk,
slot reuse), every request's tokens equal transformers' own generation of that request alone
(greedy ``generate``; ``hf_sample`` for a seed), at tp 1 (eager CPU), tp 2 and 4 (gloo; a tiny
Mixtral too, its MoE layers decoding in gather and dense mode) and
tp 2 on 2 XLA CPU devices (replayed graphs: their number fixed at warm-up)."""

from __future__ import annotations

import pytest

import gloo_dist
from hf_sampling import peaked
from neuron_tp.infer.sampling import MAX_TOP_K, Sampling
from neuron_tp.infer.slot_generator import SlotGenerator
from slot_trace import Req, eos_ids, make_requests, reference, run_schedule


def _model(name: str = "tiny-llama"):
    from neuron_tp.job.presets import build_model

    if name == "tiny-mixtral":  # experts that decide the tokens
        from moe_archs import build_moe, loud_experts

        return peaked(loud_experts(build_moe("mixtral", 4, vocab_size=257)))
    return peaked(build_model(name, 257, 4)).eval()  # logits spread: temperature matters


def _reuse_requests() -> list:
    """One slot: a long request, then shorter ones that reuse its cache row."""
    long = Req(list(range(30, 60)), 7, Sampling())
    short = Req([72, 101, 108], 5, Sampling())
    sampled = Req([9, 8, 7, 6], 6, Sampling(True, 0.9, 20, 3))
    return [long, short, sampled, Req([5], 4, Sampling())]


def _check_trace(model, slots: int, decode_buckets, reqs, seed: int, want, eos) -> None:
    gen = SlotGenerator(model, slots, max_len=64, chunk=8, decode_buckets=decode_buckets)
    got = run_schedule(gen, reqs, seed, eos)
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} of {len(reqs)} requests differ (index, got, want): {bad[:3]}"


# (tp, slots, decode buckets, requests, schedule seed, model) of each case
CASES = {
    "trace": (1, 4, [2, 4], lambda: make_requests(1, 14, 20, 8), 1, "tiny-llama"),
    "reuse": (1, 1, None, _reuse_requests, 0, "tiny-llama"),
    "qwen3": (1, 3, None, lambda: make_requests(7, 6, 20, 5), 7, "tiny-qwen3"),
    "gpt2": (1, 3, None, lambda: make_requests(7, 6, 20, 5), 7, "tiny-gpt2"),  # fused c_attn
    "trace_tp2": (2, 3, [1, 3], lambda: make_requests(2, 10, 20, 6), 2, "tiny-llama"),
    "reuse_tp2": (2, 1, None, _reuse_requests, 0, "tiny-llama"),
    "gpt2_tp2": (2, 2, None, lambda: make_requests(8, 5, 20, 5), 8, "tiny-gpt2"),
    "trace_tp4": (4, 4, [4], lambda: make_requests(3, 8, 20, 6), 3, "tiny-llama"),  # kv replicated
    # MoE: decode bucket 1 in gather mode (1 x top-2 < 6 experts), bucket 3 and prefill dense
    "moe_tp2": (2, 3, [1, 3], lambda: make_requests(4, 5, 20, 6), 4, "tiny-mixtral"),
}
GLOO = [c for c in CASES if CASES[c][0] > 1]


def _expected(case: str) -> tuple[list, list]:
    """transformers' tokens for each request of ``case`` alone, and the EOS ids it stops at."""
    full = _model(CASES[case][5])
    return [reference(full, r) for r in CASES[case][3]()], eos_ids(full)


def _run(case: str, model, want, eos) -> None:
    _, slots, buckets, reqs, seed, _ = CASES[case]
    _check_trace(model, slots, buckets, reqs(), seed, want, eos)


def test_random_schedule_tp1():
    _run("trace", _model(), *_expected("trace"))


def test_freed_slot_reused_by_shorter_request():
    _run("reuse", _model(), *_expected("reuse"))


@pytest.mark.parametrize("case", ["qwen3", "gpt2"])
def test_other_architectures(case):
    _run(case, _model(CASES[case][5]), *_expected(case))


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
    with pytest.raises(ValueError, match="no gap"):  # positions 0..1 would hold stale keys
        gen.prefill(0, [1, 2], 2)
    with pytest.raises(ValueError, match="1..8 tokens"):
        gen.prefill(0, list(range(9)), 0)
    gen.release(0)
    with pytest.raises(ValueError, match="must be acquired"):
        gen.prefill(0, [1], 0)
    assert gen.acquire() == 0


def test_sliding_window_shorter_than_the_cache_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        sliding_window=40,
    )
    model = MistralForCausalLM(cfg).eval()
    with pytest.raises(ValueError, match=r"sliding window \(40 positions\) is shorter than the 41"):
        SlotGenerator(model, 2, max_len=40)
    SlotGenerator(model, 2, max_len=39)  # the window holds every position: accepted


def _gloo_case(case: str, wants: dict) -> None:
    from neuron_tp import hf

    model = hf.parallelize(_model(CASES[case][5]), gloo_dist.shared_mesh(CASES[case][0]))
    _run(case, model.eval(), *wants[case])


@pytest.fixture(scope="module")
def gloo_wants() -> dict:
    return {c: _expected(c) for c in GLOO}


@pytest.mark.parametrize("case", GLOO)
def test_tp2_tp4_gloo(case, gloo_wants):
    """4 gloo ranks: tp=2 (x dp 2) and tp=4 (fewer kv heads than ranks: replicated)."""
    gloo_dist.run_case(_gloo_case, case, gloo_wants, cases=GLOO, world_size=4)


@pytest.fixture(scope="module")
def xla_two_devices() -> list:
    """ONE launch on 2 XLA CPU devices: xla_slots_cases.serve_trace's results per rank."""
    import xla_slots_cases

    import xla_dist

    return xla_dist.run(xla_slots_cases.serve_trace, 2, 48, 5, devices=2)


def test_xla_two_devices_tp2_fixed_graphs(xla_two_devices):
    """tp=2 on 2 XLA CPU devices, replayed graphs: ~50 requests under a random schedule equal
    transformers per request; warm-up traced every graph (10: prefill bucket 8 greedy and
    sampled, decode buckets 2 and 4 each in the four variants without top_p) and the trace
    compiles nothing more."""
    res = xla_two_devices
    assert res[0]["tokens"] == res[1]["tokens"]
    (traces, compiles), after = res[0]["counts"]
    assert traces == 10 and after == (traces, compiles)
    full = _model()
    reqs = make_requests(5, 48, 20, 8)
    want = [reference(full, r) for r in reqs]
    bad = [(i, g, w, reqs[i]) for i, (g, w) in enumerate(zip(res[0]["tokens"], want)) if g != w]
    assert not bad, f"requests differ from transformers (index, got, want, request): {bad}"


def test_xla_two_devices_kv_split_by_sequence(xla_two_devices):
    """The same launch: a tiny Llama with one kv head at tp 2, its slot cache split by sequence
    (``kv_split="auto"``): a 1k-token prompt in chunks of 256 gives transformers' tokens on
    both devices, with the graphs of warm-up (6) only, and each rank holds half the KV bytes
    of the replicated layout (plus one scratch row)."""
    from xla_slots_cases import SPLIT_LONG

    from slot_trace import kv1_llama, long_request

    want = reference(kv1_llama(), long_request(SPLIT_LONG))
    for rank in (0, 1):
        split = xla_two_devices[rank]["split"]
        assert split["mode"] == "sequence" and split["tokens"] == want
        (traces, compiles), after = split["counts"]
        assert traces == 6 and after == (traces, compiles)
        seq, heads = split["bytes"]
        max_len = SPLIT_LONG + 16
        assert seq == heads // (max_len + 1) * (max_len // 2 + 1), (seq, heads)
        print(
            f"rank {rank}: KV bytes per rank {seq} (sequence) vs {heads} (heads); the case "
            f"took {split['seconds']:.1f} s of the launch"
        )
