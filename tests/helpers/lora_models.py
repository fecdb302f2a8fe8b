"""The tiny LoRA (peft) models of tests/hf/test_lora.py and its XLA cases: base models, the
LoRA config per model, the peft model, fixed input ids."""

from __future__ import annotations

import torch

V = 51  # vocabulary of the tiny models
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TARGETS = {
    "tiny-llama": LLAMA_TARGETS,
    "tiny-qwen3": LLAMA_TARGETS,
    "tiny-gpt2": ["c_attn", "c_proj", "c_fc"],
    "odd-llama": LLAMA_TARGETS,
    # MoE: LoRA on the attention projections (the fused 3-D experts take none under tp)
    "tiny-qwen3moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def base_model(name: str, seed: int = 0):
    """A tiny random causal LM: a preset, ``odd-llama`` (tp 3: 6 heads over 3 kv heads) or
    ``tiny-qwen3moe`` (tests/helpers/moe_archs.py, its experts scaled to matter)."""
    if name == "tiny-qwen3moe":
        from moe_archs import build_moe, loud_experts

        return loud_experts(build_moe("qwen3_moe", seed))
    if name != "odd-llama":
        from neuron_tp.job.presets import build_model

        return build_model(name, V, seed)
    import transformers as tf

    cfg = tf.LlamaConfig(
        vocab_size=V,
        hidden_size=36,
        intermediate_size=42,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=6,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg)


def lora_config(name: str, **kw):
    """The LoRA config of the tests for model ``name`` (random B: adapters change outputs)."""
    from peft import LoraConfig

    base = dict(
        r=4,
        lora_alpha=12,  # scaling 3
        target_modules=TARGETS[name],
        lora_dropout=0.0,
        init_lora_weights=False,  # random B: the adapter changes the output
        fan_in_fan_out=name == "tiny-gpt2",
    )
    return LoraConfig(**{**base, **kw})


def peft_model(name: str, seed: int = 0, **kw):
    """``base_model(name, seed)`` with LoRA adapters drawn from seed + 100, in eval mode."""
    from peft import get_peft_model

    base = base_model(name, seed)
    torch.manual_seed(seed + 100)
    return get_peft_model(base, lora_config(name, **kw)).eval()


def sample_ids(seq: int = 12) -> torch.Tensor:
    """Two fixed rows of ``seq`` token ids."""
    return torch.randint(2, V, (2, seq), generator=torch.Generator().manual_seed(123))
