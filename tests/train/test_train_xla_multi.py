"""The training entry point executed on several XLA CPU devices (the path Trainium runs, with
real collectives between ranks): tp=2 and tp2 x dp2 (SP, grad accumulation) against the
independent single-process reference and the same run on gloo ranks, step by step; graphs
compiled per rank; host transfers only at log steps and checkpoint saves; replicated
parameters (Qwen3's q/k norms) identical on every rank; a checkpoint saved on XLA at tp=2
resumes bit-identically and reshards to tp=1 and tp=4.

The XLA runs are the cases of two launches (2 and 4 devices, xla_multi_train_cases.ON_TWO /
ON_FOUR), the gloo runs the cases of two more: each test reads its own case's results."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import xla_multi_train_cases as cases  # noqa: E402

import gloo_dist  # noqa: E402
import xla_dist  # noqa: E402
from reference_train import reference_run  # noqa: E402

N_PARAMS = {"tiny-llama": 21, "tiny-qwen3": 25}
GLOO_TWO = {  # the runs of the 2-rank gloo launch
    "qwen3": cases.QWEN3,
    "recompute-selective": cases.RECOMPUTE_BASE + ["--activation-checkpointing", "selective"],
}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("train_xla_multi"))


@pytest.fixture(scope="module")
def two(base) -> xla_dist.Cases:
    """The 2-device launch: every case of ``cases.ON_TWO``, in order."""
    return xla_dist.run_cases(cases.on_two, cases.ON_TWO, base, devices=2)


@pytest.fixture(scope="module")
def four(base, two) -> xla_dist.Cases:
    """The 4-device launch (after ``two``: ``qwen3-tp4`` resumes its checkpoint)."""
    return xla_dist.run_cases(cases.on_four, cases.ON_FOUR, base, devices=4)


def _gloo_case(case: str, base: str) -> None:
    """One run of the 2-rank gloo launch (``GLOO_TWO``), or the 4-rank tp2 x dp2 run."""
    from neuron_tp.train.loop import train

    extra = cases.DP2_SP if case == "tp2-dp2-sp" else GLOO_TWO[case]
    mesh = gloo_dist.shared_mesh(2)
    args = cases.args_for(f"{base}/gloo-{case}", "--tp", "2", *extra)
    args.device = "cpu"
    s = train(args, mesh, printer=lambda *a, **k: None)
    if mesh.rank == 0:
        torch.save(s["log"], f"{base}/gloo-{case}.pt")


def _gloo_log(base: str, case: str) -> list[dict]:
    """The log of the gloo run ``case`` (the runs of its launch are made on first use)."""
    if case == "tp2-dp2-sp":
        gloo_dist.run_case(_gloo_case, case, base, cases=(case,), world_size=4)
    else:
        gloo_dist.run_case(_gloo_case, case, base, cases=tuple(GLOO_TWO), world_size=2)
    return torch.load(f"{base}/gloo-{case}.pt")


def _check_same_replicas(results, tp: int) -> None:
    """Every replicated parameter is bit-identical on all ranks (no partial-gradient drift)."""
    first = results[0]["replicated"]
    assert first, "no replicated parameter recorded"
    for r in results[1:]:
        for name, t in first.items():
            assert torch.equal(r["replicated"][name], t), f"{name} differs on rank {r['rank']}"


def _at(values: list[float], steps: list[int]) -> list[float]:
    return [values[s - 1] for s in steps]


def _moved(per: list[dict]) -> list[float]:
    """Host transfers of steps 2.. per rank (process-wide counters / 2 ranks)."""
    return [
        (per[i]["transfers_to_host"] - per[i - 1]["transfers_to_host"]) / 2
        for i in range(1, len(per))
    ]


def test_tp2_qwen3_on_two_xla_devices_resume_and_reshard(two, four, base):
    got = two.get("qwen3")
    res = [r["first"] for r in got]
    log = res[0]["log"]
    steps = [e["step"] for e in log]
    assert steps == [2, 4, 6, 8]
    assert [(e["loss"], e["grad_norm"]) for e in res[1]["log"]] == [
        (e["loss"], e["grad_norm"]) for e in log
    ]  # every rank sees the same values
    args = cases.args_for(f"{base}/ref-qwen3", "--tp", "2", *cases.QWEN3)
    losses, norms = reference_run(args, global_micro_batch=2)
    torch.testing.assert_close([e["loss"] for e in log], _at(losses, steps), rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(
        [e["grad_norm"] for e in log], _at(norms, steps), rtol=2e-3, atol=1e-5
    )
    gloo = _gloo_log(base, "qwen3")
    torch.testing.assert_close(
        [e["loss"] for e in log], [e["loss"] for e in gloo], rtol=1e-4, atol=1e-4
    )
    torch.testing.assert_close(
        [e["grad_norm"] for e in log], [e["grad_norm"] for e in gloo], rtol=1e-3, atol=1e-5
    )
    _check_same_replicas(res, 2)
    # per rank (process-wide counters / 2): no compile after step 2; host reads only at log
    # steps (loss + grad norm) and in the step-4 checkpoint (counted with step 5)
    per = res[0]["per_step"]
    compiles = [p["compiles"] // 2 for p in per]
    assert compiles[1:] == [compiles[1]] * 7 and 1 <= compiles[1] <= 8, compiles
    moved = _moved(per)  # steps 2..8
    assert [m for i, m in enumerate(moved, 2) if i != 5] == [2, 0, 2, 2, 0, 2], moved
    assert moved[3] >= 4 * N_PARAMS["tiny-qwen3"], moved  # params + AdamW step/m/v

    # resume the step-4 checkpoint written on XLA: steps 6 and 8 bit-identical
    again = got[0]["again"]
    assert [e["step"] for e in again["log"]] == [6, 8]
    assert again["log"][0]["loss"] == log[2]["loss"]
    assert again["log"][1]["loss"] == log[3]["loss"]
    assert again["log"][1]["grad_norm"] == log[3]["grad_norm"]

    # reshard: tp=4 (kv heads replicated) on 4 devices resumes the same checkpoint
    tp4 = four.get("qwen3-tp4")
    torch.testing.assert_close(
        [e["loss"] for e in tp4[0]["log"]], [e["loss"] for e in log[2:]], rtol=1e-4, atol=1e-4
    )
    # and tp=1: the unsharded model loaded from the XLA checkpoint gives the loss of step 5
    import neuron_tp as ntp
    from neuron_tp import checkpoint
    from neuron_tp.job.data import ByteTokenizer, PackedData
    from neuron_tp.job.presets import build_model

    ckpt4 = next(c for c in res[0]["checkpoints"] if c.endswith("step-00000004"))
    plain = build_model("tiny-qwen3", 257, seed=123)
    checkpoint.load(ckpt4, plain, mesh=ntp.Mesh(1, 0), restore_rng=False)
    data = PackedData(
        args.data, ByteTokenizer(), args.seq_len, 2, dp_size=1, dp_rank=0, seed=args.seed
    )
    for _ in range(5):
        ids = data.next_batch()["input_ids"]
    with torch.no_grad():
        loss5 = plain(input_ids=ids, labels=ids).loss.item()
    assert abs(loss5 - losses[4]) < 2e-4, (loss5, losses[4])


def test_tp2_dp2_sp_grad_accum_on_four_xla_devices(four, base):
    res = four.get("tp2-dp2-sp")
    log = res[0]["log"]
    args = cases.args_for(f"{base}/ref-dp2", "--tp", "2", *cases.DP2_SP)
    losses, norms = reference_run(args, global_micro_batch=4)
    torch.testing.assert_close([e["loss"] for e in log], losses, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close([e["grad_norm"] for e in log], norms, rtol=2e-3, atol=1e-5)
    gloo = _gloo_log(base, "tp2-dp2-sp")
    torch.testing.assert_close(
        [e["grad_norm"] for e in log], [e["grad_norm"] for e in gloo], rtol=1e-3, atol=1e-5
    )
    _check_same_replicas(res, 2)


def test_pp2_tp2_sp_on_four_xla_devices_equals_tp2(four, base):
    """``--pp 2 --tp 2 --sequence-parallel`` on four XLA CPU devices, on the rows of the
    ``--tp 2`` x dp 2 run (one micro-batch of 4 = its two dp ranks' 2): that run's losses and
    grad norms, and the independent reference's, at every step (the lr copied into the device
    lr between the stages' graph cuts included); nothing compiles after step 2."""
    res = four.get("pp2-tp2-sp")
    log = res[0]["log"]
    assert [[e["loss"] for e in r["log"]] for r in res[1:]] == [[e["loss"] for e in log]] * 3
    tp2 = four.get("tp2-dp2-sp")[0]["log"][:3]  # the same rows and learning rates
    for key, tol in (("loss", 1e-4), ("grad_norm", 1e-3)):
        torch.testing.assert_close(
            [e[key] for e in log], [e[key] for e in tp2], rtol=tol, atol=1e-5
        )
    args = cases.args_for(f"{base}/ref-pp2", "--tp", "2", *cases.PP2_SP)
    losses, norms = reference_run(args, global_micro_batch=4)
    torch.testing.assert_close([e["loss"] for e in log], losses, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close([e["grad_norm"] for e in log], norms, rtol=2e-3, atol=1e-5)
    compiles = [p["compiles"] for p in res[0]["per_step"]]
    assert len(compiles) == 3 and compiles[1] == compiles[2], compiles


def test_ranks_with_different_step_graphs_fail_instead_of_hanging(two):
    for e in two.get("rank1-differs"):  # every rank raises the same clear error
        assert "ranks traced different step graphs" in e, e
        assert "ranks [0] | ranks [1]" in e and "first difference (ranks 0 vs 1) at op" in e, e


def test_tp2_generation_on_two_xla_devices_equals_transformers(two):
    """Greedy and sampled decoding of a tp=2 tiny Llama, executed on two XLA CPU devices: the
    tokens of transformers' own ``generate`` on the unsharded model (same seed for sampling),
    the same on both ranks, per-sequence EOS and batch buckets, and no new trace or graph for
    more tokens."""
    from hf_sampling import hf_sample
    from neuron_tp.job.presets import build_model

    res = two.get("generate")
    assert res[0] == res[1]
    full = build_model("tiny-llama", 257, 4).eval()

    def hf_greedy(prompts, n, **kw):
        return [
            full.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, **kw)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]

    for key, n in (("greedy", 10), ("greedy_long", 20)):
        assert res[0][key] == hf_greedy(cases.GEN_PROMPTS, n), key
    ref = hf_sample(full, cases.GEN_PROMPTS, 10, temperature=0.8, top_k=20, seed=9)
    assert res[0]["sample"] == ref and ref != res[0]["greedy"]
    # per-sequence EOS inside one batch: rows end at their own EOS, the others run on
    eos = hf_greedy(cases.GEN_PROMPTS, 20, eos_token_id=cases.GEN_EOS, pad_token_id=0)
    assert res[0]["eos"] == eos and sorted(map(len, eos)) == [3, 6, 20], eos
    assert res[0]["single"] == res[0]["greedy_long"][1:2]  # batch bucket 1
    (t0, c0), (t1, c1), (t2, c2), (t3, c3), (t4, c4) = res[0]["counts"]
    assert t0 == 2  # one prefill and one decode trace for 10 tokens: replayed, not re-traced
    assert (t1, c1) == (t0, c0)  # 20 tokens: the same graphs, no trace, no compile
    assert t2 == t1 + 2 and c2 > c1  # sampling: its own prefill and decode graphs
    assert (t3, c3) == (t2, c2)  # EOS ids are data: the greedy graphs again
    assert t4 == t3 + 2  # batch bucket 1: its own graphs


@pytest.fixture(scope="module")
def no_recompute_ref(base) -> tuple[list[float], list[float]]:
    """The reference of the recompute runs: losses and grad norms without recompute."""
    args = cases.args_for(f"{base}/ref-recompute", "--tp", "2", *cases.RECOMPUTE_BASE)
    return reference_run(args, global_micro_batch=2)


@pytest.mark.parametrize("case", list(cases.RECOMPUTE))
def test_activation_recompute_trains_like_the_reference_on_xla(two, no_recompute_ref, case):
    """--activation-checkpointing full with SP at tp=2 on two XLA CPU devices:
    the losses and grad norms of the run without recompute (the independent unsharded
    reference), step by step; the recompute is really in the graph (tests/hf/test_recompute.py
    checks the compiled HLO)."""
    losses, norms = no_recompute_ref
    log = two.get(case)[0]["log"]
    torch.testing.assert_close([e["loss"] for e in log], losses, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close([e["grad_norm"] for e in log], norms, rtol=2e-3, atol=1e-5)


def test_activation_recompute_trains_like_the_reference_on_gloo(base, no_recompute_ref):
    """--activation-checkpointing selective at tp=2 on gloo ranks: the reference's losses and
    grad norms."""
    losses, norms = no_recompute_ref
    gloo = _gloo_log(base, "recompute-selective")
    torch.testing.assert_close([e["loss"] for e in gloo], losses, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close([e["grad_norm"] for e in gloo], norms, rtol=2e-3, atol=1e-5)


def test_zero1_dp2_on_two_xla_devices_vs_reference_and_resume(two, base):
    """--zero1 at tp=1 x dp=2 on two XLA CPU devices: the reference's losses and grad norms;
    one graph per step (the checkpoint's dp gather compiles once, at the first save); host
    reads only at log steps and saves; the step-4 checkpoint resumes to the same losses."""
    got = two.get("zero1")
    log = got[0]["first"]["log"]
    steps = [e["step"] for e in log]
    assert steps == [2, 4, 6, 8]
    args = cases.args_for(f"{base}/ref-zero1", "--tp", "1", *cases.ZERO1)
    losses, norms = reference_run(args, global_micro_batch=2)
    torch.testing.assert_close([e["loss"] for e in log], _at(losses, steps), rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(
        [e["grad_norm"] for e in log], _at(norms, steps), rtol=2e-3, atol=1e-5
    )
    per = got[0]["first"]["per_step"]
    compiles = [p["compiles"] // 2 for p in per]
    assert compiles[1:4] == [compiles[1]] * 3, compiles  # steps 2..4: one step graph
    assert compiles[4:] == [compiles[4]] * 4, compiles  # after the first save: none new
    moved = _moved(per)  # steps 2..8
    assert [m for i, m in enumerate(moved, 2) if i != 5] == [2, 0, 2, 2, 0, 2], moved
    again = got[0]["again"]["log"]
    assert [e["step"] for e in again] == [6, 8]
    torch.testing.assert_close(
        [e["loss"] for e in again], [e["loss"] for e in log[2:]], rtol=1e-5, atol=1e-5
    )


def test_lora_training_on_two_xla_devices_vs_unsharded_peft(two, base):
    """``--lora-r`` at tp=2 with SP on two XLA CPU devices: the losses and adapter-gradient
    norms of the unsharded peft model trained the same way, step by step; no new graph after
    the first steps; the adapters saved in PEFT's format at the end."""
    res = two.get("lora")
    log = res[0]["log"]
    args = cases.args_for(f"{base}/ref-lora", "--tp", "2", *cases.LORA)
    losses, norms = reference_run(args, global_micro_batch=2)
    torch.testing.assert_close([e["loss"] for e in log], losses, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close([e["grad_norm"] for e in log], norms, rtol=2e-3, atol=1e-5)
    per = res[0]["per_step"]
    assert per[-1]["compiles"] == per[2]["compiles"], per  # steps 4-6 reuse the step graph
    adapter = os.path.join(base, "lora", "xla", "adapter")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(adapter))
