"""A training job restarted by torchrun after a worker dies (SIGKILL, as a dead process or node)
resumes from the newest complete checkpoint and ends exactly where an uninterrupted run ends.

One torchrun job (2 gloo ranks, tp 2, c10d rendezvous: one key-value store kept across
restarts, ``--max-restarts 4``, ``--rdzv_id`` given) is killed four times, once per attempt
(restart_run.py): rank 0 right after step 6 (rank 1 runs on into step 7), rank 1 during the
start-up of the restarted attempt (process group up, output dir claimed, restoring), rank 1
while checkpoint 8 is being written (a partial temporary directory left), rank 0 during an
evaluation. The fifth attempt finishes. Beside it the same job as torchrun's docs show it, with
no ``--rdzv_id`` (its run id is then ``"none"``): rank 1 killed right after step 6 (rank 0
blocked in step 7's collective), rank 0 right after step 10, and rank 1 after the job is
complete (the restart finds nothing to do and must exit 0 on every rank). Checked for both:
every attempt started, every kill happened where planned, the run ends at step 12 with exit 0,
metrics.jsonl ends with the uninterrupted run's losses, and the final checkpoint holds
bit-identical weights and optimizer state; each restart is bounded in time (a hang fails the
test) and the time from a kill to the next attempt's first step is printed.

A rank blocked in a collective whose peer stopped (SIGSTOP: alive, silent) leaves within
seconds of torchrun's SIGTERM (preempt.py's watchdog), not at torchrun's SIGKILL 30 s later.

And ``neuron-tp serve`` (tp 2) under torchrun ``--max-restarts 1``: a follower SIGKILLed takes
the server down (rank 0 does not keep answering with a dead peer), the restarted attempt
serves the same greedy completion; the leader killed with no restarts left ends the job
(non-zero exit, no hang)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
KILLS = "0:0:step:6,1:1:startup,2:1:save:8,3:0:eval"
KILLS_NO_RUN_ID = "0:1:step:6,1:0:step:10,2:1:end"
STEPS = 12


def _start(
    tmp, name: str, kills: str, restarts: int, port: int, run_id: bool = True, steps: int = STEPS
) -> subprocess.Popen:
    """Start the training job under torchrun (its files under ``tmp / name``); ``run_id``:
    give ``--rdzv_id`` (else torchrun's default, ``"none"``)."""
    result = tmp / name
    result.mkdir()
    out = str(result / "out")
    eval_file = os.path.join(REPO, "data", "corpus.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--max-restarts", str(restarts), "--monitor-interval", "0.1"]
    cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}"]
    cmd += ["--rdzv_id", name] if run_id else []
    cmd += [os.path.join(HERE, "restart_run.py"), str(result), "--"]
    cmd += ["--device", "cpu", "--tp", "2", "--seq-len", "32", "--micro-batch", "2"]
    cmd += ["--steps", str(steps), "--save-every", "4", "--log-every", "1", "--resume", "auto"]
    cmd += ["--warmup-steps", "2", "--lr", "3e-3", "--output-dir", out]
    cmd += ["--eval-data", eval_file, "--eval-every", "4", "--eval-batches", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", NTP_TEST_KILLS=kills)
    pipe = subprocess.PIPE
    return subprocess.Popen(
        cmd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True
    )


def _finish(tmp, name: str, proc: subprocess.Popen) -> tuple[str, list[dict]]:
    """Wait for the job; (its output dir, its events), after checking that it exited 0."""
    try:
        stdout, stderr = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    result = tmp / name
    events = [json.loads(line) for line in (result / "events.jsonl").read_text().splitlines()]
    return str(result / "out"), events


def _final(out: str) -> dict[str, torch.Tensor]:
    step = os.path.join(out, "checkpoints", f"step-{STEPS:08d}")
    tensors = {}
    for name in sorted(os.listdir(step)):
        if name.startswith("shard-") and name.endswith(".safetensors"):
            tensors.update(
                {f"{name}:{k}": v for k, v in load_file(os.path.join(step, name)).items()}
            )
    return tensors


def _losses(out: str) -> dict[int, float]:
    """step -> loss of metrics.jsonl (a resumed run rewrites the steps it trains again)."""
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the job: torchrun's session and every process under it (torchrun starts its
    workers in sessions of their own), even when the job failed half-way."""
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _check_ends_as_uninterrupted(ref_out: str, out: str) -> None:
    want, got = _losses(ref_out), _losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)) and got == want, (got, want)
    ref, final = _final(ref_out), _final(out)
    assert sorted(final) == sorted(ref) and len(ref) > 0
    for k in ref:
        assert torch.equal(final[k], ref[k]), k


def _print_restart_times(name: str, events: list[dict]) -> None:
    kill_t = {e["attempt"]: e["t"] for e in events if e["event"] == "kill"}
    first_t = {e["attempt"]: e["t"] for e in events if e["event"] == "first-step"}
    for a, t in sorted(kill_t.items()):
        later = [b for b in first_t if b > a]
        if later:
            nxt = min(later)
            print(
                f"{name}: kill in attempt {a} -> first step of attempt {nxt}: "
                f"{first_t[nxt] - t:.1f} s"
            )


def test_killed_workers_restart_and_end_with_the_uninterrupted_weights(tmp_path):
    port = 29900 + os.getpid() % 50
    jobs = {"ref": _start(tmp_path, "ref", "", 0, port)}  # the jobs run side by side
    jobs["killed"] = _start(tmp_path, "killed", KILLS, 4, port + 50)
    jobs["no-id"] = _start(tmp_path, "no-id", KILLS_NO_RUN_ID, 3, port + 100, run_id=False)
    try:
        ref_out, _ = _finish(tmp_path, "ref", jobs["ref"])
        out, events = _finish(tmp_path, "killed", jobs["killed"])
        out_no_id, events_no_id = _finish(tmp_path, "no-id", jobs["no-id"])
    finally:
        for job in jobs.values():
            _kill_group(job)

    kills = [(e["attempt"], e["rank"], e["where"]) for e in events if e["event"] == "kill"]
    assert kills == [(0, 0, "step"), (1, 1, "startup"), (2, 1, "save"), (3, 0, "eval")], events
    starts = {(e["attempt"], e["rank"]) for e in events if e["event"] == "start"}
    assert starts == {(a, r) for a in range(5) for r in (0, 1)}, events
    exits = [(e["attempt"], e["code"]) for e in events if e["event"] == "exit"]
    assert exits == [(4, 0), (4, 0)], events
    firsts = {(e["attempt"], e["step"]) for e in events if e["event"] == "first-step"}
    # attempt 2 and 4 resume from step 4 (step 8 was never completed: killed mid-save, then
    # killed again before it was saved)
    assert firsts == {(0, 1), (2, 5), (3, 5), (4, 5)}, events
    assert not os.path.exists(os.path.join(out, "checkpoints", ".tmp-step-00000008"))
    _check_ends_as_uninterrupted(ref_out, out)

    events = events_no_id
    kills = [(e["attempt"], e["rank"], e["where"]) for e in events if e["event"] == "kill"]
    assert kills == [(0, 1, "step"), (1, 0, "step"), (2, 1, "end")], events
    starts = {(e["attempt"], e["rank"]) for e in events if e["event"] == "start"}
    assert starts == {(a, r) for a in range(4) for r in (0, 1)}, events
    exits = sorted((e["attempt"], e["rank"], e["code"]) for e in events if e["event"] == "exit")
    # rank 0 of attempt 2 ended the job; attempt 3 finds it complete: exit 0 on every rank
    assert exits == [(2, 0, 0), (3, 0, 0), (3, 1, 0)], events
    firsts = {(e["attempt"], e["step"]) for e in events if e["event"] == "first-step"}
    assert firsts == {(0, 1), (1, 5), (2, 9)}, events
    _check_ends_as_uninterrupted(ref_out, out_no_id)
    _print_restart_times("--rdzv_id", _events(tmp_path, "killed"))
    _print_restart_times("no --rdzv_id", events_no_id)


def _events(tmp, name: str) -> list[dict]:
    path = tmp / name / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines]


def test_a_rank_blocked_in_a_collective_leaves_soon_after_torchruns_sigterm(tmp_path):
    port = 29700 + os.getpid() % 50
    job = _start(tmp_path, "stuck", "", 0, port, run_id=False, steps=400)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            assert job.poll() is None, job.communicate()
            events = _events(tmp_path, "stuck")
            if len([e for e in events if e["event"] == "first-step"]) == 2:
                break
            time.sleep(0.2)
        pids = _workers(job.pid, "restart_run.py")
        assert sorted(pids) == [0, 1], pids
        os.kill(pids[1], signal.SIGSTOP)  # alive and silent: rank 0 waits in a collective
        time.sleep(2.0)
        os.kill(job.pid, signal.SIGTERM)  # torchrun forwards it, SIGKILLs 30 s later
        sent = time.monotonic()
        while psutil.pid_exists(pids[0]) and psutil.Process(pids[0]).status() != "zombie":
            assert time.monotonic() - sent < 25, "rank 0 still running 25 s after SIGTERM"
            time.sleep(0.1)
        left = time.monotonic() - sent
        print(f"rank 0 blocked in a collective left {left:.1f} s after torchrun's SIGTERM")
        os.kill(pids[1], signal.SIGKILL)
        _, stderr = job.communicate(timeout=60)
        assert "no agreed stop at a step boundary" in stderr, stderr[-3000:]
    finally:
        _kill_group(job)


def _get(url: str, body: dict | None = None, timeout: float = 30.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _workers(agent: int, marker: str = "neuron_tp.cli") -> dict[int, int]:
    """global rank -> pid of the torchrun workers under ``agent`` (command line with
    ``marker``)."""
    out = {}
    for p in psutil.Process(agent).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            rank = p.environ().get("RANK")
            if rank is not None and marker in " ".join(p.cmdline()):
                out[int(rank)] = p.pid
    return out


def _serving(base: str, proc, deadline: float, not_pids: set[int], agent: int) -> dict[int, int]:
    """Wait until the server is ready, run by workers other than ``not_pids``."""
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        pids = _workers(agent)
        if len(pids) == 2 and not set(pids.values()) & not_pids:
            with contextlib.suppress(OSError):
                if _get(base + "/ready", timeout=2).get("status") == "ready":
                    return pids
        time.sleep(0.5)
    raise AssertionError("the server did not come back")


def test_a_dead_serving_rank_takes_the_server_down_and_the_restart_serves_again(tmp_path):
    port, rdzv = 28700 + os.getpid() % 200, 29960 + os.getpid() % 30
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--max-restarts", "1", "--monitor-interval", "0.1", "--rdzv_backend", "c10d"]
    cmd += ["--rdzv_endpoint", f"127.0.0.1:{rdzv}", "--rdzv_id", "serve-restart"]
    cmd += ["-m", "neuron_tp.cli", "serve", "--model", "tiny-llama", "--tp", "2"]
    cmd += ["--device", "cpu", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    base, body = f"http://127.0.0.1:{port}", {"prompt": "Hello", "max_tokens": 6, "temperature": 0}
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        first = _serving(base, proc, time.monotonic() + 180, set(), proc.pid)
        want = _get(base + "/v1/completions", body)["choices"][0]["text"]
        os.kill(first[1], signal.SIGKILL)  # a follower dies: rank 0 must not keep serving
        killed = time.monotonic()
        second = _serving(base, proc, time.monotonic() + 180, set(first.values()), proc.pid)
        print(f"serve: rank 1 killed -> serving again in {time.monotonic() - killed:.1f} s")
        assert _get(base + "/v1/completions", body)["choices"][0]["text"] == want
        os.kill(second[0], signal.SIGKILL)  # the leader dies: no restarts left, the job ends
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0, out[-3000:]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
