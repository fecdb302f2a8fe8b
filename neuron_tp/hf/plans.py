"""Tensor-parallel plans: which module of a transformers model is sharded how, and where the
modules the patcher hooks into are.

An architecture family with an explicit :class:`ArchPlan` (``ARCH_PLANS``, keyed by
``config.model_type``) states everything: the decoder-layer list, each layer's attention and
MLP submodules and which of them prepare the shared input of their projections, the final
norm, the embedding, the LM head and every projection's :class:`Style`. Other architectures
use the plan transformers ships (``base_model_tp_plan`` / ``_tp_plan``) with the structure
guessed from module names: :mod:`neuron_tp.hf.fallback`, the only place that guesses.
``plan=`` (``{module-name pattern: style}``, ``*`` = one path component such as a layer
index) replaces the styles of either. :mod:`neuron_tp.hf.resolve` applies them to one model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .styles import ArchPlan, Style

_LLAMA = ArchPlan(
    layers="layers",
    embedding="embed_tokens",
    final_norm="norm",
    attention="self_attn",
    mlp="mlp",
    prepares_input=("self_attn", "mlp"),
    layer_styles={
        "self_attn.q_proj": Style.COLUMN,
        "self_attn.k_proj": Style.COLUMN,
        "self_attn.v_proj": Style.COLUMN,
        "self_attn.o_proj": Style.ROW,
        "mlp.gate_proj": Style.COLUMN,
        "mlp.up_proj": Style.COLUMN,
        "mlp.down_proj": Style.ROW,
    },
)

_BERT = ArchPlan(
    layers="encoder.layer",
    embedding="embeddings.word_embeddings",
    final_norm=None,
    attention="attention.self",
    mlp="intermediate",
    prepares_input=("attention.self", "intermediate"),
    layer_styles={
        "attention.self.query": Style.COLUMN,
        "attention.self.key": Style.COLUMN,
        "attention.self.value": Style.COLUMN,
        "attention.output.dense": Style.ROW,
        "intermediate.dense": Style.COLUMN,
        "output.dense": Style.ROW,
    },
    lm_head="cls.predictions.decoder",
)

_GPT2_LIKE = ArchPlan(  # GPT-2, GPT-Neo, GPT-J: ``transformer.h``, ``wte``, ``ln_f``
    layers="h",
    embedding="wte",
    final_norm="ln_f",
    attention="attn",
    mlp="mlp",
    prepares_input=("attn", "mlp"),
    layer_styles={"mlp.c_fc": Style.COLUMN, "mlp.c_proj": Style.ROW},
)


def _falcon(config: Any) -> ArchPlan:
    """Falcon: multi-query ``[q heads | k | v]`` is packed qkv, multi-head interleaves q/k/v
    per head (a plain split by heads); the grouped new_decoder_architecture and ALiBi (biases
    for all heads built outside the attention) are refused."""
    unsupported = None
    if getattr(config, "new_decoder_architecture", False) or getattr(config, "alibi", False):
        unsupported = (
            "falcon: new_decoder_architecture / alibi models are not supported "
            "(grouped fused qkv layout, ALiBi over all heads); pass plan= to shard "
            "only the MLPs"
        )
    multi_query = getattr(config, "multi_query", False)
    return ArchPlan(
        layers="h",
        embedding="word_embeddings",
        final_norm="ln_f",
        attention="self_attention",
        mlp="mlp",
        prepares_input=("self_attention", "mlp"),
        layer_styles={
            "self_attention.query_key_value": Style.COLUMN_PACKED_QKV
            if multi_query
            else Style.COLUMN,
            "self_attention.dense": Style.ROW,
            "mlp.dense_h_to_4h": Style.COLUMN,
            "mlp.dense_4h_to_h": Style.ROW,
        },
        unsupported=unsupported,
    )


_LLAMA_ATTENTION = {k: v for k, v in _LLAMA.layer_styles.items() if k.startswith("self_attn.")}
_DENSE_MLP = {k: v for k, v in _LLAMA.layer_styles.items() if k.startswith("mlp.")}
# An MoE decoder: Llama attention, ``mlp`` an MoE block in every layer (or, with ``dense``, a
# gated MLP in some layers: Qwen2/3-MoE ``mlp_only_layers`` / ``decoder_sparse_step``, GLM-4-MoE
# ``first_k_dense_replace``). Shared experts and gates are found inside the block
# (neuron_tp.hf.moe).
_MOE = replace(_LLAMA, layer_styles={**_LLAMA_ATTENTION, "mlp.experts": Style.MOE_EXPERTS})
_MOE_DENSE = replace(_MOE.with_styles(_DENSE_MLP), optional=("mlp.experts", *_DENSE_MLP))


def _glm4_moe(config: Any) -> ArchPlan:
    """GLM-4-MoE: the first ``first_k_dense_replace`` layers dense; optional per-head q/k norms."""
    if not getattr(config, "use_qk_norm", False):
        return _MOE_DENSE
    return _MOE_DENSE.with_styles(
        {
            "self_attn.q_norm": Style.REPLICATED_GRAD_ALLREDUCE,
            "self_attn.k_norm": Style.REPLICATED_GRAD_ALLREDUCE,
        }
    )


def _stablelm(config: Any) -> ArchPlan:
    """StableLM: Llama's layout; its per-head q/k LayerNorms (one module per head) are refused."""
    if not getattr(config, "qk_layernorm", False):
        return _LLAMA
    return replace(
        _LLAMA,
        unsupported="stablelm: qk_layernorm (a LayerNorm module per head) is not split over tp; "
        "pass plan= to shard only the MLPs",
    )


