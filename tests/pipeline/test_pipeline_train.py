"""``neuron-tp train --pp`` on 4 gloo ranks (one launch) against the independent single-process
reference (plain transformers + torch AdamW / LambdaLR / clip_grad_norm_ on the same global
batch, the same reference ``--tp 2`` is checked against): --pp 2 --tp 2 with sequence
parallelism and --pp 4 (1F1B), --pp 2 --tp 2 interleaved (2 chunks per stage), --pp 2 x dp 2
with ZeRO-1, --tp 4 (pp 1, the source of the pp 1 -> pp 2 resume), and LoRA at --pp 2 --tp 2
(the reference: the unsharded peft model; the adapters saved at the end, one PEFT file joined
from the stages, equal to the reference's).

In the same launch, the SFT data path with evaluation: --pp 2 --tp 2 interleaved and --pp 4
on packed prompt/completion rows (answer-only loss, micro-batches of different label counts)
with --eval-data every 2 steps, against the --pp 1 run of the same options (whose packing and
eval losses tests/train/test_sft_*.py and test_evaluate.py check against plain transformers):
the same step losses, gradient norms and eval losses on every rank.

Stage checkpoints, in the same launch, from those runs' ``--save-every 2`` checkpoints (tiny
Llama, tied embeddings): a SIGTERM on one last-stage rank stops every rank after step 2 and
saves; resuming that at the same layout continues with the uninterrupted run's losses, bit for
bit (AdamW and ZeRO-1); a pp 2 checkpoint resumes at pp 1 / tp 4 (ZeRO-1: pp 1 / tp 2) and a
pp 1 / tp 4 one at pp 2 / tp 2, continuing the source run's losses; the pp 2 checkpoint's files
(each stage its own layers, the tied table once) consolidate into the same HF directory (names,
config, tensors) and the same optimizer state as the pp 1 run's."""

from __future__ import annotations

import functools
import json
import os
import random

import pytest
import torch

import gloo_dist
from neuron_tp.train.loop import train
from reference_train import reference_run
from train_cpu import losses, quiet, train_args

LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules", "q_proj,v_proj,down_proj"]
RUNS = {
    "pp2_tp2_sp": ["--pp", "2", "--tp", "2", "--sequence-parallel", "--save-every", "2"],
    "pp4": ["--pp", "4"],
    "pp2_tp2_interleaved": [
        "--pp",
        "2",
        "--tp",
        "2",
        "--pp-schedule",
        "interleaved",
        "--virtual-stages",
        "2",
    ],
    "pp2_dp2_zero1": ["--pp", "2", "--zero1", "--micro-batch", "1", "--save-every", "2"],
    "pp2_tp2_lora": ["--pp", "2", "--tp", "2", *LORA],
}
SFT_RUNS = {
    "pp2_tp2_interleaved_sft_eval": RUNS["pp2_tp2_interleaved"],
    "pp4_sft_eval": RUNS["pp4"],
}
BASE = ["--micro-batch", "2", "--grad-accum", "4", "--steps", "4", "--model", "tiny-llama-4l"]
# each resume: the run whose checkpoint it reads (and whose losses it continues), the step,
# its own options; "exact": at the same layout, bit for bit
RESUMES = {
    "sigterm_resume_pp2_tp2": ("pp2_tp2_sp", 2, RUNS["pp2_tp2_sp"]),
    "resume_pp2_at_tp4": ("pp2_tp2_sp", 2, ["--tp", "4", "--save-every", "1"]),
    "resume_tp4_at_pp2": ("resume_pp2_at_tp4", 3, RUNS["pp2_tp2_sp"]),
    "resume_pp2_zero1_exact": ("pp2_dp2_zero1", 2, RUNS["pp2_dp2_zero1"]),
    "resume_pp2_zero1_at_tp2": ("pp2_dp2_zero1", 2, ["--tp", "2", "--zero1", "--micro-batch", "1"]),
}
CASES = (*RUNS, *SFT_RUNS, *RESUMES, "consolidate")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _write(out: str, case: str, summary: dict) -> None:
    log = {
        "loss": losses(summary),
        "norm": [e["grad_norm"] for e in summary["log"]],
        "eval": [e["eval_loss"] for e in summary["log"] if "eval_loss" in e],
        "steps": [e["step"] for e in summary["log"]],
        "checkpoints": summary["checkpoints"],
        "stopped_by": summary["stopped_by"],
    }
    with open(f"{out}/{case}-rank{_rank()}.json", "w") as f:
        json.dump(log, f)


def _sigterm_then_resume(case: str, out: str) -> None:
    """Rank 3 (a last-stage rank) is signalled after step 2: every rank stops and saves there
    (no periodic save); the next run resumes the newest checkpoint (--resume auto)."""
    from neuron_tp.train.preempt import StopSignal

    _, _, extra = RESUMES[case]
    stop = StopSignal()

    def signal_at_2(run) -> None:
        if run.step == 2 and run.mesh.rank == 3:
            stop.request()

    args = [*BASE, *extra, "--save-every", "0"]
    first = train(train_args(f"{out}/{case}", *args), printer=quiet, on_step=signal_at_2, stop=stop)
    _write(out, case + "-first", first)
    again = train(train_args(f"{out}/{case}", *args, "--resume", "auto"), printer=quiet)
    _write(out, case, again)


