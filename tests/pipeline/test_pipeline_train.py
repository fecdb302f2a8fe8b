"""``neuron-tp train --pp`` on 4 gloo ranks (one launch) against the independent single-process
reference (plain transformers + torch AdamW / LambdaLR / clip_grad_norm_ on the same global
batch, the same reference ``--tp 2`` is checked against): --pp 2 --tp 2 with sequence
parallelism and --pp 4 (1F1B), --pp 2 --tp 2 interleaved (2 chunks per stage)."""

from __future__ import annotations

import json
import os

import pytest

import gloo_dist
from neuron_tp.train.loop import train
from reference_train import reference_run
from train_cpu import losses, quiet, train_args

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
}
BASE = ["--micro-batch", "2", "--grad-accum", "4", "--steps", "4", "--model", "tiny-llama-4l"]


def check(case: str, out: str) -> None:
    import torch.distributed as dist

    summary = train(train_args(f"{out}/{case}", *BASE, *RUNS[case]), printer=quiet)
    log = {"loss": losses(summary), "norm": [e["grad_norm"] for e in summary["log"]]}
    with open(f"{out}/{case}-rank{dist.get_rank()}.json", "w") as f:
        json.dump(log, f)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return str(tmp_path_factory.mktemp("pp_train"))


@pytest.mark.parametrize("case", RUNS)
def test_train_pp_equals_reference(case, out):
    gloo_dist.run_case(check, case, out, cases=tuple(RUNS), world_size=4)
    args = train_args(f"{out}/ref", *BASE)
    want_loss, want_norm = reference_run(args, global_micro_batch=2)
    for rank in range(4):
        with open(os.path.join(out, f"{case}-rank{rank}.json")) as f:
            got = json.load(f)
        assert got["loss"] == pytest.approx(want_loss, rel=1e-4, abs=1e-5), (rank, got)
        assert got["norm"] == pytest.approx(want_norm, rel=1e-4, abs=1e-5), (rank, got)


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
