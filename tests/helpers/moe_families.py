"""Every mixture-of-experts causal-LM family of the installed transformers, found from its auto
mappings (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config counts routed experts), each as a
tiny random config: hidden 32, 2 layers, 4 heads (head dim 8), 4 experts top-2, expert
intermediate 16 (tp 2 and 4 divide it), vocab 64, every MoE layer kept sparse where the config
says how (first dense layers, sparse steps, layer types)."""

from __future__ import annotations

import torch

EXPERT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
)
V = 64

# Sizes set when the config has the attribute (missing ones are left alone).
_SIZES = dict(
    vocab_size=V,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=32,
    moe_intermediate_size=16,
    expert_intermediate_size=16,
    shared_expert_intermediate_size=16,
    ffn_hidden_size=32,
    num_experts_per_tok=2,
    moe_topk=2,
    top_k=2,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    num_shared_experts=1,
    first_k_dense_replace=0,
    moe_layer_freq=1,
    decoder_sparse_step=1,
    max_position_embeddings=128,
    sliding_window=64,
    # MLA (DeepSeek-V2/V3 style) sizes
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    qk_head_dim=8,
    # linear-attention / SSM hybrids
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_d_state=8,
    ssm_state_size=8,
    mamba_d_state_size=8,
    mamba_n_groups=1,
    n_groups=1,
    mamba_head_dim=8,
    mamba_headdim=8,
    mamba_expand=2,
    mamba_d_conv=4,
    conv_kernel_size=4,
    mlp_only_layers=[],
    num_dense_layers=0,
    index_head_dim=8,
    index_n_heads=4,
    index_topk=8,
)
# Qwen4-Exp's token indexer (its defaults are None)
_QSA = dict(
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    indexer_budget=8,
    indexer_compress_ratio=2,
)
# Families whose defaults the generic sizes do not fix (a hybrid's layer kinds).
_OVERRIDES = {
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "nemotron_h": dict(layer_types=["full_attention", "moe"]),
    "zaya": dict(num_experts_per_tok=1),
    "granitemoehybrid": dict(mamba_d_head=16, layer_types=["linear_attention", "attention"]),
    # MLA with a sparse-attention indexer: as many kv heads as query heads
    "axk2": dict(num_key_value_heads=4),
    "deepseek_v32": dict(num_key_value_heads=4),
    "glm_moe_dsa": dict(num_key_value_heads=4),
    "longcat_flash": dict(head_dim=4),  # its rotary size: the MLA rope head dim
    "qwen4_exp_text": _QSA,
    "qwen4_exp": _QSA,
}


def _text_config(cfg):
    for attr in ("text_config", "thinker_config"):
        sub = getattr(cfg, attr, None)
        if sub is not None and not isinstance(sub, dict):
            return sub
    return cfg


def moe_families() -> dict[str, str]:
    """``{model_type: causal-LM class name}`` for every MoE family (sorted)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = {}
    for mt in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            cfg = CONFIG_MAPPING[mt]()
        except Exception:  # configs that need arguments: looked at by their defaults only
            continue
        sub = _text_config(cfg)
        if any(getattr(sub, k, None) or getattr(cfg, k, None) for k in EXPERT_KEYS):
            cls = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[mt]
            found[mt] = cls if isinstance(cls, str) else cls[0]
    return found


def _kwargs(target, overrides: dict | None = None, sizes: dict | None = None) -> dict:
    """The tiny sizes ``target`` (a default config) has, as constructor arguments (``sizes``
    instead of the MoE ones)."""
    sizes = _SIZES if sizes is None else sizes
    kw = {k: v for k, v in sizes.items() if getattr(target, k, None) is not None}
    if hasattr(target, "num_experts_per_tok"):
        kw["num_experts_per_tok"] = 2
    if hasattr(target, "head_dim"):
        kw["head_dim"] = 8
    if getattr(target, "kv_lora_rank", None):  # MLA: the rotary part is the head dim
        kw.pop("head_dim", None)
        kw.pop("qk_head_dim", None)
    kw.update({k: 4 for k in EXPERT_KEYS if getattr(target, k, None)})
    n = kw.get("num_hidden_layers", 2)
    for k in ("layer_types", "mlp_layer_types"):
        v = getattr(target, k, None)
        if isinstance(getattr(type(target), k, None), property):
            continue  # derived (Jamba): set by its periods below
        if isinstance(v, list) and v:  # every kind once (a hybrid keeps its attention layers)
            kinds = list(dict.fromkeys(v))
            kw[k] = (kinds * n)[:n]
    # Jamba-style periods: an attention and an expert layer among the 2
    for k, v in (("attn_layer_period", 2), ("attn_layer_offset", 1)):
        if hasattr(target, k):
            kw[k] = v
    for k, v in (("expert_layer_period", 1), ("expert_layer_offset", 0)):
        if hasattr(target, k):
            kw[k] = v
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(target, k, None), int) and getattr(target, k) >= V:
            kw[k] = 0
    kw["tie_word_embeddings"] = False
    kw.update(_OVERRIDES.get(getattr(target, "model_type", ""), {}))
    kw.update(overrides or {})
    alias = getattr(target, "attribute_map", {})
    prop = {k: getattr(type(target), alias.get(k, k), None) for k in kw}
    derived = {k for k, p in prop.items() if isinstance(p, property) and p.fset is None}
    return {k: v for k, v in kw.items() if k not in derived}  # read-only: follow the others


def tiny_config(model_type: str, sizes: dict | None = None, **overrides):
    """A tiny config of ``model_type`` (its text config shrunk when it has one), built from
    constructor arguments so that derived fields follow; ``sizes``: the sizes to set instead
    of the MoE ones; ``overrides`` last."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls()
    text = _text_config(default)
    if text is default:
        cfg = cls(**_kwargs(default, overrides, sizes))
    else:
        sub = type(text)(**_kwargs(text, overrides, sizes))
        attr = next(a for a in ("text_config", "thinker_config") if getattr(default, a, None))
        cfg = cls(**{attr: sub.to_dict(), "tie_word_embeddings": False})
    rope = getattr(_text_config(cfg), "rope_parameters", None)
    if isinstance(rope, dict):
        rope.pop("mrope_section", None)
    return cfg