def _big_bird(config: Any) -> ArchPlan:
    """BigBird: BERT's layout with full attention; its block-sparse attention (the default,
    which transformers swaps for full attention on a short input, replacing the modules in
    the middle of a forward) is refused."""
    if getattr(config, "attention_type", "original_full") == "original_full":
        return _BERT
    return replace(
        _BERT,
        unsupported=f"big_bird: attention_type {config.attention_type!r} (block-sparse "
        "attention) has no tensor-parallel plan; load the model with "
        "attention_type='original_full'",
    )


def _persimmon(config: Any) -> ArchPlan:
    """Persimmon: fused qkv interleaved per head (a plain split by heads), q/k LayerNorms over
    one head's features (shared by every head)."""
    styles = {
        "self_attn.query_key_value": Style.COLUMN,
        "self_attn.dense": Style.ROW,
        "mlp.dense_h_to_4h": Style.COLUMN,
        "mlp.dense_4h_to_h": Style.ROW,
    }
    if getattr(config, "qk_layernorm", False):
        styles["self_attn.q_layernorm"] = Style.REPLICATED_GRAD_ALLREDUCE
        styles["self_attn.k_layernorm"] = Style.REPLICATED_GRAD_ALLREDUCE
    return replace(_LLAMA, final_norm="final_layernorm", layer_styles=styles)


def _gpt_bigcode(config: Any) -> ArchPlan:
    """StarCoder: multi-query ``[q heads | k | v]`` is packed qkv (the one kv head replicated),
    multi-head interleaves q/k/v per head (a plain split by heads)."""
    qkv = Style.COLUMN_PACKED_QKV if getattr(config, "multi_query", False) else Style.COLUMN
    return _GPT2_LIKE.with_styles({"attn.c_attn": qkv, "attn.c_proj": Style.ROW})


def _bloom(config: Any) -> ArchPlan:
    """BLOOM: fused qkv interleaved per head; the ALiBi biases are sliced to each rank's heads
    (neuron_tp.hf.head_bias)."""
    exact_tp = getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False)
    return ArchPlan(
        layers="h",
        embedding="word_embeddings",
        final_norm="ln_f",
        attention="self_attention",
        mlp="mlp",
        prepares_input=("self_attention", "mlp"),
        layer_styles={
            "self_attention.query_key_value": Style.COLUMN,
            "self_attention.dense": Style.ROW,
            "mlp.dense_h_to_4h": Style.COLUMN,
            "mlp.dense_4h_to_h": Style.ROW,
        },
        unsupported="bloom: slow_but_exact with pretraining_tp > 1 slices the projections "
        "itself; load with slow_but_exact=False"
        if exact_tp
        else None,
    )


_MPT = ArchPlan(  # ALiBi position_bias sliced to each rank's heads (neuron_tp.hf.head_bias)
    layers="blocks",
    embedding="wte",
    final_norm="norm_f",
    attention="attn",
    mlp="ffn",
    prepares_input=("attn", "ffn"),
    layer_styles={
        "attn.Wqkv": Style.COLUMN_PACKED_QKV,
        "attn.out_proj": Style.ROW,
        "ffn.up_proj": Style.COLUMN,
        "ffn.down_proj": Style.ROW,
    },
)


