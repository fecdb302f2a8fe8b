"""The small transformers configs the 2D/3D model tests share (hidden 32, 4 heads / 2 kv
heads, 2 layers): one definition instead of a copy per test file."""

from __future__ import annotations


def nd_config(arch: str = "llama", vocab_size: int = 64, **kw):
    """A tiny Llama / Qwen2 / Mistral config (``kw`` overrides any field)."""
    import transformers as tf

    base = dict(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    base.update(kw)
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "mistral": tf.MistralConfig}[arch]
    return cls(**base)
