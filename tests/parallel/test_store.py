"""neuron_tp.parallel.store: a torchrun attempt's own key-value store.

Two real worker processes (rank 0 and rank 1, torchrun's environment, no torchrun) and a
"torchrun store" held by the test, into which a dead attempt's records were left: first a
record naming a server that no longer listens, then one naming a live store that holds
another attempt's nonce (a port reused). Rank 1 starts first and must accept neither; it
accepts exactly the store rank 0 publishes once rank 0 starts, and sees what rank 0 wrote in
it and nothing of the dead attempt's keys."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from neuron_tp.parallel import store

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = """
import sys
from neuron_tp.parallel import store
rank = int(sys.argv[1])
s = store.attempt_store(rank, 2)
if rank == 0:
    s.set("written-by-rank-0", "yes")
    s.wait(["rank-1-done"])
else:
    print("stale key visible:", s.check(["ntp/left-by-the-dead-attempt"]), flush=True)
    print("rank 0 wrote:", s.get("written-by-rank-0").decode(), flush=True)
    print("nonce:", s.get(store.NONCE).decode(), flush=True)
    s.set("rank-1-done", "1")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, boot_port: int, run: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(
        PYTHONPATH=REPO,
        TORCHELASTIC_RUN_ID=run,
        TORCHELASTIC_USE_AGENT_STORE="True",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(boot_port),
        RANK=str(rank),
        WORLD_SIZE="2",
        NEURON_TP_STARTUP_TIMEOUT="60",
    )
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(rank)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("run", ["job-7", "none"])  # "none": torchrun without --rdzv_id
def test_a_new_attempt_accepts_only_its_own_store(run):
    timeout = datetime.timedelta(seconds=60)
    boot = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    key = store.record_key(run, 2)
    boot.set(key, f"127.0.0.1 {_free_port()} dead-attempt")  # its server died with it
    impostor = dist.TCPStore("127.0.0.1", 0, None, True, timeout, wait_for_workers=False)
    impostor.set("ntp/attempt-nonce", "another-attempt")
    impostor.set("ntp/left-by-the-dead-attempt", "x")

    follower = _worker(1, boot.port, run)
    try:
        time.sleep(3)  # rank 1 is up and polling the dead record
        assert follower.poll() is None, follower.communicate()[0]
        boot.set(key, f"127.0.0.1 {impostor.port} dead-attempt")  # a live port, wrong nonce
        time.sleep(2)
        assert follower.poll() is None, follower.communicate()[0]
        leader = _worker(0, boot.port, run)
        out, _ = follower.communicate(timeout=120)
        lead_out, _ = leader.communicate(timeout=60)
    finally:
        for p in (follower, locals().get("leader")):
            if p is not None and p.poll() is None:
                p.kill()
    assert follower.returncode == 0 and leader.returncode == 0, out + lead_out
    assert "stale key visible: False" in out, out
    assert "rank 0 wrote: yes" in out, out
    published = boot.get(key).decode().split()
    assert f"nonce: {published[2]}" in out and published[2] != "dead-attempt", (out, published)


BEATING_EXITS = """
import os, socket, sys, time
import torch.distributed
from neuron_tp.parallel import store
store.BEAT_S = 0.0  # the heartbeat thread is inside the store client's C++ code nearly always
children = []
for _ in range(4):  # each child makes its attempt store, then exits through finalization
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    pid = os.fork()
    if pid == 0:
        store.attempt_store(0, 1)
        time.sleep(0.05)
        sys.exit(0)
    children.append(pid)
codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
print("exit codes:", codes, flush=True)
"""


def test_a_process_exits_cleanly_while_its_heartbeat_runs():
    """The heartbeat thread is stopped before the interpreter finalizes: a daemon thread left
    inside the TCPStore client at exit aborted the process ("terminate called without an
    active exception", exit -6) after a job had succeeded, about one exit in three at this
    beat rate. Four exits, each must be clean."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC")}
    env.update(PYTHONPATH=REPO, TORCHELASTIC_RUN_ID="job-8", MASTER_ADDR="127.0.0.1")
    env.update(RANK="0", WORLD_SIZE="1", NEURON_TP_STARTUP_TIMEOUT="60")
    cmd = [sys.executable, "-c", BEATING_EXITS]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "exit codes: [" + ", ".join(["0"] * 4) + "]" in proc.stdout, proc.stdout + proc.stderr