def build_family(model_type: str, seed: int = 0, **overrides):
    """The tiny ``model_type`` causal LM (eval mode), fp32, random weights from ``seed``;
    correction biases random too, fused experts scaled up so the MoE layers move the
    logits."""
    import transformers as tf

    cfg = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    try:
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    except ValueError as e:  # families without an SDPA path
        if "scaled_dot_product_attention" not in str(e):
            raise
        torch.manual_seed(seed)
        model = tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model = model.float().eval()
    with torch.no_grad():
        for mod in model.modules():
            bias = getattr(mod, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_(torch.rand(bias.shape) * 0.2)
        for p in model.parameters():  # some inits leave NaNs (torch.empty) or zero routers
            if not torch.isfinite(p).all() or (p.dim() >= 2 and not p.any()):
                p.copy_(torch.randn_like(p) * 0.02)
        for name, p in model.named_parameters():
            if ".experts." in name and p.dim() >= 2:
                p.copy_(torch.randn_like(p) * 0.3)
    return model


# docs/moe.md's family table sits between these lines (written from the sweep's results).
TABLE_START = "<!-- moe-families: generated by tests/hf/test_moe_families.py; do not edit -->"
TABLE_END = "<!-- moe-families: end -->"


def _short(detail: str) -> str:
    """The first clause of a refusal message, without the model class, at most 80 chars."""
    text = detail.split(": ", 1)[1] if detail.split(": ", 1)[0].endswith("ForCausalLM") else detail
    for stop in (";", " ("):
        text = text.split(stop, 1)[0]
    text = text.replace("|", "/").strip()
    return text if len(text) <= 80 else text[:77] + "..."


def family_row(model_type: str, result: dict) -> str:
    """One markdown row: family, tp 2, ep 2, note (from a sweep result of the family)."""
    whole, detail = result["whole"]
    only = result.get("experts_only", ("",))[0]
    ep = result.get("ep", ("",))[0]
    if whole == "pass":
        tp, note = "whole model", ""
    elif whole == "no tiny model":
        tp, note = "not tested", f"no tiny config builds ({detail.split(':', 1)[0]})"
    elif only == "pass":
        tp, note = "experts only", f"rest refused: {_short(detail)}"
    elif whole.startswith("pass"):
        tp, note = "whole model", "experts replicated (no `moe_tp_experts` in its plan)"
    else:
        tp, note = whole, _short(detail)
        if "experts_only" in result and result["experts_only"][1] != "no experts module":
            note += f"; experts only: {_short(result['experts_only'][1].split(': ', 1)[-1])}"
    ep_cell = "yes" if ep == "pass" else ("fails" if ep == "fail" else "")
    return f"| `{model_type}` | {tp} | {ep_cell} | {note} |"


def family_table(results: dict) -> str:
    """The markdown table of every family's outcome, between :data:`TABLE_START` / END."""
    head = ["| family | tp 2 | ep 2 | note |", "|---|---|---|---|"]
    rows = [family_row(mt, results[mt]) for mt in sorted(results)]
    return "\n".join([TABLE_START, *head, *rows, TABLE_END])


def docs_table(text: str) -> str | None:
    """The generated table block of a page's ``text`` (None when it has none)."""
    if TABLE_START not in text or TABLE_END not in text:
        return None
    start = text.index(TABLE_START)
    return text[start : text.index(TABLE_END, start) + len(TABLE_END)]
