"""MoE on 2 XLA CPU devices (one process, one launch per test): equal to transformers on the
CPU (loss every step, every gradient, logits after training) for Qwen2-MoE (shared expert and
its gate, a dense layer) with sequence parallelism and GLM-4-MoE (group-limited sigmoid routing,
shared experts); training with different tokens every step compiles no graph after the first
step; generation keeps its graph count."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
from moe_xla_cases import run_generate, run_trains  # noqa: E402

import xla_dist  # noqa: E402

TOL = 5e-5


def test_train_equal_and_static_graphs():
    cases = [("qwen2_moe", True), ("glm4_moe", False)]
    for ranks in xla_dist.run(run_trains, 2, cases, 3, devices=2):
        for name, r in ranks.items():
            assert max(r["loss"]) < TOL and r["grad"] < TOL and r["logits"] < TOL, (name, r)
            # Step 0 also gathers every gradient mid-step (host reads split its graph): from
            # step 1 on each step is one whole graph, compiled once.
            compiles = r["compiles"]
            assert compiles[1:] == [compiles[1]] * (len(compiles) - 1), (name, compiles)


def test_generate_keeps_graph_count():
    for r in xla_dist.run(run_generate, 2, devices=2):
        assert all(r["same"]), r
        counts = r["counts"]
        assert counts[1:] == [counts[0]] * 2, counts
