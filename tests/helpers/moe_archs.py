"""Tiny random configs of the MoE families (no downloads): hidden 32, 6-8 experts, top-2,
expert intermediate 24 (tp 2 and 4 divide it), vocab 51 (padded at tp 2 and 4), 2 layers.
Qwen2-MoE has a dense layer (``mlp_only_layers``), GLM-4-MoE (and dots1, which has no explicit
plan: the fallback) a dense first layer, group-limited routing and a non-zero correction bias."""

from __future__ import annotations

import torch
import transformers as tf

V = 51
_C0 = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _make(cls, **defaults):
    """A config factory: the common sizes, then ``defaults``, then the caller's overrides."""
    return lambda **kw: cls(**{**_C0, **defaults, **kw})


MOE_ARCHS = {
    "mixtral": _make(
        tf.MixtralConfig, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2
    ),
    "qwen2_moe": _make(
        tf.Qwen2MoeConfig,
        intermediate_size=40,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": _make(
        tf.Qwen3MoeConfig,
        head_dim=8,
        intermediate_size=40,
        moe_intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    # OLMoE's k_norm spans all kv heads: 4 of them, so tp 4 can shard it.
    "olmoe": _make(
        tf.OlmoeConfig,
        num_key_value_heads=4,
        intermediate_size=24,
        num_experts=6,
        num_experts_per_tok=2,
        pad_token_id=0,
    ),
    "glm4_moe": _make(
        tf.Glm4MoeConfig,
        head_dim=8,
        intermediate_size=40,
        moe_intermediate_size=24,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        use_qk_norm=True,
    ),
    # No explicit plan: the plan transformers ships (``moe_tp_experts``) and guessed structure.
    "dots1": _make(
        tf.Dots1Config,
        head_dim=8,
        intermediate_size=40,
        moe_intermediate_size=24,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
    ),
}


def build_moe(name: str, seed: int = 0, **config_kwargs):
    """The tiny ``name`` model (eval mode), random weights from ``seed``; GLM-4-MoE's
    correction biases are random too (they change which experts are chosen)."""
    cfg = MOE_ARCHS[name](**config_kwargs)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    for mod in model.modules():
        bias = getattr(mod, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            bias.copy_(torch.rand(bias.shape) * 0.2)
    return model


def loud_experts(model, scale: float = 5.0):
    """``model`` (returned) with every routed expert's fused weights scaled in place: random
    tiny experts add little next to the residual stream, so a wrong expert output or gradient
    would hardly move the logits; scaled, the MoE layers decide them."""
    with torch.no_grad():
        for mod in model.modules():
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(mod, name, None)
                if isinstance(p, torch.nn.Parameter) and p.dim() == 3:
                    p.mul_(scale)
    return model
