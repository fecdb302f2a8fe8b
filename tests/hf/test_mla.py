"""Multi-head latent attention sharded by heads (:mod:`neuron_tp.hf.mla`) at tp 4 and tp 2
(x dp 2) on 4 gloo ranks, with and without sequence parallelism: MiniCPM3 (with and without
the low-rank query), DeepSeek-V2 and GLM-4-MoE-lite (MoE) against the unsharded transformers
model in logits, parallel loss, every gradient and the logits after one SGD step (eval), and
in training mode with attention dropout (each head's mask must be the unsharded model's)."""

from __future__ import annotations

import copy
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
sys.path.insert(0, os.path.dirname(__file__))
from test_dense_families import _compare, _compare_training  # noqa: E402

import gloo_dist  # noqa: E402
from dense_families import build_dense  # noqa: E402
from moe_families import build_family  # noqa: E402

# case: (family, tp, sequence_parallel, config overrides)
CASES = {
    "minicpm3-tp4": ("minicpm3", 4, False, {}),
    "minicpm3-tp4-sp": ("minicpm3", 4, True, {}),
    "minicpm3-no-q-lora-tp2-sp": ("minicpm3", 2, True, {"q_lora_rank": None}),
    "deepseek_v2-tp4-sp": ("deepseek_v2", 4, True, {}),
    "glm4_moe_lite-tp2": ("glm4_moe_lite", 2, False, {}),
}


def _build(family: str, **overrides):
    if family == "minicpm3":
        return build_dense(family, **overrides)
    return build_family(family, **overrides)


def _case(case: str) -> None:
    import neuron_tp as ntp
    from neuron_tp.hf import parallelize

    family, tp, sp, overrides = CASES[case]
    mesh = gloo_dist.shared_mesh(tp)
    ntp.set_default_mesh(mesh)
    ref = _build(family, attention_dropout=0.2, **overrides)
    opts = dict(parallel_loss=True, sequence_parallel=sp)
    m = parallelize(copy.deepcopy(ref), mesh, **opts)
    att = m.get_submodule("model.layers.0.self_attn")
    assert att.num_heads == ref.config.num_attention_heads // tp, "heads not patched"
    assert (
        att.kv_b_proj.weight.shape[0] * tp
        == ref.get_submodule("model.layers.0.self_attn.kv_b_proj").weight.shape[0]
    ), "kv_b_proj not split by heads"
    bad = _compare(copy.deepcopy(ref), m)
    bad += _compare_training(copy.deepcopy(ref), parallelize(copy.deepcopy(ref), mesh, **opts))
    assert not bad, bad


@pytest.mark.parametrize("case", list(CASES))
def test_latent_attention_exact(case):
    gloo_dist.run_case(_case, case, cases=list(CASES), world_size=4, timeout=600)


def test_latent_attention_refusals():
    """Heads tp does not split, parts of a latent attention neuron_tp cannot shard, and a
    user plan inside a latent attention: refused before the model changes."""
    import neuron_tp as ntp
    from neuron_tp.hf import parallelize

    mesh = ntp.Mesh(world_size=8, rank=0, tp=8)
    ref = build_dense("minicpm3")
    with pytest.raises(ValueError, match="4 heads cannot be split over tp=8"):
        parallelize(copy.deepcopy(ref), mesh)
    hy = build_family("hy_v4")
    with pytest.raises(ValueError, match=r"unknown parts \['gate_proj', 'sinks'\]"):
        parallelize(copy.deepcopy(hy), ntp.Mesh(world_size=2, rank=0, tp=2))
    with pytest.raises(ValueError, match="plan shards"):
        parallelize(
            copy.deepcopy(ref),
            ntp.Mesh(world_size=2, rank=0, tp=2),
            plan={"model.layers.*.self_attn.kv_b_proj": "colwise"},
        )
