"""Every dense causal-LM family of the installed transformers (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``
minus the mixture-of-experts ones of :mod:`moe_families`), each as a tiny random config: hidden
32, 2 layers, 4 heads (head dim 8, 2 kv heads), intermediate 64, vocab 64, whatever names the
family gives these sizes."""

from __future__ import annotations

import torch

from moe_families import V, moe_families, tiny_config

# The sizes under the names dense families give them (set when the config has the attribute).
SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=128,
    sliding_window=64,
    # GPT-2 / GPT-J / CTRL names
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_inner=64,
    n_positions=128,
    n_ctx=128,
    rotary_dim=4,
    # OPT, XGLM, BART-like decoders
    ffn_dim=64,
    word_embed_proj_dim=32,
    d_model=32,
    decoder_layers=2,
    decoder_attention_heads=4,
    decoder_ffn_dim=64,
    encoder_layers=2,
    encoder_attention_heads=4,
    encoder_ffn_dim=64,
    # other names of the same sizes
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    n_heads=4,
    n_layers=2,
    d_ff=64,
    ffn_hidden_size=64,
    embedding_size=32,
    kv_channels=8,
    # linear-attention / SSM hybrids
    state_size=8,
    ssm_state_size=8,
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_n_groups=1,
    n_groups=1,
    conv_kernel=4,
    conv_kernel_size=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    # MLA (MiniCPM3 style)
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
)


# Families whose defaults the generic sizes do not fix.
OVERRIDES: dict[str, dict] = {
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=4),
    "nemotron": dict(num_key_value_heads=2),
    "mamba2": dict(num_heads=8),
    # project_in / project_out around the decoder; dropout between fc1 and fc2 too
    "opt": dict(word_embed_proj_dim=16, activation_dropout=0.1, attention_dropout=0.1),
    # full attention (block-sparse attention is refused: tests/hf/test_llm_families.py)
    "big_bird": dict(attention_type="original_full"),
    # attention dropout on [batch * heads, q, k] is refused (tests/hf/test_llm_families.py)
    "xglm": dict(attention_dropout=0.0),
    # its fused qkv of 4 blocks needs 4 query heads per rank (8 at tp 2)
    "codegen": dict(n_head=8, num_attention_heads=8, resid_pdrop=0.1, attn_pdrop=0.1),
    # mamba heads x head dim = the mixer's width (expand x hidden)
    "bamba": dict(mamba_d_head=16, attn_layer_indices=[1]),
    # sliding and global layers, the last two reusing the first two's keys and values, the
    # first layer's MLP sparse (a top-k by the mean and spread of its features)
    "gemma3n_text": dict(
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention"] * 2,
        num_kv_shared_layers=2,
        activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=V,
        laurel_rank=8,
        sliding_window=4,
    ),
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], lru_width=32),
    "falcon_h1": dict(mamba_d_head=16, mamba_d_ssm=64),
    "zamba2": dict(layers_block_type=["mamba", "hybrid"], n_mamba_heads=4, adapter_rank=8),
    # routed experts after a dense first layer
    "dots1": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=16,
        first_k_dense_replace=1,
    ),
    "dbrx": dict(
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ),
}

# Gemma-4's text config: sliding and global layers of different head dims (8 and 16) and kv
# heads (2 and 1: replicated at tp 2), the global ones' values their keys, the last two
# layers reusing the first two's keys and values (one per layer type) with double-wide MLPs,
# and per-layer inputs.
GEMMA4_TEXT = dict(
    num_hidden_layers=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    head_dim=8,
    global_head_dim=16,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=V,
    sliding_window=4,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)
_HETEROGENEOUS = ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_text")

# Families whose tiny config still holds full-size parts the generic sizes do not reach
# (a byte-level patcher, vision and audio towers): not built, listed with the reason.
NO_TINY = {
    "blt": "its byte-level patcher allocates 12 GB",
    "phi4_multimodal": "full-size vision and audio towers (870M parameters)",
    "moss_transcribe_diarize": "a full-size audio encoder (307M parameters)",
    "gemma4_assistant": "a draft model: it reads its target model's keys and values",
    "gemma4_unified_assistant": "a draft model: it reads its target model's keys and values",
}