def _consolidate(out: str) -> None:
    """Rank 0: both final checkpoints consolidated, their files and optimizer states."""
    from safetensors import safe_open

    from neuron_tp import checkpoint

    if _rank() != 0:
        return
    res = {}
    for run in ("pp2_tp2_sp", "resume_pp2_at_tp4"):
        path = checkpoint.latest(f"{out}/{run}/checkpoints")
        checkpoint.consolidate(path, f"{out}/{run}-hf")
        files = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors") and not name.startswith("rng-"):
                with safe_open(os.path.join(path, name), "pt") as fh:
                    files[name] = sorted(fh.keys())
        meta = checkpoint.read_meta(path)
        res[run] = {"path": path, "files": files, "params": list(meta["params"])}
    with open(f"{out}/consolidate.json", "w") as f:
        json.dump(res, f)


def sft_options(out: str) -> list[str]:
    """Packed prompt/completion rows (packing is the default; several samples a row, the loss
    on the completions) and their eval set, written under ``out`` on first use."""
    rng = random.Random(0)
    for name, n in (("train", 48), ("eval", 16)):
        if os.path.exists(f"{out}/{name}.jsonl"):
            continue
        with open(f"{out}/{name}.jsonl", "w") as f:
            for _ in range(n):
                word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 9)))
                f.write(json.dumps({"prompt": f"rev {word}:", "completion": word[::-1]}) + "\n")
    return [
        *("--data", f"{out}/train.jsonl", "--save-every", "0"),
        *("--eval-data", f"{out}/eval.jsonl", "--eval-every", "2"),
    ]


def check(case: str, out: str) -> None:
    if case in RUNS:
        _write(out, case, train(train_args(f"{out}/{case}", *BASE, *RUNS[case]), printer=quiet))
    elif case in SFT_RUNS:
        args = train_args(f"{out}/{case}", *BASE, *SFT_RUNS[case], *sft_options(out))
        _write(out, case, train(args, printer=quiet))
    elif case.startswith("sigterm_"):
        _sigterm_then_resume(case, out)
    elif case in RESUMES:
        source, step, extra = RESUMES[case]
        ckpt = f"{out}/{source}/checkpoints/step-{step:08d}"
        args = train_args(f"{out}/{case}", *BASE, *extra, "--resume", ckpt)
        _write(out, case, train(args, printer=quiet))
    else:
        _consolidate(out)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pp_train"))
    sft_options(out)  # the data files, before the ranks start
    return out


@pytest.fixture(scope="module")
def pp1(out):
    """The --pp 1 run of the SFT cases' options (this process: one rank)."""
    summary = train(train_args(f"{out}/pp1", *BASE, *sft_options(out)), printer=quiet)
    log = summary["log"]
    return {
        "loss": losses(summary),
        "norm": [e["grad_norm"] for e in log],
        "eval": [e["eval_loss"] for e in log if "eval_loss" in e],
    }


def _launch(out: str, case: str) -> None:
    gloo_dist.run_case(check, case, out, cases=CASES, world_size=4)


def _read(out: str, case: str, rank: int) -> dict:
    with open(os.path.join(out, f"{case}-rank{rank}.json")) as f:
        return json.load(f)


@functools.cache
def _reference(out: str) -> tuple[list[float], list[float]]:
    return reference_run(train_args(f"{out}/ref", *BASE), global_micro_batch=2)


@pytest.mark.parametrize("case", SFT_RUNS)
def test_train_pp_sft_eval_equals_pp1(case, out, pp1):
    _launch(out, case)
    assert len(pp1["eval"]) == 2 and len(pp1["loss"]) == 4, pp1
    for rank in range(4):
        got = _read(out, case, rank)
        for key in ("loss", "norm", "eval"):
            assert got[key] == pytest.approx(pp1[key], rel=1e-4, abs=1e-5), (rank, key, got)


@pytest.mark.parametrize("case", RUNS)
def test_train_pp_equals_reference(case, out):
    _launch(out, case)
    if "lora" in case:  # its own reference: the unsharded peft model
        args = train_args(f"{out}/ref-lora", *BASE, *LORA)
        want_loss, want_norm = reference_run(args, global_micro_batch=2)
    else:
        want_loss, want_norm = _reference(out)
    for rank in range(4):
        got = _read(out, case, rank)
        assert got["loss"] == pytest.approx(want_loss, rel=1e-4, abs=1e-5), (rank, got)
        assert got["norm"] == pytest.approx(want_norm, rel=1e-4, abs=1e-5), (rank, got)
    if "lora" in case:
        from peft import get_peft_model_state_dict
        from safetensors.torch import load_file

        saved = load_file(f"{out}/{case}/adapter/adapter_model.safetensors")
        want = get_peft_model_state_dict(reference_run.model)
        assert sorted(saved) == sorted(want) and len(want) == 2 * 3 * 4  # A, B x 3 x 4 layers
        for k, w in want.items():
            torch.testing.assert_close(saved[k], w, atol=1e-5, rtol=1e-4, msg=k)


