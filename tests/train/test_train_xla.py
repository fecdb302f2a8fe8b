"""The training loop on the XLA CPU device (one rank), each run in a fresh process: 20 steps
compile a fixed small number of graphs and none after step 2, read nothing from the device
outside log steps and checkpoint saves (whose transfers are exactly the saved tensors), and
``NEURON_EXTRACT_GRAPHS_ONLY=1`` writes no checkpoint and produces the same graph hashes
(persistent XLA cache keys) as the real run."""

from __future__ import annotations

import json
import os

import xla_zygote

HERE = os.path.dirname(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
N_PARAMS = 21  # tiny-llama: embed, 2 x (q, k, v, o, gate, up, down, 2 norms), norm, lm_head


def _run(tmp, cache, **env_extra):
    env = {k: v for k, v in os.environ.items() if k != "NEURON_EXTRACT_GRAPHS_ONLY"}
    env.update(PJRT_DEVICE="CPU", PYTHONPATH=REPO, **env_extra)
    script = os.path.join(HERE, "xla_train_run.py")
    proc = xla_zygote.python([script, str(tmp / "out"), str(tmp / cache)], env, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))
    return json.loads(line[4:]), proc.stdout


def test_xla_graphs_transfers_and_extract_mode(tmp_path):
    real, _ = _run(tmp_path, "cache-real")
    per = real["per_step"]
    assert [p["step"] for p in per] == list(range(1, 21))
    compiles = [p["compiles"] for p in per]
    assert 1 <= compiles[1] <= 3  # step 1 (optimizer state created) and the steady step
    assert compiles[1:] == [compiles[1]] * 19  # nothing compiles after step 2
    assert real["compiles"] == compiles[1]
    transfers = [0] + [p["transfers_to_host"] for p in per]
    for step in range(1, 21):
        delta = transfers[step] - transfers[step - 1]
        expected = 2 if step % 5 == 0 else 0  # loss and grad norm, read in a step closure
        if step - 1 in (10, 20):  # the checkpoint after step 10: params + AdamW step/m/v
            expected += 4 * N_PARAMS
        assert delta == expected, (step, delta, expected)
    assert [e["step"] for e in real["log"]] == [5, 10, 15, 20]
    losses = [e["loss"] for e in real["log"]]
    assert losses[-1] < losses[0]
    assert [os.path.basename(c) for c in real["checkpoints"]] == ["step-00000010", "step-00000020"]
    assert len(real["graphs"]) == compiles[1]  # one persistent-cache entry per graph

    # The trial run in the same output directory: it neither resumes from nor writes
    # checkpoints, logs no values, runs 3 steps.
    ckpts = sorted(os.listdir(tmp_path / "out" / "checkpoints"))
    trial, out = _run(tmp_path, "cache-trial", NEURON_EXTRACT_GRAPHS_ONLY="1")
    assert trial["checkpoints"] == [] and trial["log"] == [] and "loss" not in out
    assert sorted(os.listdir(tmp_path / "out" / "checkpoints")) == ckpts
    assert [p["step"] for p in trial["per_step"]] == [1, 2, 3]
    assert trial["graphs"] == real["graphs"]  # the same graph hashes as the real run


def _trace_step(rank: int) -> dict:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    proc = xla_zygote.python([os.path.join(HERE, "xla_trace_step.py"), str(rank)], env, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))[4:])


def test_every_rank_traces_the_same_step_graph():
    """Virtual tp2 x dp2 job: rank 0 and rank 3 (other tp and dp position, different data)
    trace byte-identical HLO for a whole optimizer step (SP, grad accumulation 2), so a
    Neuron job compiles it once; it holds the tp collectives and one bucketed dp all-reduce."""
    r0, r3 = _trace_step(0), _trace_step(3)
    assert r0["hash"] == r3["hash"]
    tp_groups, dp_groups = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    kinds = {(k, str(g)) for k, g in r0["collectives"]}
    assert {
        ("all-gather", str(tp_groups)),
        ("reduce-scatter", str(tp_groups)),
        ("all-reduce", str(tp_groups)),
    } <= kinds
    assert [k for k, g in r0["collectives"] if g == dp_groups] == ["all-reduce"]
