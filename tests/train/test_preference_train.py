"""``neuron-tp train --objective dpo|orpo`` at tp=2 on gloo ranks follows TRL's DPOTrainer
training the unsharded model on the same four pairs (same AdamW, constant lr, clipping):
per-step loss, rewards/* and logps/* for 3 steps, the first DPO loss ln 2 (policy =
reference). ORPO: TRL's ORPOTrainer for the first step's odds-ratio terms (its NLL is over
prompt + completion), a written reference (the paper's, NLL on the completion) for 3 steps.
Cases: DPO sigmoid with the precomputed reference (and with --zero1), LoRA DPO (reference:
adapters disabled), ORPO, IPO resumed after step 2 (the stored reference read, not
recomputed), conversational pairs with an implicit prompt; the layouts beyond tp: sequence
parallel, blockwise attention, cp 2 (DPO, ORPO), pp 2 (DPO, LoRA DPO), with evaluations on
other pairs after every step (TRL's eval_* values); the reference a frozen sharded copy
(``--reference copy``, TRL's ref_model a copy) resumed after step 2 (the copy the initial
model again), also under cp 2 and with LoRA (the copy: the base without adapters). The 2D /
3D grids on 8 ranks: DPO at dp 2 x --tp-mode 2d (q=2; also the reference a frozen copy, with
evaluations after each step) and at --tp-mode 3d (q=2), ORPO at 3d;
an MoE model (tiny Mixtral, experts scaled so they decide the logits) with --ep 2: TRL's
DPOTrainer on the unsharded model (its router loss off). DPO at tp 2 (also SP, also with the
copy), cp 2, pp 2 and the MoE model at ep 2 on 2 XLA CPU devices: the same values, no compile
after step 2. Bad rows and unsupported layouts are refused before training."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import preference_reference as ref  # noqa: E402
from tiny_tokenizer import CHAT_TEMPLATE, bpe_tokenizer_dir  # noqa: E402

EVAL = ["--eval-data", "{base}/eval_pairs.jsonl", "--eval-every", "1"]
PP = ["--tp", "1", "--pp", "2", "--micro-batch", "2", "--grad-accum", "2"]
BLOCK = ["--attention-block", "16"]
MOE = ["--model", "{base}/moe", "--tp", "1", "--micro-batch", "2"]
# case: (our extra options, conversational pairs, TRL's run)
CASES = {
    "dpo": (["--objective", "dpo"], False, {"objective": "dpo"}),
    "dpo-zero1": (  # the pairs through the tokenized-data cache
        ["--objective", "dpo", "--zero1", "--data-cache", "{base}/cache"],
        False,
        {"objective": "dpo"},
    ),
    "dpo-lora": (
        ["--objective", "dpo", "--lora-r", "4", "--lora-alpha", "8"],
        False,
        {"objective": "dpo", "lora_r": 4},
    ),
    "orpo": (["--objective", "orpo"], False, {"objective": "orpo"}),
    "ipo-resume": (
        ["--objective", "dpo", "--dpo-loss", "ipo"],
        False,
        {"objective": "dpo", "loss_type": "ipo"},
    ),
    "dpo-chat": (["--objective", "dpo"], True, {"objective": "dpo"}),
    "hinge": (
        ["--objective", "dpo", "--dpo-loss", "hinge", "--beta", "0.5"],
        False,
        {"objective": "dpo", "loss_type": "hinge", "beta": 0.5},
    ),
    "dpo-bf16": (["--objective", "dpo", "--bf16"], False, {}),  # against our fp32 run
    "dpo-copy-bf16": (["--objective", "dpo", "--bf16", "--reference", "copy"], False, {}),
    # tp=1, dp=2, 1 pair per micro-batch, 2 micro-batches: the same 4 pairs a step
    "dpo-dp2-accum": (
        ["--objective", "dpo", "--tp", "1", "--micro-batch", "1", "--grad-accum", "2"],
        False,
        {"objective": "dpo"},
    ),
    # the layouts beyond tp 1d: sequence parallel, cp 2 (ring attention), pp 2 (2 micro-batches
    # of 2 pairs through the stages); evaluations after every step on other pairs
    "dpo-sp-eval": (["--objective", "dpo", "--sequence-parallel", *EVAL], False, {}),
    "dpo-cp-eval": (["--objective", "dpo", "--tp", "1", "--cp", "2", *EVAL], False, {}),
    "orpo-cp": (["--objective", "orpo", "--tp", "1", "--cp", "2"], False, {}),
    "dpo-pp-eval": (["--objective", "dpo", *PP, *EVAL], False, {}),
    "dpo-lora-pp": (["--objective", "dpo", *PP, "--lora-r", "4", "--lora-alpha", "8"], False, {}),
    "dpo-blockwise": (["--objective", "dpo", "--attention", "blockwise", *BLOCK], False, {}),
    # the reference a frozen sharded copy (TRL's ref_model: a copy), resumed after step 2:
    # the copy is again the initial model, not the checkpoint
    "dpo-copy-eval-resume": (["--objective", "dpo", "--reference", "copy", *EVAL], False, {}),
    "dpo-copy-cp": (
        ["--objective", "dpo", "--reference", "copy", "--tp", "1", "--cp", "2"],
        False,
        {},
    ),
    "dpo-lora-copy": (  # the copy has no adapters: the base, as TRL's peft reference
        ["--objective", "dpo", "--reference", "copy", "--lora-r", "4", "--lora-alpha", "8"],
        False,
        {},
    ),
    # an MoE model (tiny Mixtral) with its experts over 2 data-parallel ranks, 2 pairs each
    "dpo-moe-ep": (["--objective", "dpo", *MOE, "--ep", "2"], False, {"objective": "dpo"}),
}
# the 2D / 3D grids on 8 ranks (one launch): dp 2 x 2D q=2 (2 pairs a rank; also the
# reference a frozen copy, evaluations after every step), 3D q=2
GRID_2D = ["--objective", "dpo", "--tp", "4", "--tp-mode", "2d", "--micro-batch", "2"]
GRID_CASES = {
    "dpo-2d": GRID_2D,
    "dpo-copy-2d-eval": [*GRID_2D, "--reference", "copy", *EVAL],
    "dpo-3d": ["--objective", "dpo", "--tp", "8", "--tp-mode", "3d"],
    "orpo-3d": ["--objective", "orpo", "--tp", "8", "--tp-mode", "3d"],
}
GRID_WORLD = 8
TRL_RUNS = {"dpo", "dpo-lora", "orpo", "ipo-resume", "dpo-chat", "hinge"}  # zero1 reads "dpo"'s
TRL_OF = {"dpo-zero1": "dpo", "dpo-dp2-accum": "dpo", "dpo-sp-eval": "dpo", "dpo-cp-eval": "dpo"}
TRL_OF |= {"orpo-cp": "orpo", "dpo-pp-eval": "dpo", "dpo-lora-pp": "dpo-lora"}
TRL_OF |= {"dpo-blockwise": "dpo", "dpo-copy-eval-resume": "dpo", "dpo-copy-cp": "dpo"}
TRL_OF |= {"dpo-lora-copy": "dpo-lora", "dpo-2d": "dpo", "dpo-copy-2d-eval": "dpo"}
TRL_OF |= {"dpo-3d": "dpo", "orpo-3d": "orpo"}
EVAL_KEYS = tuple(f"eval_{k}" for k in ("loss", *ref.KEYS))


def _mesh(extra: list[str]):
    """This rank's shared mesh of a case's options (tp 2 unless given)."""
    got: dict = {"--tp": 2, "--cp": 1, "--pp": 1, "--ep": 1, "--tp-mode": "1d"}
    for flag in got:
        if flag in extra:
            value = extra[extra.index(flag) + 1]
            got[flag] = value if flag == "--tp-mode" else int(value)
    kw = {k[2:].replace("-", "_"): v for k, v in got.items() if k != "--tp"}
    return gloo_dist.shared_mesh(got["--tp"], **kw)


def _trl_reference(base: str) -> None:
    """Every TRL run, in a fresh process without torch-xla (accelerate would take its device)."""
    from transformers import AutoTokenizer

    from moe_archs import build_moe, loud_experts

    vocab = len(AutoTokenizer.from_pretrained(f"{base}/tok"))
    moe = build_moe("mixtral", vocab_size=vocab, max_position_embeddings=64)
    loud_experts(moe).save_pretrained(f"{base}/moe")
    out = {"dpo-moe-ep": ref.trl_run(f"{base}/pairs.jsonl", f"{base}/tok", f"{base}/trl-moe",
                                     model_dir=f"{base}/moe")}  # fmt: skip
    for case in sorted(TRL_RUNS):
        _, chat, kw = CASES[case]
        pairs = f"{base}/chat_pairs.jsonl" if chat else f"{base}/pairs.jsonl"
        if case == "dpo":  # with an evaluation after each step
            kw = {**kw, "eval_pairs": f"{base}/eval_pairs.jsonl"}
        out[case] = ref.trl_run(pairs, f"{base}/tok", f"{base}/trl-{case}", **kw)
    out["orpo-written"] = ref.orpo_written(f"{base}/pairs.jsonl", f"{base}/tok")
    with open(f"{base}/trl.json", "w") as f:
        json.dump(out, f)


def _copy_state(run) -> dict:
    """What the ``--reference copy`` model is after a step: frozen, in eval mode, unknown
    to the optimizer, another set of tensors than the policy's."""
    copy = run.reference_model
    trained = {id(p) for g in run.optimizer.param_groups for p in g["params"]}
    policy = {p.data_ptr() for p in run.model.parameters()}
    return {
        "frozen": all(not p.requires_grad for p in copy.parameters()),
        "eval": not copy.training,
        "in_optimizer": any(id(p) in trained for p in copy.parameters()),
        "shares_policy": any(p.data_ptr() in policy for p in copy.parameters()),
    }


