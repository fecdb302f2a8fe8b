"""The planner's traces shared across plans (``neuron_tp.plan.trace_store``): rows of a table at
the same traced shapes trace once, and a trace file written by one process serves another.

Against independent evidence: the key leaves ``max_position_embeddings`` out only where the
traced graph does not depend on it (a real trace at two values is the same); a second plan at
another node count launches no trace process and predicts what a plan traced from scratch
predicts; a file read back gives the same plan without tracing, a file of other code is ignored."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from neuron_tp.plan import trace, trace_store
from neuron_tp.plan.hardware import get_instance
from neuron_tp.plan.search import Job, make_plan
from neuron_tp.plan.trace import Spec, trace_in_subprocess

PINS = dict(tp=2, tp_mode="1d", sequence_parallel=False, activation_checkpointing="none", pp=1)


def _config(max_positions: int, rope: dict | None = None):
    from neuron_tp.job.presets import model_config

    cfg = model_config("tiny-llama", 257)
    cfg.max_position_embeddings = max_positions
    if rope is not None:
        cfg.rope_parameters = rope
    return cfg


def _job(nodes: int) -> Job:
    return Job(get_instance("trn1.2xlarge"), nodes, seq_len=32, global_batch=8)


@pytest.fixture
def launches(monkeypatch) -> list[int]:
    """Counts the trace processes started (each still runs: conftest forks it)."""
    calls, run = [], trace.run_trace_child

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(trace, "run_trace_child", counted)
    trace_store.clear()
    yield calls
    trace_store.clear()


def test_the_key_leaves_out_max_positions_only_for_the_default_rope():
    assert trace_store.config_key(_config(64)) == trace_store.config_key(_config(4096))
    assert trace_store.config_key(_config(64)) != trace_store.config_key(
        LlamaConfig(**{**_config(64).to_dict(), "hidden_size": 128})
    )
    dynamic = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    assert trace_store.config_key(_config(64, dynamic)) != trace_store.config_key(
        _config(4096, dynamic)
    )


def test_max_positions_do_not_change_a_trace():
    spec = Spec(tp=2, seq_len=32, layers=2, dp=2, zero1=True)
    (short,) = trace_in_subprocess(_config(64), [spec])
    (long,) = trace_in_subprocess(_config(8192), [spec])
    assert not isinstance(short, str) and short == long


def test_rows_share_traces_and_a_file_resumes_them(launches, tmp_path):
    first = make_plan(_config(64), _job(2), **PINS)
    traced = len(launches)
    assert traced > 0 and first.recommended is not None
    second = make_plan(_config(4096), _job(4), **PINS)  # same traced shapes: nothing traced
    assert len(launches) == traced
    trace_store.clear()
    fresh = make_plan(_config(4096), _job(4), **PINS)
    assert len(launches) > traced
    assert second.recommended.memory == fresh.recommended.memory
    assert second.recommended.seq_per_s == fresh.recommended.seq_per_s
    path = str(tmp_path / "traces.json")
    saved = trace_store.save(path)
    trace_store.clear()
    assert trace_store.load(path) == saved > 0
    before = len(launches)
    again = make_plan(_config(64), _job(2), **PINS)
    assert len(launches) == before
    assert again.recommended.memory == first.recommended.memory
    data = json.load(open(path))
    data["fingerprint"] = "other code"
    json.dump(data, open(path, "w"))
    trace_store.clear()
    assert trace_store.load(path) == 0
    assert trace_store.load(str(tmp_path / "missing.json")) == 0
