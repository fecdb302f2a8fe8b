"""``neuron-tp selftest`` end to end: all checks pass on healthy gloo ranks (2, 4) and XLA CPU
devices (2, 4, 8) with ``--quick``; collectives broken underneath neuron_tp (faulty_cli.py: a
wrong chunk, a lost rank's contribution, an inexact bf16 sum, a rank that never arrives) are
named in the report (collective, group, dtype) with exit 1 and no hang; ``--calibrate`` feeds
``neuron-tp plan --calibration``. One launch per world size and tier; the faulty runs check
only the collectives."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import xla_zygote

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
FAULTY = os.path.join(HERE, "faulty_cli.py")
DROP = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DROP and k != "SELFTEST_FAULT"}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", PJRT_DEVICE="CPU", **extra)
    return env


def launch(tier: str, n: int, *args: str, fault: str = "", limit: float = 240):
    """Run the selftest on ``n`` gloo ranks (torchrun) or XLA CPU devices (one process forked
    from the session's zygote, tests/helpers/xla_zygote.py); (status, stdout, stderr, seconds).
    A run longer than ``limit`` is a hang: the test fails."""
    script = [FAULTY] if fault else ["-m", "neuron_tp.cli"]
    start = time.monotonic()
    env = _env(SELFTEST_FAULT=fault) if fault else _env()
    if tier == "xla":  # one process (its ranks are threads): forked from the session's zygote
        cli = [*script, "selftest", "--xla-cpu-devices", str(n), *args]
        proc = xla_zygote.python(cli, env, limit, cwd=REPO)
        if proc.returncode == -9 and "[zygote] timeout" in proc.stderr:
            raise AssertionError(f"no result in {limit:.0f} s (a hang)\n{proc.stderr[-3000:]}")
        return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n)]
    cmd += ["--master_port", str(29600 + os.getpid() % 300 + n)]
    cmd += [*script, "selftest", "--device", "cpu", *args]
    # a new session: on a hang the tree is stopped: SIGTERM first (torchrun forwards it to
    # its ranks, which run in sessions of their own), then SIGKILL to what is left
    p = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            out, err = p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = "", ""
        raise AssertionError(
            f"no result in {limit:.0f} s (a hang)\n{out[-2000:]}{err[-2000:]}"
        ) from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)  # leftovers of the tree, if any
    return p.returncode, out, err, time.monotonic() - start


def report(stdout: str) -> dict:
    """The --json report in the output (rank 0 prints it; gloo may print lines around it)."""
    start = stdout.index('{\n "ok"')
    return json.JSONDecoder().raw_decode(stdout[start:])[0]


ALL = ["environment", "collectives", "bandwidth", "layers", "model", "compile", "compute"]


# 2 ranks (tp only), 4 (tp x dp, 2D), 8 (3D); each tier once at 4 or more
@pytest.mark.parametrize("tier,n", [("gloo", 4), ("xla", 2), ("xla", 8)])
def test_quick_selftest_passes_on_a_healthy_install(tier, n, tmp_path):
    cal = tmp_path / "cal.json"
    code, out, err, took = launch(tier, n, "--quick", "--json", "--calibrate", str(cal))
    assert code == 0, out[-3000:] + err[-3000:]
    rep = report(out)
    assert rep["ok"] and [c["name"] for c in rep["checks"]] == ALL
    assert all(c["status"] == "PASS" for c in rep["checks"]), rep
    checks = {c["name"]: c for c in rep["checks"]}
    assert checks["collectives"]["numbers"]["collectives"] > 0
    groups = {r["group"] for r in checks["bandwidth"]["numbers"]["rows"]}
    assert groups == ({"tp", "dp", "world"} if n >= 4 else {"tp", "world"})
    layers = checks["layers"]["numbers"]["cases"]
    assert ("linear 2D" in layers) == (n % 4 == 0) and ("linear 3D" in layers) == (n == 8)
    assert rep["facts"]["world"] == n
    written = json.loads(cal.read_text())
    assert written["link_bandwidth_per_core"] > 0 and written["bf16_flops_per_core"] > 0
    print(f"{tier} x {n}: {took:.1f} s wall, report {rep['seconds']:.1f} s")


FAULTS = "wrong_chunk,lost_rank,inexact_bf16"


@pytest.mark.parametrize("tier", ["gloo", "xla"])
def test_broken_collectives_are_named(tier):
    code, out, err, _ = launch(
        tier, 4, "--quick", "--json", "--checks", "collectives", fault=FAULTS
    )
    assert code == 1, out[-3000:] + err[-3000:]
    rep = report(out)
    coll = {c["name"]: c for c in rep["checks"]}["collectives"]
    assert not rep["ok"] and coll["status"] == "FAIL"
    text = "\n".join(coll["failures"])
    # a wrong chunk: which chunk holds whose data, on which group and dtype
    assert "all_gather on the tp group [0, 1], fp32" in text
    assert "chunk 0 (rank 0's) holds rank 1's data; chunk 1 (rank 1's) holds rank 0's" in text
    # a lost contribution, in both dtypes, on every group with rank 1
    for group in ("tp group [0, 1]", "dp group [1, 3]", "world group [0, 1, 2, 3]"):
        for dtype in ("fp32", "bf16"):
            assert f"all_reduce on the {group}, {dtype}" in text
    assert "rank 1's contribution is missing from the sum" in text
    # an inexact bf16 sum: bf16 only, and the hint says what that means
    assert "reduce_scatter on the tp group [0, 1], bf16" in text
    assert "reduce_scatter on the tp group [0, 1], fp32" not in text
    assert "reduce_scatter tp" in coll["hint"] and "only bf16 is wrong" in coll["hint"]
    assert "accumulation dtype" in coll["hint"]


@pytest.mark.parametrize("tier", ["gloo", "xla"])
def test_a_rank_that_never_arrives_is_named_and_bounded(tier):
    start = time.monotonic()
    code, out, err, took = launch(
        tier,
        4,
        "--quick",
        "--checks",
        "collectives",
        "--timeout",
        "10",
        fault="no_arrive",
        limit=120,
    )
    assert code == 1, out[-3000:] + err[-3000:]
    # Which rank's watchdog fires first is timing (under torchrun the first one to report ends
    # the job): every rank that reports must name the collective the fault leaves it in.
    # Rank 1 stalls in its first bf16 all-reduce (tp [0, 1]); rank 0 waits there for it;
    # ranks 2 and 3 finish their tp group and wait in the first dp all-reduce (fp32) for
    # rank 0 (blocked) and rank 1.
    blocked = {
        0: "all_reduce on the tp group [0, 1], bf16",
        1: "all_reduce on the tp group [0, 1], bf16",
        2: "all_reduce on the dp group [0, 2], fp32",
        3: "all_reduce on the dp group [1, 3], fp32",
    }
    reports = re.findall(r"TIMEOUT after [0-9.]+ s on rank (\d+): (.*) did not return", err)
    assert reports, err[-3000:]
    for rank, what in reports:
        assert what == blocked[int(rank)], (rank, what, err[-3000:])
    assert "a rank never arrived" in err
    assert time.monotonic() - start < 120  # a hang bound (the launch stops at 120 s)


def test_ranks_that_differ_stop_the_run_with_the_difference():
    code, out, err, _ = launch("gloo", 4, "--quick", "--json", fault="env_mismatch")
    assert code == 1, out[-3000:] + err[-3000:]
    rep = report(out)
    assert [c["name"] for c in rep["checks"]] == ["environment"]  # nothing else ran
    (env,) = rep["checks"]
    text = " ".join(env["failures"])
    assert env["status"] == "FAIL" and "NEURON_CC_FLAGS" in text
    assert "NEURON_CC_FLAGS: rank 0-2: --model-type=transformer; rank 3: " in text
    assert "rank 3: --model-type=transformer -O2" in text
    assert "compile_cache" not in text  # one cache per node is allowed
    assert "same image" in env["hint"]