def _ours(base: str, grid: bool = False) -> None:
    """Rank body: every case of :data:`CASES` (at tp=2 unless given), or of
    :data:`GRID_CASES`; rank 0 writes the logs."""
    from neuron_tp.cli.args import train_parser
    from neuron_tp.train.loop import train

    logs, notes = {}, {}
    cases = {k: (v, False, {}) for k, v in GRID_CASES.items()} if grid else CASES
    for case, (extra, chat, _) in cases.items():
        extra = [x.format(base=base) for x in extra]
        mesh = _mesh(extra)
        pairs = f"{base}/chat_pairs.jsonl" if chat else f"{base}/pairs.jsonl"
        argv = ["--device", "cpu", "--tp", "2", "--micro-batch", "4", "--data", pairs]
        argv += ["--tokenizer", f"{base}/tok", *ref.ARGS, *extra, "--output-dir", f"{base}/{case}"]
        lines: list[str] = []

        def say(*a, **_k):
            lines.append(" ".join(map(str, a)))

        states: list[dict] = []

        def on_step(run, states=states):
            if run.reference_model is not None:
                states.append(_copy_state(run))

        if case.endswith("resume"):  # 2 steps and a checkpoint, then a new run resumes it
            first = train_parser().parse_args([*argv, "--save-every", "2"])
            head = train(first, mesh, stop_at=2, printer=say, on_step=on_step)["log"]
            tail = train(train_parser().parse_args(argv), mesh, printer=say, on_step=on_step)
            logs[case] = head + tail["log"]
        else:
            logs[case] = train(train_parser().parse_args(argv), mesh, printer=say)["log"]
        notes[case] = [x for x in lines if "reference log-probabilities" in x]
        if states:
            notes[f"{case}/copy"] = states
    if mesh.rank == 0:
        with open(f"{base}/ours{'-grid' if grid else ''}.json", "w") as f:
            json.dump({"logs": logs, "notes": notes}, f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    base = str(tmp_path_factory.mktemp("preference"))
    bpe_tokenizer_dir(f"{base}/tok", 300, chat_template=CHAT_TEMPLATE)
    ref.write_pairs(base)
    ref.write_pairs(base, conversational=True)
    ref.write_pairs(base, evaluation=True)
    env = {**os.environ, "USE_TORCH_XLA": "0"}
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.dirname(os.path.dirname(here)), os.path.dirname(ref.__file__), here]
    code = f"import sys; sys.path[:0] = {paths!r}; import test_preference_train as t; "
    code += f"t._trl_reference({base!r})"
    trl = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert trl.returncode == 0, trl.stderr[-3000:]
    gloo_dist.run(_ours, base, world_size=2)
    gloo_dist.run(_ours, base, True, world_size=GRID_WORLD, timeout=600)
    with open(f"{base}/trl.json") as f, open(f"{base}/ours.json") as g:
        trl, ours = json.load(f), json.load(g) | {"base": base}
    with open(f"{base}/ours-grid.json") as g:
        grid = json.load(g)
    ours["logs"] |= grid["logs"]
    ours["notes"] |= grid["notes"]
    return trl, ours


