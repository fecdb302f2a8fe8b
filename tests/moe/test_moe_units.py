"""The MoE mechanism against transformers' own modules, in one process: routers (every kind
and option), the tp-sharded experts in each compute mode (the per-rank partial outputs of tp
ranks, built with rank meshes, sum to transformers' eager experts, gradients too), capacity
mode (exact when large enough, drops counted by an independent loop when small), the mode rule
and the refusals (before any collective)."""

from __future__ import annotations

import copy
import math
import os
import sys

import pytest
import torch
import transformers as tf
from transformers.models.glm4_moe import modeling_glm4_moe as glm4
from transformers.models.mixtral import modeling_mixtral as mixtral
from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
import neuron_tp as ntp  # noqa: E402
from moe_archs import build_moe  # noqa: E402
from neuron_tp.hf import parallelize  # noqa: E402
from neuron_tp.moe import Router, TPExperts, pick_mode, set_moe_mode  # noqa: E402

H, E, K, INTER, T = 16, 8, 2, 12, 10


def _cfg(cls, **kw):
    return cls(
        hidden_size=H, num_attention_heads=2, intermediate_size=INTER, num_experts_per_tok=K, **kw
    )


def _mine(hf_router, kind, **options) -> Router:
    r = Router(kind, E, H, K, **options)
    with torch.no_grad():
        r.weight.copy_(hf_router.weight)
        if kind == "sigmoid_group_topk":
            r.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    return r


ROUTER_CASES = {
    "mixtral": lambda: (
        mixtral.MixtralTopKRouter(_cfg(tf.MixtralConfig, num_local_experts=E)),
        dict(kind="softmax_topk", normalize=True, fp32_weights=True),
    ),
    "qwen2_moe-norm": lambda: (
        qwen2.Qwen2MoeTopKRouter(_cfg(tf.Qwen2MoeConfig, num_experts=E, norm_topk_prob=True)),
        dict(kind="softmax_topk", normalize=True, fp32_weights=False),
    ),
    "qwen2_moe-raw": lambda: (
        qwen2.Qwen2MoeTopKRouter(_cfg(tf.Qwen2MoeConfig, num_experts=E, norm_topk_prob=False)),
        dict(kind="softmax_topk", normalize=False, fp32_weights=False),
    ),
    "glm4_moe": lambda: (
        glm4.Glm4MoeTopkRouter(
            _cfg(
                tf.Glm4MoeConfig,
                n_routed_experts=E,
                n_group=4,
                topk_group=2,
                routed_scaling_factor=2.5,
                norm_topk_prob=True,
            )
        ),
        dict(kind="sigmoid_group_topk", n_group=4, topk_group=2, normalize=True, scaling=2.5),
    ),
}


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_equals_transformers(case, dtype):
    torch.manual_seed(0)
    hf_router, options = ROUTER_CASES[case]()
    with torch.no_grad():
        hf_router.weight.normal_()
        if hasattr(hf_router, "e_score_correction_bias"):
            hf_router.e_score_correction_bias.uniform_(-0.3, 0.3)
    hf_router.to(dtype)
    if hasattr(hf_router, "e_score_correction_bias"):
        hf_router.e_score_correction_bias.data = hf_router.e_score_correction_bias.float()
    mine = _mine(hf_router, **options).to(dtype)
    if options["kind"] == "sigmoid_group_topk":
        mine.e_score_correction_bias.data = mine.e_score_correction_bias.float()
    x = torch.randn(T, H, dtype=dtype)
    want, got = hf_router(x), mine(x)
    for a, b, what in zip(got, want, ("logits", "weights", "indices")):
        assert a.dtype == b.dtype, (what, a.dtype, b.dtype)
        assert torch.equal(a, b), f"{case} {dtype} {what}: {a} vs {b}"


def _hf_experts(seed: int = 0):
    torch.manual_seed(seed)
    ex = mixtral.MixtralExperts(_cfg(tf.MixtralConfig, num_local_experts=E))
    with torch.no_grad():
        ex.gate_up_proj.normal_(std=0.3)
        ex.down_proj.normal_(std=0.3)
    x = torch.randn(T, H)
    router = mixtral.MixtralTopKRouter(_cfg(tf.MixtralConfig, num_local_experts=E))
    with torch.no_grad():
        router.weight.normal_()
    _, w, idx = router(torch.randn(T, H))
    return ex, x, w.detach(), idx


