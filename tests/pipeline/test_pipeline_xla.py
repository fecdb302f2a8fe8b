"""Pipeline training EXECUTED on 4 XLA CPU devices (one launch, pipeline_cases.py): pp 2 x tp 2
with sequence parallelism, pp 2 x dp 2 with ZeRO-1 and tied embeddings, and pp 4 on packed
rows then evaluated (forward-only schedule), pp 2 x cp 2 (ring attention inside the stages) on
packed rows then evaluated, against the unsharded model (loss, clipped
gradients, global norm, weights after two steps); the trained AdamW stages saved as one
checkpoint, loaded back (weights, AdamW state) and consolidated (the unsharded model's
weights); and the graphs: from the second step on nothing compiles, at M = 4 or M = 8
micro-batches. The pp collectives (the loss, the tied table, the norm's square sum) run in
small graphs of their own that the stages enter together: inside the stages' different
optimizer graphs, XLA:CPU's 10 s collective wait aborted them."""

from __future__ import annotations

import os

import pipeline_cases
import pytest

import xla_dist

CASES = ("pp2_tp2_sp", "pp2_tied_zero1", "pp4_packed_eval", "pp2_cp2_packed_eval")


def job(case: str, root: str):
    more = (4, 8, 8) if case == CASES[0] else ()
    ckpt = None if "zero1" in case else os.path.join(root, case)  # the AdamW stages round-trip
    return pipeline_cases.run(case, device="xla", more_m=more, checkpoint_root=ckpt)


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    return xla_dist.run_cases(job, CASES, str(tmp_path_factory.mktemp("pp_xla")), devices=4)


@pytest.mark.parametrize("case", CASES)
def test_pipeline_xla(outcome, case):
    for out in outcome.get(case):
        assert any(c.startswith("grad ") for c in out["checked"]), out
        assert any(c.startswith("weight ") for c in out["checked"]), out
        assert ("eval" in out["checked"]) == ("_eval" in case), out
        assert any(c.startswith("loaded ") for c in out["checked"]) != ("zero1" in case), out
    consolidated = any(c.startswith("consolidated ") for c in outcome.get(case)[0]["checked"])
    assert consolidated != ("zero1" in case)


def test_graphs_fixed_whatever_the_micro_batches(outcome):
    """Compiles after each step: 2 compared steps at M = 4 (host reads of the gradients in
    between), then the plain step at M = 4 (its own graph cuts: new graphs), then twice at
    M = 8: nothing new (the same task, exchange and optimizer graphs)."""
    counts = outcome.get(CASES[0])[0]["compiles"]
    assert len(counts) == 5 and counts[2] == counts[3] == counts[4], counts
