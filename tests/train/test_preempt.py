"""Preemption (neuron_tp.train.preempt): SIGTERM sent to torchrun (2 gloo ranks) and to
the parent of XLA CPU device threads (as ``neuron-tp train --xla-cpu-devices 2`` runs them;
twice: the second changes nothing) mid-run: every rank
finishes its step, one checkpoint at that step, the output lock released, exit status 143;
``--resume auto`` then continues with the losses of an uninterrupted run. A stop requested on
one rank only stops every rank after the same step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import preempt_cases  # noqa: E402

import gloo_dist  # noqa: E402
import xla_dist  # noqa: E402
from neuron_tp.checkpoint.format import step_dirs  # noqa: E402
from neuron_tp.checkpoint.outdir import LOCK_NAME  # noqa: E402
from neuron_tp.train.preempt import StopSignal  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
PARK = 2  # the ranks wait after this step until their process got the signal


def _signalled_run(tmp, launcher: list[str], device: str, extra: list[str], env: dict) -> str:
    """Start the training command, SIGTERM the launcher's pid once every rank is parked after
    step PARK; check what it left; return its output directory."""
    out, marks = str(tmp / "sig"), tmp / "marks"
    marks.mkdir()
    cmd = [
        *launcher,
        os.path.join(HERE, "preempt_run.py"),
        str(marks),
        str(PARK),
        "--",
        *("--device", device, "--tp", "2", "--seq-len", "16", "--micro-batch", "1"),
        *("--steps", str(preempt_cases.STEPS), "--log-every", "1", "--warmup-steps", "2"),
        *("--lr", "3e-3", "--output-dir", out, *extra),
    ]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not all((marks / f"parked-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the ranks never reached the park step"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        log, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    codes = [json.loads(p.read_text()) for p in sorted(marks.glob("exit-*.json"))]
    assert codes and set(codes) == {128 + signal.SIGTERM}, (codes, log)
    assert step_dirs(os.path.join(out, "checkpoints")) == [PARK], log
    assert not os.path.exists(os.path.join(out, LOCK_NAME)), log
    assert "stop requested: saving step 2 of 4" in log, log
    return out


def _env(**extra) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join([REPO, HERE, env.get("PYTHONPATH", "")])
    return env


def test_sigterm_to_torchrun_with_two_gloo_ranks_saves_and_resumes_exactly(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    launcher = [*torchrun, "--master_port", str(port)]
    env = _env()
    env.pop("WORLD_SIZE", None)
    out = _signalled_run(tmp_path, launcher, "cpu", [], env)
    gloo_dist.run(preempt_cases.gloo_rank, str(tmp_path), out, PARK, world_size=2, timeout=300)


def test_sigterm_to_the_parent_of_xla_cpu_device_threads_saves_and_resumes_exactly(tmp_path):
    """The ranks are threads of xmp.spawn's child: SIGTERM (twice) to the parent process is
    forwarded to the child, whose main thread installed the handlers while unpickling the
    StopSignal it was sent (the path of ``neuron-tp train --xla-cpu-devices``)."""
    res = xla_dist.run(
        preempt_cases.xla_signal_cases, str(tmp_path), StopSignal(), PARK, devices=2, timeout=600
    )
    for r in res:
        preempt_cases.check(r)
    assert res[0]["ref"] == res[1]["ref"]