def _compare(ours: list[dict], theirs: list[dict], keys=("loss", *ref.KEYS), tol=2e-5):
    assert [e["step"] for e in ours] == [1, 2, 3]
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True), 1):
        for k in keys:
            assert math.isclose(a[k], float(b[k]), rel_tol=tol, abs_tol=tol), (step, k, a[k], b[k])
            worst = max(worst, abs(a[k] - float(b[k])))
    print(f"max |ours - reference| over {len(keys)} values x 3 steps: {worst:.2e}")


@pytest.mark.parametrize("case", [c for c in [*CASES, *GRID_CASES] if "bf16" not in c])
def test_matches_trl(runs, case):
    trl, ours = runs
    theirs = trl[TRL_OF.get(case, case)]
    keys = ("loss", *ref.KEYS) + (EVAL_KEYS if "eval" in case else ())
    if case.startswith("orpo"):  # TRL's NLL is over prompt + completion: its first step's odds
        odds = [k for k in keys if k != "loss"] + ["log_odds_ratio", "log_odds_chosen"]
        for k in odds:
            assert ours["logs"][case][0][k] == pytest.approx(float(theirs[0][k]), abs=2e-5), k
        theirs, keys = trl["orpo-written"], (*keys, "nll_loss", "log_odds_ratio")
    _compare(ours["logs"][case], theirs, keys)
    if case.startswith("dpo"):  # sigmoid: ln 2 at z = 0
        assert ours["logs"][case][0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    margins = [e["rewards/margins"] for e in ours["logs"][case]]
    assert margins[-1] > margins[0]  # it learns the preference


def test_bf16(runs):
    """--bf16 (ZeRO-1 fp32 masters): ln 2 first, then it learns the preference like the fp32
    run (bf16 weights and compute: the trajectories part at this learning rate); with
    ``--reference copy`` (a bf16 copy) the same values as with the precomputed reference."""
    _, ours = runs
    bf16, fp32 = ours["logs"]["dpo-bf16"], ours["logs"]["dpo"]
    assert bf16[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert bf16[0]["logps/chosen"] == pytest.approx(fp32[0]["logps/chosen"], rel=0.02)
    assert all(e["loss"] < math.log(2) and e["rewards/accuracies"] == 1.0 for e in bf16[1:])
    assert all(e["rewards/margins"] > 0.1 for e in bf16[1:])
    # the frozen bf16 copy forwards the pairs as the precomputation pass did: the same run
    copy = ours["logs"]["dpo-copy-bf16"]
    for a, b in zip(copy, bf16, strict=True):
        for k in ("loss", *ref.KEYS):
            assert a[k] == pytest.approx(b[k], abs=1e-6), (a["step"], k)


def test_reference_stored_and_read(runs):
    _, ours = runs
    notes = ours["notes"]
    assert len(notes["ipo-resume"]) == 2, notes
    assert "computed" in notes["ipo-resume"][0] and "read from" in notes["ipo-resume"][1]
    assert len(notes["dpo"]) == 1 and "4 pairs computed" in notes["dpo"][0]
    assert notes["dpo-lora"] == []  # the base with the adapters disabled: no pass
    assert notes["orpo"] == []  # no reference
    copy = "dpo-copy-eval-resume"  # a copy forwarded at each step: no pass, no file
    assert notes[copy] == [] and not os.path.exists(f"{ours['base']}/{copy}/reference_logps.pt")
    assert len(notes[f"{copy}/copy"]) == 3  # steps 1-2, then step 3 resumed
    expected = {"frozen": True, "eval": True, "in_optimizer": False, "shares_policy": False}
    assert all(state == expected for state in notes[f"{copy}/copy"]), notes[f"{copy}/copy"]
    assert os.path.exists(f"{ours['base']}/dpo/reference_logps.pt")
    with open(f"{ours['base']}/orpo/metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [e["step"] for e in lines] == [1, 2, 3]
    assert {*ref.KEYS, "nll_loss", "log_odds_ratio", "log_odds_chosen"} <= set(lines[0])
    assert lines[-1]["nll_loss"] == ours["logs"]["orpo"][-1]["nll_loss"]


def test_label_smoothing_is_conservative_dpo():
    """--label-smoothing ε (TRL's sigmoid loss has none): the conservative-DPO loss, the
    expected sigmoid loss when each preference is flipped with probability ε."""
    import torch

    from neuron_tp.cli.args import train_parser
    from neuron_tp.job.config import TrainConfig
    from neuron_tp.train.preference import preference_loss

    argv = ["--objective", "dpo", "--beta", "0.3", "--label-smoothing", "0.2"]
    config = TrainConfig.from_args(train_parser().parse_args(argv))
    g = torch.Generator().manual_seed(0)
    pc, pr, c0, r0 = (-20 * torch.rand(5, generator=g) for _ in range(4))
    n = torch.full((5,), 7.0)
    losses, metrics = preference_loss(config, (pc, pr, n, n), (c0, r0))
    z = 0.3 * ((pc - c0) - (pr - r0))
    p = torch.sigmoid(z)
    expected = -(0.8 * torch.log(p) + 0.2 * torch.log(1 - p))
    torch.testing.assert_close(losses, expected)
    torch.testing.assert_close(metrics[:, 3], z)  # rewards/margins


def test_bad_rows_refused(tmp_path):
    from neuron_tp.errors import UserError
    from neuron_tp.job.data import ByteTokenizer
    from neuron_tp.job.pairs import pair_rows

    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"prompt": "a", "chosen": "b", "rejected": "c"}\n{"prompt": "a", "chosen": "b"}\n'
    )
    with pytest.raises(UserError, match=r"bad.jsonl:2: expected a preference pair"):
        pair_rows(str(bad), ByteTokenizer(), 16)
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 40, "chosen": "b", "rejected": "c"}) + "\n")
    with pytest.raises(UserError, match=r"long.jsonl:1: the chosen completion has no token"):
        pair_rows(str(long), ByteTokenizer(), 16)
    chat = tmp_path / "chat.jsonl"
    u = {"role": "user", "content": "hi"}
    chat.write_text(json.dumps({"chosen": [u], "rejected": [u]}) + "\n")
    from neuron_tp.job.pairs import encode_pair

    with pytest.raises(UserError, match="has no message after the prompt"):
        encode_pair(json.loads(chat.read_text()), None, "chat.jsonl:1")


