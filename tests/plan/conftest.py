"""The planner's trace processes (``python -m neuron_tp.plan.trace``, two per plan) are forked
from the session's zygote (tests/helpers/xla_zygote.py) instead of new interpreters: the same
module, request and output, minus ~10 CPU-seconds of imports each. Processes this session does
not fork itself (gloo ranks, a CLI run from the zygote) still start real interpreters, so that
launcher stays covered (test_plan_cli.py's ``--plan auto`` tests)."""

from __future__ import annotations

import subprocess
import threading

import pytest

import xla_zygote
from neuron_tp.plan import trace


@pytest.fixture(autouse=True)
def traces_forked_from_the_zygote(monkeypatch):
    lock = threading.Lock()  # the planner traces from threads; the zygote serves one at a time

    def run(request: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        with lock:
            return xla_zygote.python(["-m", "neuron_tp.plan.trace"], env, timeout, input=request)

    monkeypatch.setattr(trace, "run_trace_child", run)
