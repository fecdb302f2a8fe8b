"""``neuron-tp train --pp`` on 4 gloo ranks (one launch) against the independent single-process
reference (plain transformers + torch AdamW / LambdaLR / clip_grad_norm_ on the same global
batch, the same reference ``--tp 2`` is checked against): --pp 2 --tp 2 with sequence
parallelism and --pp 4 (1F1B), --pp 2 --tp 2 interleaved (2 chunks per stage), and LoRA at
--pp 2 --tp 2 (the reference: the unsharded peft model; the adapters saved at the end, one
PEFT file joined from the stages, equal to the reference's).

In the same launch, the SFT data path with evaluation: --pp 2 --tp 2 interleaved and --pp 4
on packed prompt/completion rows (answer-only loss, micro-batches of different label counts)
with --eval-data every 2 steps, against the --pp 1 run of the same options (whose packing and
eval losses tests/train/test_sft_*.py and test_evaluate.py check against plain transformers):
the same step losses, gradient norms and eval losses on every rank."""

from __future__ import annotations

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
    "pp2_tp2_sp": ["--pp", "2", "--tp", "2", "--sequence-parallel"],
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
    "pp2_tp2_lora": ["--pp", "2", "--tp", "2", *LORA],
}
SFT_RUNS = {
    "pp2_tp2_interleaved_sft_eval": RUNS["pp2_tp2_interleaved"],
    "pp4_sft_eval": RUNS["pp4"],
}
CASES = (*RUNS, *SFT_RUNS)
BASE = ["--micro-batch", "2", "--grad-accum", "4", "--steps", "4", "--model", "tiny-llama-4l"]


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


def run_log(summary: dict) -> dict:
    log = summary["log"]
    return {
        "loss": losses(summary),
        "norm": [e["grad_norm"] for e in log],
        "eval": [e["eval_loss"] for e in log if "eval_loss" in e],
    }


def check(case: str, out: str) -> None:
    import torch.distributed as dist

    extra = RUNS[case] if case in RUNS else [*SFT_RUNS[case], *sft_options(out)]
    summary = train(train_args(f"{out}/{case}", *BASE, *extra), printer=quiet)
    with open(f"{out}/{case}-rank{dist.get_rank()}.json", "w") as f:
        json.dump(run_log(summary), f)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("pp_train"))
    sft_options(out)  # the data files, before the ranks start
    return out


@pytest.fixture(scope="module")
def pp1(out):
    """The --pp 1 run of the SFT cases' options (this process: one rank)."""
    return run_log(train(train_args(f"{out}/pp1", *BASE, *sft_options(out)), printer=quiet))


@pytest.mark.parametrize("case", SFT_RUNS)
def test_train_pp_sft_eval_equals_pp1(case, out, pp1):
    gloo_dist.run_case(check, case, out, cases=CASES, world_size=4)
    want = pp1
    assert len(want["eval"]) == 2 and len(want["loss"]) == 4, want
    for rank in range(4):
        with open(os.path.join(out, f"{case}-rank{rank}.json")) as f:
            got = json.load(f)
        for key in ("loss", "norm", "eval"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (rank, key, got)


@pytest.mark.parametrize("case", RUNS)
def test_train_pp_equals_reference(case, out):
    gloo_dist.run_case(check, case, out, cases=CASES, world_size=4)
    args = train_args(f"{out}/ref", *BASE, *(LORA if "lora" in case else ()))
    want_loss, want_norm = reference_run(args, global_micro_batch=2)
    for rank in range(4):
        with open(os.path.join(out, f"{case}-rank{rank}.json")) as f:
            got = json.load(f)
        assert got["loss"] == pytest.approx(want_loss, rel=1e-4, abs=1e-5), (rank, got)
        assert got["norm"] == pytest.approx(want_norm, rel=1e-4, abs=1e-5), (rank, got)
    if "lora" in case:
        from peft import get_peft_model_state_dict
        from safetensors.torch import load_file

        saved = load_file(f"{out}/{case}/adapter/adapter_model.safetensors")
        want = get_peft_model_state_dict(reference_run.model)
        assert (
            sorted(saved) == sorted(want) and len(want) == 2 * 3 * 4
        )  # A, B x 3 targets x 4 layers
        for k, w in want.items():
            torch.testing.assert_close(saved[k], w, atol=1e-5, rtol=1e-4, msg=k)


def test_pp_refuses_to_resume_a_checkpoint_it_cannot_read(tmp_path):
    """Stage checkpoints are not written yet: ``--resume auto`` that finds one (of a pp 1 run in
    the same --output-dir) is refused before any work instead of loading a stage from it."""
    from neuron_tp.cli.args import train_parser
    from neuron_tp.errors import UserError
    from neuron_tp.job.config import TrainConfig
    from neuron_tp.train.checkpoint_policy import resume_source

    step = tmp_path / "checkpoints" / "step-00000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text("{}")
    argv = ["--model", "tiny-llama-4l", "--output-dir", str(tmp_path), "--resume", "auto"]
    plain = TrainConfig.from_args(train_parser().parse_args(argv))
    assert resume_source(plain) == str(step)
    piped = TrainConfig.from_args(train_parser().parse_args([*argv, "--pp", "2"]))
    with pytest.raises(UserError, match="--pp 2 cannot resume from a checkpoint yet"):
        resume_source(piped)
