"""``neuron-tp plan`` for mixtures of experts: parameter counts (total and active per token)
against the numel of transformers models built from the same tiny configs (Mixtral, Qwen2-MoE
with a shared expert and dense layers, Qwen3-MoE with q/k norms and a dense layer, OLMoE), the
known names against their published sizes, and a plan of a local MoE config.json: the report's
lines, the dense stand-in's parameters per rank, a tp the experts' intermediate size refuses."""

from __future__ import annotations

import pytest
import transformers as tf

from neuron_tp.plan.hardware import get_instance
from neuron_tp.plan.models import plan_config
from neuron_tp.plan.moe import dense_standin, param_counts
from neuron_tp.plan.report import plan_dict, plan_table
from neuron_tp.plan.search import Job, make_plan
from neuron_tp.plan.state import state_bytes

TINY = {
    "mixtral": lambda: tf.MixtralConfig(
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=97,
    ),
    "qwen2_moe": lambda: tf.Qwen2MoeConfig(
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
        vocab_size=97,
        decoder_sparse_step=2,
        mlp_only_layers=[],
    ),
    "qwen3_moe": lambda: tf.Qwen3MoeConfig(
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        num_experts=8,
        num_experts_per_tok=3,
        vocab_size=97,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
    ),
    "olmoe": lambda: tf.OlmoeConfig(
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        vocab_size=97,
    ),
}


@pytest.mark.parametrize("family", list(TINY))
def test_counts_equal_the_transformers_model(family):
    config = TINY[family]()
    model = tf.AutoModelForCausalLM.from_config(config)
    params = dict(model.named_parameters())  # tied weights once
    total = sum(p.numel() for p in params.values())
    routed = sum(p.numel() for n, p in params.items() if ".experts." in n)
    routers = sum(p.numel() for n, p in params.items() if n.endswith("mlp.gate.weight"))
    shared = sum(p.numel() for n, p in params.items() if ".shared_expert" in n)
    e = getattr(config, "num_local_experts", None) or config.num_experts
    k = config.num_experts_per_tok
    counts = param_counts(config)
    assert counts.total == total
    assert (counts.routed_experts, counts.routers, counts.shared_experts) == (
        routed,
        routers,
        shared,
    )
    assert routed > 0 and routers > 0 and (shared > 0) == (family == "qwen2_moe")
    assert counts.active == total - routed + routed * k // e  # k of the E experts per token


@pytest.mark.parametrize("bias", [False, True])
def test_dense_counts_equal_the_transformers_model(bias):
    config = tf.LlamaConfig(
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=97,
        attention_bias=bias,
        mlp_bias=bias,
    )
    total = sum(p.numel() for p in tf.AutoModelForCausalLM.from_config(config).parameters())
    counts = param_counts(config)
    assert counts.total == counts.active == total


@pytest.mark.parametrize(
    "name, total, active, tol",
    [
        # Mistral AI's model card / paper: 46.7B parameters, 12.9B used per token
        ("mixtral-8x7b", 46.7e9, 12.9e9, 0.01),
        # Qwen's model card: 30.5B total, 3.3B activated (rounded: 3.35B is 1.6% above)
        ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.02),
    ],
)
def test_known_moe_models_match_their_published_sizes(name, total, active, tol):
    counts = param_counts(plan_config(name, 4096))
    assert abs(counts.total - total) / total < 0.01
    assert abs(counts.active - active) / active < tol


def test_plan_of_a_local_moe_config_json(tmp_path):
    """Expert intermediate 25: tp=2 cannot split it, so a plan pinned to tp=2 refuses every
    layout with the reason and traces nothing; its report carries the counts and the routing
    cost. The dense stand-in traced for the runnable layouts has the model's parameters but the
    routers (E x H per layer, replicated), per rank as neuron-tp train shards it."""
    config = TINY["mixtral"]()
    config.intermediate_size = 25
    config.save_pretrained(tmp_path)
    loaded = plan_config(str(tmp_path / "config.json"), 32)
    job = Job(get_instance("trn1.2xlarge"), nodes=1, seq_len=32, global_batch=2)
    plan = make_plan(loaded, job, tp=2)
    table, as_json = plan_table(plan), plan_dict(plan)
    counts = param_counts(config)
    total, active = counts.total / 1e9, counts.active / 1e9
    assert f"parameters: {total:.2f}B total, {active:.2f}B active per token" in table
    e, k = config.num_local_experts, config.num_experts_per_tok
    assert "static dense routing (every expert computed on every token" in table
    assert f"= {e / k:.1f}x the routed experts' FLOPs" in table
    assert "one all-reduce per MoE layer forward and one backward" in table
    assert as_json["parameters"] == {"total": counts.total, "active_per_token": counts.active}
    refusal = "tp=2 does not divide the expert intermediate size 25"
    assert as_json["candidates"] and all(c["why"] == refusal for c in as_json["candidates"])
    assert refusal in table and as_json["traces"] == 0 and as_json["recommended"] is None
    standin = state_bytes(dense_standin(loaded), tp=1, bf16=True)
    assert standin.params == 2 * (counts.total - counts.routers)


def test_experts_sharded_over_tp_in_the_memory_per_rank():
    """At tp=2 the stand-in (what the plan traces) holds half of every expert's intermediate
    dim, of attention and of the vocabulary per rank; only the norms are whole (and the
    routers, which the stand-in leaves out, would be)."""
    config = TINY["mixtral"]()
    config.vocab_size = 96
    counts = param_counts(config)
    h, layers = config.hidden_size, config.num_hidden_layers
    norms = (2 * layers + 1) * h
    per_rank = state_bytes(dense_standin(config), tp=2, bf16=True).params // 2
    assert per_rank == norms + (counts.total - counts.routers - norms) // 2