def _sharded_sum(ex, x, w, idx, tp: int, mode: str, cf: float | None = None):
    """The sum over tp ranks of each rank's partial output (rank meshes, no collectives), the
    gradients of x and w, the gathered weight gradients, and each rank's drop count."""
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    total, parts, dropped = 0, [], []
    for r in range(tp):
        mesh = ntp.Mesh(world_size=tp, rank=r, tp=tp)
        mine = TPExperts(ex.gate_up_proj, ex.down_proj, ex.act_fn, mesh)
        mine.mode, mine.capacity_factor = mode, cf
        total = total + mine(x, idx, w)
        parts.append(mine)
        dropped.append(mine.dropped)
    total.sum().backward()
    c = INTER // tp
    gu = torch.cat(
        [p.gate_up_proj.grad[:, :c] for p in parts] + [p.gate_up_proj.grad[:, c:] for p in parts], 1
    )
    dn = torch.cat([p.down_proj.grad for p in parts], 2)
    return total, x.grad, w.grad, gu, dn, dropped


def _reference(ex, x, w, idx):
    ex = copy.deepcopy(ex)
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = ex(x, idx, w)
    out.sum().backward()
    return out, x.grad, w.grad, ex.gate_up_proj.grad, ex.down_proj.grad


@pytest.mark.parametrize("tp", [1, 2, 3])
@pytest.mark.parametrize("mode", ["dense", "gather", "capacity"])
def test_experts_modes_equal_transformers(tp, mode):
    """Outputs and the gradients of the input, the routing weights and both expert weights;
    capacity with ``cf = E / k`` can hold every pair (C = T)."""
    ex, x, w, idx = _hf_experts()
    got = _sharded_sum(ex, x, w, idx, tp, mode, cf=E / K if mode == "capacity" else None)
    want = _reference(ex, x, w, idx)
    for a, b, what in zip(got, want, ("out", "dx", "dw", "d gate_up", "d down")):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")
    if mode == "capacity":
        assert all(int(d) == 0 for d in got[5])


def test_capacity_drops_counted_and_rest_exact():
    """cf = 0.5: each expert keeps its first C pairs in token order; the dropped count and the
    output match a plain loop, and the output equals transformers' with the dropped pairs'
    weights set to 0."""
    ex, x, w, idx = _hf_experts(seed=3)
    cf = 0.5
    cap = math.ceil(cf * T * K / E)
    seen, keep = [0] * E, torch.ones(T, K, dtype=torch.bool)
    for t in range(T):
        for j in range(K):
            e = int(idx[t, j])
            keep[t, j] = seen[e] < cap
            seen[e] += 1
    n_drop = int((~keep).sum())
    assert n_drop > 0, "the test needs an overflowing expert"
    got = _sharded_sum(ex, x, w, idx, 2, "capacity", cf=cf)
    assert [int(d) for d in got[5]] == [n_drop, n_drop]
    want = _reference(ex, x, w * keep, idx)[0]
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


def test_mode_rule_and_set_moe_mode():
    assert pick_mode("auto", 3, 2, 8) == "gather" and pick_mode("auto", 4, 2, 8) == "dense"
    assert pick_mode("capacity", 1, 2, 8) == "capacity"
    with pytest.raises(ValueError, match="unknown MoE mode 'fast'.*dense"):
        pick_mode("fast", 1, 2, 8)
    m = parallelize(build_moe("qwen2_moe"), mesh=ntp.Mesh(world_size=1, rank=0))
    with pytest.raises(ValueError, match="capacity_factor > 0"):
        set_moe_mode(m, "capacity")
    assert set_moe_mode(m, "capacity", 1.25) == 1  # one MoE layer (the other is dense)


MESH4 = ntp.Mesh(world_size=4, rank=0, tp=4)


def test_refusals_name_what_works():
    """Before any collective: an expert (or shared expert) intermediate size tp does not
    divide lists the degrees that work; an unknown router type, or a module that is no
    experts module, is named."""
    m = build_moe("mixtral", intermediate_size=18)
    with pytest.raises(
        ValueError, match=r"mlp\.experts: expert intermediate size 18.*tp=4.*\[1, 2\]"
    ):
        parallelize(m, mesh=MESH4)
    assert not isinstance(m.model.layers[0].mlp.experts, TPExperts), "model modified on refusal"
    m = build_moe("qwen2_moe", shared_expert_intermediate_size=10)
    with pytest.raises(
        ValueError, match=r"shared_expert: shared expert intermediate size 10.*\[1, 2\]"
    ):
        parallelize(m, mesh=MESH4)
    m = build_moe("olmoe")

    class OddRouter(torch.nn.Module):
        def forward(self, x):
            raise AssertionError("never called")

    m.model.layers[1].mlp.gate = OddRouter()
    with pytest.raises(
        ValueError, match=r"layers\.1\.mlp\.gate: unknown router type OddRouter.*MixtralTopKRouter"
    ):
        parallelize(m, mesh=MESH4)
    # moe_tp_experts on a module that is no experts module: what it lacks is named
    with pytest.raises(
        ValueError, match=r"self_attn: OlmoeAttention follows neither transformers' experts"
    ):
        parallelize(
            build_moe("olmoe"), mesh=MESH4, plan={"model.layers.*.self_attn": "moe_tp_experts"}
        )
