"""MoE on 2 XLA CPU devices (one process, one launch): equal to transformers on the CPU (loss
every step, every gradient, logits after training) for Qwen2-MoE (shared expert and its gate,
a dense layer) with sequence parallelism and GLM-4-MoE (group-limited sigmoid routing, shared
experts); training with different tokens every step compiles no graph after the first step;
generation keeps its graph count. Capacity mode (Qwen3-MoE, SP, cf 0.5: pairs are dropped
every step) equals transformers with the dropped pairs' weights zeroed by an independent
loop, and drops the same number of pairs. Families sharded through transformers' experts
interface (only their experts module replaced): gpt-oss (transposed, interleaved, biased
experts, its clamped gate) and Cohere2-MoE with SP. DeepSeek-V2 with SP: multi-head latent
attention sharded by heads (neuron_tp.hf.mla) with its MoE layers. (Mixtral / OLMoE: every
family on gloo ranks, tests/hf/test_moe_families.py; softmax top-k routing on XLA devices
also under ep, Qwen3-MoE and Llama-4's dense call, tests/moe/test_expert_parallel_xla.py.)"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
from moe_xla_cases import run_all  # noqa: E402

import xla_dist  # noqa: E402

TOL = 5e-5


def test_moe_on_two_xla_devices():
    cases = [
        ("qwen2_moe", True),
        ("glm4_moe", False),
        ("qwen3_moe", True, 0.5),
        ("family:gpt_oss", False),
        ("family:cohere2_moe", True),
        ("family:deepseek_v2", True),
    ]
    for ranks in xla_dist.run(run_all, 2, cases, 3, devices=2):
        gen = ranks.pop("generate")
        for name, r in ranks.items():
            assert max(r["loss"] + r["grad"]) < TOL and r["logits"] < TOL, (name, r)
            compiles = r["compiles"]  # after each step: none after the first
            assert compiles == [compiles[0]] * len(compiles), (name, compiles)
            if "cf=" in name:  # device and reference drop the same pairs, some every step
                assert all(d == want > 0 for d, want in r["dropped"]), (name, r["dropped"])
        assert all(gen["same"]), gen
        counts = gen["counts"]  # (model traces, compiles) after each generate call
        assert counts[1:] == [counts[0]] * 2, counts
