"""Tiny random configs of the architectures the HF patcher is tested on (no downloads).

Sizes are odd where the model allows it (vocab 51 is padded at tp 2 and 4) and the GQA
configs include tp > num_key_value_heads at tp=4."""

from __future__ import annotations

import transformers as tf

V = 51


def _common(**kw):
    base = dict(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    )
    base.update(kw)
    return base


ARCHS = {
    # name: (config factory, auto class name, sequence parallelism supported?)
    "llama": (
        lambda: tf.LlamaConfig(**_common(num_attention_heads=8, num_key_value_heads=2)),
        "AutoModelForCausalLM",
        True,
    ),
    "mistral": (
        lambda: tf.MistralConfig(**_common(num_key_value_heads=2, sliding_window=5)),
        "AutoModelForCausalLM",
        True,
    ),
    "qwen2": (
        lambda: tf.Qwen2Config(**_common(num_key_value_heads=2)),
        "AutoModelForCausalLM",
        True,
    ),
    "qwen3": (
        lambda: tf.Qwen3Config(**_common(num_key_value_heads=2, head_dim=6)),
        "AutoModelForCausalLM",
        True,
    ),
    "gemma": (
        lambda: tf.GemmaConfig(**_common(num_key_value_heads=1, head_dim=8)),
        "AutoModelForCausalLM",
        True,
    ),
    "gemma2": (
        lambda: tf.Gemma2Config(**_common(num_key_value_heads=2, head_dim=8, sliding_window=5)),
        "AutoModelForCausalLM",
        True,
    ),
    "phi3": (
        lambda: tf.Phi3Config(**_common(num_key_value_heads=2, pad_token_id=0)),
        "AutoModelForCausalLM",
        True,
    ),
    "gpt_neox": (lambda: tf.GPTNeoXConfig(**_common(rotary_pct=0.5)), "AutoModelForCausalLM", True),
    "olmo2": (
        lambda: tf.Olmo2Config(**_common(num_key_value_heads=4, pad_token_id=0)),
        "AutoModelForCausalLM",
        True,
    ),
    "starcoder2": (
        lambda: tf.Starcoder2Config(**_common(num_key_value_heads=2)),
        "AutoModelForCausalLM",
        True,
    ),
    "gpt2": (
        lambda: tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "AutoModelForCausalLM",
        True,
    ),
    "opt": (
        lambda: tf.OPTConfig(
            vocab_size=V,
            hidden_size=32,
            ffn_dim=40,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            pad_token_id=1,
        ),
        "AutoModelForCausalLM",
        False,
    ),  # OPT flattens [b*s, h] before fc1: no SP
    "gpt_neo": (
        lambda: tf.GPTNeoConfig(
            vocab_size=V,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],
            window_size=5,
            max_position_embeddings=64,
        ),
        "AutoModelForCausalLM",
        True,
    ),
    "gptj": (
        lambda: tf.GPTJConfig(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64
        ),
        "AutoModelForCausalLM",
        True,
    ),
    "falcon": (
        lambda: tf.FalconConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=True,
        ),
        "AutoModelForCausalLM",
        True,
    ),
    "falcon_mha": (
        lambda: tf.FalconConfig(
            vocab_size=V,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            multi_query=False,
            parallel_attn=False,
        ),
        "AutoModelForCausalLM",
        True,
    ),
    "bert": (lambda: tf.BertConfig(**_common()), "AutoModelForMaskedLM", False),
    "roberta": (
        lambda: tf.RobertaConfig(**_common(max_position_embeddings=80)),
        "AutoModelForMaskedLM",
        False,
    ),
}


def build(name: str):
    make, auto, _ = ARCHS[name]
    cfg = make()
    cfg._attn_implementation = "eager" if name in ("gemma2", "gpt_neo", "gptj") else "sdpa"
    return getattr(tf, auto).from_config(cfg)