def test_pairs_data_cache(tmp_path):
    """--data-cache: the pairs' rows written once, then read (memory-mapped), equal to the rows
    tokenized directly."""
    from neuron_tp.job.data import ByteTokenizer
    from neuron_tp.job.pairs import load_pairs, pair_rows

    data = tmp_path / "pairs.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"q{i}", "chosen": "yes" * i, "rejected": "no"}) + "\n"
            for i in range(1, 4)
        )
    )
    tok, cache = ByteTokenizer(), str(tmp_path / "cache")
    want, _ = pair_rows(str(data), tok, 16)
    first = load_pairs(str(data), tok, 16, 1, cache=cache)
    again = load_pairs(str(data), tok, 16, 1, cache=cache)
    assert "(written)" in first.notes[-1] and "(read)" in again.notes[-1]
    for k, v in want.items():
        assert torch.equal(again.rows[k], v), k


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--tp-mode", "2d", "--tp", "4", "--pp", "2"], r"--pp > 1 with --tp-mode 2d: the last"),
        (["--pp", "2", "--cp", "2"], r"does not support --pp > 1 with --cp > 1"),
        (["--dpo-loss", "ipo", "--label-smoothing", "0.1"], "sigmoid only"),
        (["--reference", "copy", "--pp", "2"], r"--reference copy does not combine with --pp 2"),
        (["--reference", "adapters"], r"--reference adapters needs --lora-r"),
        (["--objective", "orpo", "--reference", "copy"], r"--reference applies to --objective dpo"),
    ],
)
def test_unsupported_refused(tmp_path, extra, match):
    from neuron_tp.cli.args import train_parser
    from neuron_tp.errors import UserError
    from neuron_tp.train.loop import train

    args = train_parser().parse_args(
        ["--device", "cpu", "--objective", "dpo", "--output-dir", str(tmp_path), *extra]
    )
    with pytest.raises(UserError, match=match):
        train(args)  # refused before the process group or any collective exists


