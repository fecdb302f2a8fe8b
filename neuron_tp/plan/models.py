"""The models ``neuron-tp plan --model`` accepts: a well-known architecture by name (sizes from
each model's published ``config.json`` on the Hugging Face Hub: Llama, and the mixtures of
experts Mixtral-8x7B and Qwen3-30B-A3B), a neuron_tp preset, a local model directory or a
``config.json`` file (an MoE one too: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE fields). Planning
reads only the config."""

from __future__ import annotations

import os

# hidden, intermediate, layers, heads, kv heads, vocab, rope theta (the Hub configs cited)
_LLAMA = {
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "llama-2-7b": (4096, 11008, 32, 32, 32, 32000, 10000.0),
    # https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json
    "llama-2-13b": (5120, 13824, 40, 40, 40, 32000, 10000.0),
    # https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json
    "llama-2-70b": (8192, 28672, 80, 64, 8, 32000, 10000.0),
    # https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128256, 500000.0),
    # https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json
    "llama-3-70b": (8192, 28672, 80, 64, 8, 128256, 500000.0),
    # https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json (rope scaling aside)
    "llama-3.1-405b": (16384, 53248, 126, 128, 8, 128256, 500000.0),
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json (rope scaling aside)
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128256, 500000.0),
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json (rope scaling aside)
    "llama-3.1-70b": (8192, 28672, 80, 64, 8, 128256, 500000.0),
}

# Mixture-of-experts models: their Hub config.json values (transformers' config fields)
_MOE = {
    # https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
    "mixtral-8x7b": (
        "mixtral",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
            rope_theta=1e6,
            max_position_embeddings=32768,
            tie_word_embeddings=False,
        ),
    ),
    # https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            vocab_size=151936,
            rope_theta=1e6,
            max_position_embeddings=40960,
            tie_word_embeddings=False,
        ),
    ),
}

KNOWN = tuple(_LLAMA) + tuple(_MOE)


def plan_config(model: str, seq_len: int):
    """The transformers config of ``model`` (a name of :data:`KNOWN`, a preset, a directory
    holding config.json, or a config.json path)."""
    from transformers import AutoConfig, LlamaConfig

    from ..job.presets import PRESETS, model_config

    key = model.lower()
    if key in _LLAMA:
        h, f, layers, heads, kv, vocab, theta = _LLAMA[key]
        return LlamaConfig(
            hidden_size=h,
            intermediate_size=f,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            vocab_size=vocab,
            rope_theta=theta,
            max_position_embeddings=max(seq_len, 4096),
            tie_word_embeddings=False,
        )
    if key in _MOE:
        kind, fields = _MOE[key]
        return AutoConfig.for_model(kind, **fields)
    if model in PRESETS:
        return model_config(model, 257)  # the byte-level tokenizer's vocabulary
    if os.path.isfile(model) or os.path.isfile(os.path.join(model, "config.json")):
        path = os.path.dirname(model) if os.path.isfile(model) else model
        return AutoConfig.from_pretrained(path or ".")
    raise ValueError(
        f"--model {model!r} is not a known architecture ({', '.join(KNOWN)}), a preset "
        f"({', '.join(PRESETS)}), a directory with config.json or a config.json file"
    )
