"""Rank bodies of test_preempt.py (gloo ranks and XLA CPU device threads): an uninterrupted
reference run, resumes of the signalled run, and a run in which only rank 1 asks to stop."""

from __future__ import annotations

import os

import neuron_tp as ntp
from neuron_tp.checkpoint.format import step_dirs
from neuron_tp.cli.args import train_parser
from neuron_tp.train.loop import train
from neuron_tp.train.preempt import StopSignal

STEPS = 4


def args_for(device: str, out: str, *extra: str):
    return train_parser().parse_args(
        [
            *("--device", device, "--tp", "2", "--seq-len", "16", "--micro-batch", "1"),
            *("--steps", str(STEPS), "--log-every", "1", "--warmup-steps", "2", "--lr", "3e-3"),
            *("--output-dir", out, *extra),
        ]
    )


def _quiet(*_a, **_k) -> None:
    pass


def _losses(summary: dict) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in summary["log"]}


def stop_resume_cases(device: str, tmp: str, signalled: str, signalled_step: int) -> dict:
    """One rank: the reference run; the resume of ``signalled`` (a checkpoint at
    ``signalled_step`` written on SIGTERM); a run where only rank 1 requests a stop after
    step 2 (every rank must stop there and save step 2), and its resume. Returns the losses."""
    mesh = ntp.init_mesh(tp=2)
    ref = _losses(train(args_for(device, os.path.join(tmp, "ref")), mesh, printer=_quiet))
    resumed = train(args_for(device, signalled, "--resume", "auto"), mesh, printer=_quiet)
    one = os.path.join(tmp, "one")
    stop = StopSignal()

    def rank1_asks(run) -> None:
        if run.step == 2 and mesh.rank == 1:
            stop.request()

    stopped = train(args_for(device, one), mesh, printer=_quiet, on_step=rank1_asks, stop=stop)
    after = step_dirs(os.path.join(one, "checkpoints"))
    again = train(args_for(device, one, "--resume", "auto"), mesh, printer=_quiet)
    return {
        "rank": mesh.rank,
        "ref": ref,
        "resumed": _losses(resumed),
        "resumed_first": resumed["steps"] - resumed["steps_this_run"],
        "stopped": {k: stopped[k] for k in ("steps", "stopped_by")},
        "stopped_checkpoints": list(after),
        "again": _losses(again),
        "signalled_step": signalled_step,
    }


def check(results: dict) -> None:
    """Every rank stopped where it should, and the resumes continued bit-exactly."""
    ref, s = results["ref"], results["signalled_step"]
    assert sorted(ref) == list(range(1, STEPS + 1)), ref
    assert results["resumed_first"] == s, results
    assert results["resumed"] == {k: v for k, v in ref.items() if k > s}, results
    assert results["stopped"] == {"steps": 2, "stopped_by": "SIGTERM"}, results
    assert results["stopped_checkpoints"] == [2], results
    assert results["again"] == {k: v for k, v in ref.items() if k > 2}, results


def gloo_rank(tmp: str, signalled: str, signalled_step: int) -> None:
    """gloo_dist body: the cases on this rank, checked here."""
    check(stop_resume_cases("cpu", tmp, signalled, signalled_step))