@pytest.fixture(scope="module")
def xla_runs(runs):
    """Every case of xla_preference_cases.py in one launch on 2 XLA CPU devices."""
    import xla_preference_cases as cases

    import xla_dist

    return xla_dist.run_cases(cases.on_two, list(cases.CASES), runs[1]["base"], devices=2)


@pytest.mark.parametrize(
    "case", ["dpo", "dpo-sp-eval", "dpo-cp-eval", "dpo-pp-eval", "dpo-copy", "dpo-moe-ep"]
)
def test_xla_two_devices(runs, xla_runs, case):
    """DPO on 2 XLA CPU devices (real collectives, one graph per step; --pp: a fixed set per
    stage): tp 2, with --sequence-parallel, --cp 2, --pp 2, evaluations after each step, the
    reference a frozen copy: TRL's values for 3 steps; the reference pass and steps 1-2
    compile, step 3 (and 4) do not."""
    trl, _ = runs
    out = xla_runs.get(case)
    keys = ("loss", *ref.KEYS) + (EVAL_KEYS if "eval" in case else ())
    theirs = trl["dpo-moe-ep" if case == "dpo-moe-ep" else "dpo"]
    _compare(out[0]["log"][:3], theirs, keys, tol=1e-4)  # XLA:CPU rounds differently
    compiles = {e["step"]: e["compiles"] for e in out[0]["per_step"]}
    assert compiles[2] > 0 and compiles[3] == compiles[2], compiles
    assert compiles.get(4, compiles[3]) == compiles[3], compiles


