"""Built-in tiny model presets (transformers configs, random init) and model construction."""

from __future__ import annotations

import os

import torch

from ..errors import UserError

PRESETS = {
    "tiny-llama": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
    # 4 layers, tied embeddings: room for pipeline stages (--pp 2/4, interleaved chunks)
    "tiny-llama-4l": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    ),
    "tiny-gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=1024),
    # per-head q/k norms: replicated parameters whose gradients are partial on each tp rank
    "tiny-qwen3": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    ),
}


def model_config(name: str, vocab_size: int):
    """The transformers config of preset ``name`` or of the local model directory ``name``."""
    from transformers import AutoConfig

    if name in PRESETS:
        kw = dict(PRESETS[name])
        cfg = AutoConfig.for_model(kw.pop("model_type"), vocab_size=vocab_size, **kw)
        cfg._attn_implementation = "sdpa"
        return cfg
    if os.path.isdir(name):
        return AutoConfig.from_pretrained(name)
    raise UserError(
        f"--model {name!r} is neither a preset ({', '.join(PRESETS)}) nor a local model directory"
    )


def is_preset(name: str) -> bool:
    return name in PRESETS


def build_model(name: str, vocab_size: int, seed: int, dtype: torch.dtype = torch.float32):
    """A causal LM: random init (from ``seed``, identical on every rank and tp degree) for a
    preset, the full weights for a local directory (to be sharded by ``parallelize``)."""
    from transformers import AutoModelForCausalLM

    if name in PRESETS:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(model_config(name, vocab_size), dtype=dtype)
    model_config(name, vocab_size)  # clear error for a bad path
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa")


def preload(name: str | None) -> None:
    """Import transformers and the modeling module of model ``name`` now. Ranks may be threads
    of one process (``--xla-cpu-devices``): two threads loading transformers' lazy modules at
    once can fail, so :func:`~neuron_tp.train.loop.setup` calls this under a lock first."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        return
    if name in PRESETS:
        config = model_config(name, 256)
    elif name and os.path.isdir(name) and os.path.exists(os.path.join(name, "config.json")):
        config = AutoConfig.from_pretrained(name)
    else:
        return
    AutoModelForCausalLM._model_mapping[type(config)]  # noqa: B018 - loads the module