def _xglm(config: Any) -> ArchPlan:
    """XGLM: OPT's layout (fc1/fc2 in the decoder layer: no sequence parallelism); its eager
    attention drops out probabilities with the heads folded into the batch dim, which the split
    dropout cannot tell from features, so attention dropout is refused."""
    if getattr(config, "attention_dropout", 0.0) > 0:
        return replace(
            _XGLM,
            unsupported="xglm: attention_dropout > 0 on probabilities shaped [batch * heads, "
            "q, k] is not split over tp; load with attention_dropout=0",
        )
    return _XGLM


_OPT = ArchPlan(  # fc1/fc2 sit in the decoder layer, which prepares no input
    layers="decoder.layers",
    embedding="decoder.embed_tokens",
    final_norm="decoder.final_layer_norm",
    attention="self_attn",
    mlp=None,
    prepares_input=("self_attn",),
    layer_styles={
        "self_attn.q_proj": Style.COLUMN,
        "self_attn.k_proj": Style.COLUMN,
        "self_attn.v_proj": Style.COLUMN,
        "self_attn.out_proj": Style.ROW,
        "fc1": Style.COLUMN,
        "fc2": Style.ROW,
    },
)
_XGLM = replace(_OPT, layers="layers", embedding="embed_tokens", final_norm="layer_norm")


