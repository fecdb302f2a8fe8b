"""Rank bodies of test_preempt.py (gloo ranks and XLA CPU device threads): an uninterrupted
reference run, resumes of the signalled run, and a run in which only rank 1 asks to stop."""

from __future__ import annotations

import os
import signal
import threading
import time

import neuron_tp as ntp
from neuron_tp.checkpoint.format import step_dirs
from neuron_tp.checkpoint.outdir import LOCK_NAME
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
    """One rank: a run where only rank 1 requests a stop after step 2 (every rank must stop
    there and save step 2); the reference run, uninterrupted with an unset StopSignal of its
    own (it must not read the first run's answers); the resume of ``signalled`` (a checkpoint
    at ``signalled_step`` written on SIGTERM); the resume of the first run."""
    mesh = ntp.init_mesh(tp=2)
    one = os.path.join(tmp, "one")
    stop = StopSignal()

    def rank1_asks(run) -> None:
        if run.step == 2 and mesh.rank == 1:
            stop.request()

    stopped = train(args_for(device, one), mesh, printer=_quiet, on_step=rank1_asks, stop=stop)
    after = step_dirs(os.path.join(one, "checkpoints"))
    ref_run = train(
        args_for(device, os.path.join(tmp, "ref")), mesh, printer=_quiet, stop=StopSignal()
    )
    ref = _losses(ref_run)
    resumed = train(args_for(device, signalled, "--resume", "auto"), mesh, printer=_quiet)
    out = {
        "rank": mesh.rank,
        "ref": ref,
        "resumed": _losses(resumed),
        "resumed_first": resumed["steps"] - resumed["steps_this_run"],
        "signalled_step": signalled_step,
    }
    again = train(args_for(device, one, "--resume", "auto"), mesh, printer=_quiet)
    return {
        **out,
        "stopped": {k: stopped[k] for k in ("steps", "stopped_by")},
        "stopped_checkpoints": list(after),
        "again": _losses(again),
    }


def check(results: dict) -> None:
    """Every rank stopped where it should, and the resumes continued bit-exactly."""
    ref, s = results["ref"], results["signalled_step"]
    assert sorted(ref) == list(range(1, STEPS + 1)), ref
    assert results["resumed_first"] == s, results
    assert results["resumed"] == {k: v for k, v in ref.items() if k > s}, results
    assert results["stopped"] == {"steps": 2, "stopped_by": "SIGTERM"}, results
    assert results["stopped_checkpoints"] == [2], results
    assert not results.get("lock_left"), results
    if "again" in results:
        assert results["again"] == {k: v for k, v in ref.items() if k > 2}, results


def xla_signal_cases(tmp: str, stop: StopSignal, park: int) -> dict:
    """One XLA CPU device thread: the reference run; a run whose rank 0 sends SIGTERM twice
    to the parent process after step ``park`` (which forwards it to this child, whose main
    thread's handler sets ``stop``, the StopSignal this child unpickled) while every rank
    waits for the flag; its resume (:func:`check` afterwards)."""
    signalled = os.path.join(tmp, "sig")
    mesh = ntp.init_mesh(tp=2)
    ref = _losses(train(args_for("xla", os.path.join(tmp, "ref")), mesh, printer=_quiet))

    def park_then_signal(run) -> None:
        if run.step != park:
            return
        if mesh.rank == 0:
            os.kill(os.getppid(), signal.SIGTERM)
            time.sleep(0.2)
            os.kill(os.getppid(), signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.02)

    assert threading.current_thread() is not threading.main_thread()
    stopped = train(
        args_for("xla", signalled), mesh, printer=_quiet, on_step=park_then_signal, stop=stop
    )
    saved = step_dirs(os.path.join(signalled, "checkpoints"))
    # rank 0 holds the lock (released before its train() returns; the others may be faster)
    lock_left = mesh.rank == 0 and os.path.exists(os.path.join(signalled, LOCK_NAME))
    resumed = train(args_for("xla", signalled, "--resume", "auto"), mesh, printer=_quiet)
    return {
        "rank": mesh.rank,
        "ref": ref,
        "resumed": _losses(resumed),
        "resumed_first": resumed["steps"] - resumed["steps_this_run"],
        "signalled_step": park,
        "stopped": {k: stopped[k] for k in ("steps", "stopped_by")},
        "stopped_checkpoints": saved,
        "lock_left": lock_left,
    }


def gloo_rank(tmp: str, signalled: str, signalled_step: int) -> None:
    """gloo_dist body: the cases on this rank, checked here."""
    check(stop_resume_cases("cpu", tmp, signalled, signalled_step))