def test_check_reads_pairs(tmp_path, capsys):
    """``--check`` reads the pairs as training would: an SFT file is named as not pairs."""
    from neuron_tp.cli.entry import main

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    base = ["train", "--check", "--device", "cpu", "--objective", "dpo", "--micro-batch", "2"]
    base += ["--output-dir", str(tmp_path)]
    assert main([*base, "--data", f"{root}/examples/preference/pairs.jsonl"]) in (0, None)
    assert "--check: ok" in capsys.readouterr().out
    code = main([*base, "--data", f"{root}/examples/sft/chat.jsonl"])
    assert code not in (0, None)
    assert "chat.jsonl:1: expected a preference pair" in capsys.readouterr().out


@pytest.mark.parametrize("reference", ["precompute", "copy"])
def test_traced_under_neuron_parallel_compile(tmp_path, monkeypatch, reference):
    """``neuron_parallel_compile``'s trial run (graphs traced, no reference pass): the DPO
    step traces without a stored reference (the graph's shape only) or with the copy."""
    from neuron_tp.cli.args import train_parser
    from neuron_tp.train.loop import train

    monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", "1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    argv = ["--device", "cpu", "--objective", "dpo", "--reference", reference, "--steps", "2"]
    argv += ["--data", f"{root}/examples/preference/pairs.jsonl", "--seq-len", "64"]
    argv += ["--micro-batch", "2", "--output-dir", str(tmp_path)]
    summary = train(train_parser().parse_args(argv), printer=lambda *a, **k: None)
    assert summary["extract_graphs_only"] and summary["steps"] == 2
    assert not os.path.exists(tmp_path / "reference_logps.pt")