def dense_config(model_type: str, **overrides):
    """The tiny config of ``model_type``: :func:`tiny_config` with the dense sizes, or, for a
    family whose config holds per-layer fields (Gemma-4), built from :data:`GEMMA4_TEXT`."""
    if model_type not in _HETEROGENEOUS:
        own = {**OVERRIDES.get(model_type, {}), **overrides}
        return tiny_config(model_type, sizes=SIZES, **own)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads")
    keys += ("num_key_value_heads", "max_position_embeddings")
    text = {**{k: SIZES[k] for k in keys}, **GEMMA4_TEXT, "tie_word_embeddings": False}
    text.update(overrides)
    cls = CONFIG_MAPPING[model_type]
    if model_type.endswith("_text"):
        return cls(**text)
    return cls(text_config=text, tie_word_embeddings=False)


# Families also compared in eval mode with sequence parallelism (each refuses it or is exact):
# per-layer head sizes and shared keys and values, per-layer inputs, mamba mixers, experts.
SP_FAMILIES = {"gemma4_text", "gemma4_unified_text", "gemma3n_text", "falcon_h1", "bamba"}
SP_FAMILIES |= {"dots1", "dbrx", "gemma3_text", "qwen3_5_text"}


def drops(model) -> bool:
    """Whether ``model`` has a dropout probability above 0 (a module, or a float attribute
    named like one)."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout) and mod.p > 0:
            return True
        if any("drop" in k and isinstance(v, float) and v > 0 for k, v in vars(mod).items()):
            return True
    return False


def dense_families() -> dict[str, str]:
    """``{model_type: causal-LM class name}`` for every dense family (sorted)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    moe = moe_families()
    found = {}
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if mt not in moe:
            cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt]
            found[mt] = cls if isinstance(cls, str) else cls[0]
    return found


def build_dense(model_type: str, seed: int = 0, **overrides):
    """The tiny ``model_type`` causal LM (eval mode), fp32, random weights from ``seed``;
    every bias and norm weight random too (inits that zero them would hide a bias added on
    every rank or a norm applied to the wrong features)."""
    import transformers as tf

    cfg = dense_config(model_type, **overrides)
    torch.manual_seed(seed)
    try:
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    except ValueError as e:  # families without an SDPA path
        if "scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e).lower():
            raise
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if not torch.isfinite(p).all():  # torch.empty inits
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif p.dim() == 1:  # biases and norm weights: off their constant init
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model


# docs/hf.md's dense family table sits between these lines (written from the sweep's results).
TABLE_START = "<!-- dense-families: generated by tests/hf/test_dense_families.py; do not edit -->"
TABLE_END = "<!-- dense-families: end -->"


def _short(detail: str) -> str:
    """The first clause of a refusal message, without the model class, at most 90 chars."""
    head, _, rest = detail.partition(": ")
    text = rest if rest and head.endswith(("ForCausalLM", "LMHeadModel", "Model")) else detail
    for stop in (";", " ("):
        text = text.split(stop, 1)[0]
    text = text.replace("|", "/").strip()
    return text if len(text) <= 90 else text[:87] + "..."


def family_row(model_type: str, result: tuple[str, str]) -> str:
    """One markdown row: family, tp 2 outcome, why (from a sweep result of the family)."""
    kind, detail = result
    if kind == "no tiny model":
        return f"| `{model_type}` | not tested | no runnable tiny config ({detail.split(':')[0]}) |"
    return f"| `{model_type}` | {kind} | {_short(detail) if kind == 'refused' else ''} |"


def family_table(results: dict) -> str:
    """The markdown table of every family's outcome, between :data:`TABLE_START` / END."""
    head = ["| family | tp 2 | why |", "|---|---|---|"]
    rows = [family_row(mt, results[mt]) for mt in sorted(results)]
    return "\n".join([TABLE_START, *head, *rows, TABLE_END])


def docs_table(text: str) -> str | None:
    """The generated table block of a page's ``text`` (None when it has none)."""
    if TABLE_START not in text or TABLE_END not in text:
        return None
    start = text.index(TABLE_START)
    return text[start : text.index(TABLE_END, start) + len(TABLE_END)]