# model_type -> its plan, or a function of the config returning it. Architectures not listed
# use the plan transformers ships (neuron_tp.hf.fallback).
ARCH_PLANS: dict[str, ArchPlan | Callable[[Any], ArchPlan]] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "qwen2": _LLAMA,
    "gemma": _LLAMA,
    "gemma2": _LLAMA,
    # Per-head q/k norms: one weight for every head, so each rank's gradient is partial.
    "qwen3": _LLAMA.with_styles(
        {
            "self_attn.q_norm": Style.REPLICATED_GRAD_ALLREDUCE,
            "self_attn.k_norm": Style.REPLICATED_GRAD_ALLREDUCE,
        }
    ),
    # q/k norms over all heads' features: sharded like the q/k projections.
    "olmo2": _LLAMA.with_styles(
        {"self_attn.q_norm": Style.SHARDED_NORM, "self_attn.k_norm": Style.SHARDED_NORM}
    ),
    "starcoder2": replace(
        _LLAMA,
        layer_styles={
            "self_attn.q_proj": Style.COLUMN,
            "self_attn.k_proj": Style.COLUMN,
            "self_attn.v_proj": Style.COLUMN,
            "self_attn.o_proj": Style.ROW,
            "mlp.c_fc": Style.COLUMN,
            "mlp.c_proj": Style.ROW,
        },
    ),
    # Phi-3's fused qkv and gate_up (transformers' own plan gathers them: replicated compute).
    "phi3": replace(
        _LLAMA,
        layer_styles={
            "self_attn.qkv_proj": Style.COLUMN_PACKED_QKV,
            "self_attn.o_proj": Style.ROW,
            "mlp.gate_up_proj": Style.COLUMN_PACKED,
            "mlp.down_proj": Style.ROW,
        },
    ),
    "gpt2": _GPT2_LIKE.with_styles(
        {"attn.c_attn": Style.COLUMN_PACKED_QKV, "attn.c_proj": Style.ROW}
    ),
    # GPT-Neo's attention wrapper ``attn`` holds the attention proper, ``attn.attention``.
    "gpt_neo": replace(
        _GPT2_LIKE, attention="attn.attention", prepares_input=("attn.attention", "mlp")
    ).with_styles(
        {
            "attn.attention.q_proj": Style.COLUMN,
            "attn.attention.k_proj": Style.COLUMN,
            "attn.attention.v_proj": Style.COLUMN,
            "attn.attention.out_proj": Style.ROW,
        }
    ),
    "gptj": replace(
        _GPT2_LIKE,
        layer_styles={
            "attn.q_proj": Style.COLUMN,
            "attn.k_proj": Style.COLUMN,
            "attn.v_proj": Style.COLUMN,
            "attn.out_proj": Style.ROW,
            "mlp.fc_in": Style.COLUMN,
            "mlp.fc_out": Style.ROW,
        },
    ),
    "opt": _OPT,
    "bert": _BERT,
    "roberta": replace(_BERT, lm_head="lm_head.decoder"),
    # BERT's layer layout under other names of the LM head
    **dict.fromkeys(
        ("camembert", "xlm-roberta", "xlm-roberta-xl", "data2vec-text", "bert-generation"),
        replace(_BERT, lm_head="lm_head.decoder"),
    ),
    **dict.fromkeys(("ernie", "megatron-bert", "rembert", "roc_bert", "roformer"), _BERT),
    "big_bird": _big_bird,
    "electra": replace(_BERT, lm_head="generator_lm_head"),
    # a LayerNorm inside ``intermediate`` before its projection: the projection prepares its
    # own input (after the norm), so the norm's gradient is whole
    "roberta-prelayernorm": replace(
        _BERT, lm_head="lm_head.decoder", mlp=None, prepares_input=("attention.self",)
    ),
    "falcon": _falcon,
    # Mixture of experts (neuron_tp.hf.moe).
    "mixtral": _MOE,
    "qwen2_moe": _MOE_DENSE,
    "qwen3_moe": _MOE_DENSE.with_styles(
        {
            "self_attn.q_norm": Style.REPLICATED_GRAD_ALLREDUCE,
            "self_attn.k_norm": Style.REPLICATED_GRAD_ALLREDUCE,
        }
    ),
    "olmoe": _MOE.with_styles(
        {"self_attn.q_norm": Style.SHARDED_NORM, "self_attn.k_norm": Style.SHARDED_NORM}
    ),
    "glm4_moe": _glm4_moe,
    "stablelm": _stablelm,
    "persimmon": _persimmon,
    "gpt_bigcode": _gpt_bigcode,
    "bloom": _bloom,
    "mpt": _MPT,
    "xglm": _xglm,
    "biogpt": replace(_XGLM, lm_head="output_projection"),
    # RMSNorms over the attention output and the MLP's features, before the row projections
    "bitnet": _LLAMA.with_styles(
        {"self_attn.attn_sub_norm": Style.SHARDED_NORM, "mlp.ffn_sub_norm": Style.SHARDED_NORM}
    ),
    "gpt_neox_japanese": ArchPlan(  # fused qkv interleaved per head
        layers="layers",
        embedding="embed_in",
        final_norm="final_layer_norm",
        attention="attention",
        mlp="mlp",
        prepares_input=("attention", "mlp"),
        layer_styles={
            "attention.query_key_value": Style.COLUMN,
            "attention.dense": Style.ROW,
            "mlp.dense_h_to_4h": Style.COLUMN,
            "mlp.dense_4h_to_h": Style.ROW,
        },
        lm_head="embed_out",
    ),
    "modernbert-decoder": ArchPlan(  # Wi: [gate | up] packed
        layers="layers",
        embedding="embeddings.tok_embeddings",
        final_norm="final_norm",
        attention="attn",
        mlp="mlp",
        prepares_input=("attn", "mlp"),
        layer_styles={
            "attn.q_proj": Style.COLUMN,
            "attn.k_proj": Style.COLUMN,
            "attn.v_proj": Style.COLUMN,
            "attn.Wo": Style.ROW,
            "mlp.Wi": Style.COLUMN_PACKED,
            "mlp.Wo": Style.ROW,
        },
        lm_head="decoder",
    ),
    "openai-gpt": replace(_GPT2_LIKE, embedding="tokens_embed", final_norm=None).with_styles(
        {"attn.c_attn": Style.COLUMN_PACKED_QKV, "attn.c_proj": Style.ROW}
    ),
    "ctrl": ArchPlan(
        layers="h",
        embedding="w",
        final_norm="layernorm",
        attention="multi_head_attention",
        mlp="ffn",
        # the attention gets q, k and v as three arguments: each projection prepares its own
        prepares_input=("ffn",),
        layer_styles={
            "multi_head_attention.Wq": Style.COLUMN,
            "multi_head_attention.Wk": Style.COLUMN,
            "multi_head_attention.Wv": Style.COLUMN,
            "multi_head_attention.dense": Style.ROW,
            "ffn.0": Style.COLUMN,
            "ffn.2": Style.ROW,
        },
    ),
    "codegen": replace(
        _GPT2_LIKE,
        layer_styles={
            "attn.qkv_proj": Style.COLUMN_GROUPED_QKV,
            "attn.out_proj": Style.ROW,
            "mlp.fc_in": Style.COLUMN,
            "mlp.fc_out": Style.ROW,
        },
    ),
}


def arch_plan(config: Any) -> ArchPlan | None:
    """The explicit plan for ``config.model_type``, or None (the fallback applies)."""
    plan = ARCH_PLANS.get(str(getattr(config, "model_type", "")))
    return plan(config) if callable(plan) else plan