def _continued(out: str, case: str, rank: int) -> tuple[dict, dict]:
    """What the resumed run logged and what its source logged at the same steps."""
    source, step, _ = RESUMES[case]
    got, src = _read(out, case, rank), _read(out, source, rank)
    assert got["steps"] == list(range(step + 1, 5)), got
    at = [src["steps"].index(s) for s in got["steps"]]
    return got, {k: [src[k][i] for i in at] for k in ("loss", "norm")}


EXACT = ("sigterm_resume_pp2_tp2", "resume_pp2_zero1_exact")


@pytest.mark.parametrize("case", EXACT)
def test_save_and_resume_at_the_same_layout(case, out):
    """The resumed run's steps are the uninterrupted run's, bit for bit (weights, AdamW or
    ZeRO-1 state, schedule, data position). SIGTERM: every rank stopped after step 2 and
    saved it, though only rank 3 (a last-stage rank) was signalled."""
    _launch(out, case)
    for rank in range(4):
        if case.startswith("sigterm_"):
            first = _read(out, case + "-first", rank)
            assert first["stopped_by"] == "SIGTERM" and first["steps"] == [1, 2], first
            assert os.path.basename(first["checkpoints"][-1]) == "step-00000002", first
        got, want = _continued(out, case, rank)
        assert got["loss"] == want["loss"], (rank, got, want)
        assert got["norm"] == want["norm"], (rank, got, want)


@pytest.mark.parametrize("case", [c for c in RESUMES if c not in EXACT])
def test_resume_at_another_pp_and_tp(case, out):
    """Weights and optimizer state loaded at another layout (pp 2 -> pp 1 / tp 4, pp 1 / tp 4
    -> pp 2 / tp 2, ZeRO-1 pp 2 x dp 2 -> pp 1 / tp 2 x dp 2): the source run's losses and
    norms continue (up to float reassociation)."""
    _launch(out, case)
    for rank in range(4):
        got, want = _continued(out, case, rank)
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6), (rank, got)
        assert got["norm"] == pytest.approx(want["norm"], rel=1e-4, abs=1e-6), (rank, got)


def test_consolidated_pp2_checkpoint_is_the_pp1_hf_directory(out):
    """The step-4 checkpoints of the pp 2 / tp 2 run and of its continuation at pp 1 / tp 4:
    the same parameter records (the pp 1 order), the same consolidated HF files and optimizer
    state; the pp 2 files hold each stage's own layers and the tied table once (stage 0)."""
    from safetensors.torch import load_file

    from neuron_tp import checkpoint

    _launch(out, "consolidate")
    with open(os.path.join(out, "consolidate.json")) as f:
        res = json.load(f)
    pp2, pp1 = res["pp2_tp2_sp"], res["resume_pp2_at_tp4"]
    assert pp2["params"] == pp1["params"]  # reads like a pp 1 checkpoint, in its order
    table = "model/model.embed_tokens.weight"
    shards = {n: keys for n, keys in pp2["files"].items() if n.startswith("shard-")}
    names = [f"shard-pp0000{s}-tp0000{t}.safetensors" for s in (0, 1) for t in (0, 1)]
    assert sorted(shards) == names
    for name, keys in shards.items():  # every layer on its stage; the tied table once
        stage = int(name[len("shard-pp") : len("shard-pp") + 5])
        layers = {int(k.split(".")[2]) for k in keys if k.startswith("model/model.layers.")}
        assert layers == ({0, 1} if stage == 0 else {2, 3}), (name, layers)
        assert (table in keys) == (stage == 0), name
        assert not any(k.startswith(("model/lm_head", "optim/lm_head")) for k in keys), name
    want = load_file(f"{out}/resume_pp2_at_tp4-hf/model.safetensors")
    got = load_file(f"{out}/pp2_tp2_sp-hf/model.safetensors")
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-4, msg=k)
    with open(f"{out}/pp2_tp2_sp-hf/config.json") as a:
        with open(f"{out}/resume_pp2_at_tp4-hf/config.json") as b:
            assert json.load(a) == json.load(b)
    opt2 = checkpoint.full_optimizer_state(pp2["path"])
    opt1 = checkpoint.full_optimizer_state(pp1["path"])
    assert sorted(opt2) == sorted(opt1) and sorted(opt2) == sorted(want)
    for name, state in opt1.items():
        assert sorted(opt2[name]) == sorted(state), name
        for k, v in state.items():
            torch.testing.assert_close(opt2[name][k], v, atol=1e-7, rtol=1e-3, msg=f"{name} {k}")
