"""Mixture-of-experts configs in the planner: parameter counts (total and active per token),
the routing overhead of the static dense formulation, and the dense stand-in that is traced.

Counts follow transformers' modules for Mixtral, Qwen2-MoE (shared expert and its sigmoid
gate, qkv biases), Qwen3-MoE (q/k norms on the head dim) and OLMoE (q/k norms on the whole
projections), with ``decoder_sparse_step`` / ``mlp_only_layers`` dense layers. A token uses the
attention, the norms, the router, the shared expert and ``k`` of the ``E`` routed experts of
every MoE layer (plus the embedding row and the output head): that is its *active* count.

The tp-sharded MoE layer computes, by default, every expert on every token (static shapes: no
data-dependent gather on XLA), i.e. ``E/k`` times the routed experts' FLOPs, with one all-reduce
per layer forward and one backward, like a dense MLP. So a layout is traced on the dense
stand-in of :func:`dense_standin`: the same attention, embeddings and depth, and per layer a
dense MLP of ``E*I`` (+ the shared expert's) intermediate size: the same parameters per rank
(experts split over tp along ``I``), FLOPs, saved activations and collectives, up to the router
(``E x H`` per layer, replicated) and norms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class MoeShape:
    """The MoE fields of a config, whatever its family calls them."""

    experts: int  # E, routed experts per MoE layer
    k: int  # experts per token
    expert_inter: int  # intermediate dim of one routed expert
    shared_inter: int  # of the shared expert (0: none)
    shared_gate: bool  # a sigmoid gate [1, H] on the shared expert (Qwen2-MoE)
    moe_layers: int
    dense_layers: int  # layers with a plain MLP instead (decoder_sparse_step, mlp_only_layers)
    dense_inter: int  # their intermediate dim


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a causal LM, by part; ``active``: those one token uses."""

    embedding: int  # input embeddings (+ untied output head)
    attention: int  # projections, their biases, q/k norms
    norms: int  # layer norms and the final norm
    routers: int
    routed_experts: int  # all E experts of every MoE layer
    shared_experts: int  # shared experts and their gates
    dense_mlps: int  # MLPs of the dense layers
    experts: int  # E
    k: int

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.attention
            + self.norms
            + self.routers
            + self.routed_experts
            + self.shared_experts
            + self.dense_mlps
        )

    @property
    def active(self) -> int:
        """Per token: everything but the ``E - k`` routed experts it does not choose."""
        return self.total - self.routed_experts + self.routed_experts * self.k // self.experts

    @property
    def static_dense_overhead(self) -> float:
        """FLOPs of the routed experts computed densely (every expert) over the ideal (k)."""
        return self.experts / self.k


def moe_shape(config) -> MoeShape | None:
    """The MoE fields of ``config`` (a transformers config), None for a dense model."""
    experts = next((getattr(config, f) for f in _EXPERTS if getattr(config, f, None)), 0)
    if not experts:
        return None
    k = config.num_experts_per_tok
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    layers = config.num_hidden_layers
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only = set(getattr(config, "mlp_only_layers", None) or [])
    moe = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    return MoeShape(
        experts,
        k,
        inter,
        shared,
        shared > 0 and config.model_type == "qwen2_moe",
        moe,
        layers - moe,
        config.intermediate_size,
    )


COUNTED = ("llama", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def param_counts(config) -> ParamCounts:
    """Parameter counts of ``config``'s causal LM (dense models: no experts, active = total).
    Families outside :data:`COUNTED` are counted on the meta-device model (one part: all
    parameters in ``dense_mlps``, or ``routed_experts`` for names holding ``.experts.``)."""
    if config.model_type not in COUNTED:
        return _counted_on_meta(config)
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // heads
    q, kvd = heads * hd, kv * hd
    kind = config.model_type
    attn = 2 * h * q + 2 * h * kvd
    if kind == "qwen2_moe" and getattr(config, "qkv_bias", True):
        attn += q + 2 * kvd
    elif getattr(config, "attention_bias", False):
        attn += q + 2 * kvd + h
    if kind == "qwen3_moe":
        attn += 2 * hd  # q_norm, k_norm over the head dim
    elif kind == "olmoe":
        attn += h + (h // heads) * kv  # q_norm over the q projection, k_norm over k's
    vocab = config.vocab_size
    embedding = vocab * h * (1 if config.tie_word_embeddings else 2)
    norms = (2 * layers + 1) * h
    shape = moe_shape(config)
    if shape is None:
        inter = config.intermediate_size
        bias = 2 * inter + h if getattr(config, "mlp_bias", False) else 0
        mlp = (3 * h * inter + bias) * layers
        return ParamCounts(embedding, attn * layers, norms, 0, 0, 0, mlp, 1, 1)
    n = shape.moe_layers
    return ParamCounts(
        embedding,
        attn * layers,
        norms,
        n * shape.experts * h,
        n * shape.experts * 3 * h * shape.expert_inter,
        n * (3 * h * shape.shared_inter + (h if shape.shared_gate else 0)),
        shape.dense_layers * 3 * h * shape.dense_inter,
        shape.experts,
        shape.k,
    )


def _counted_on_meta(config) -> ParamCounts:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = {id(p): (n, p.numel()) for n, p in model.named_parameters()}.values()
    routed = sum(n for name, n in params if ".experts." in name)
    rest = sum(n for _, n in params) - routed
    shape = moe_shape(config)
    e, k = (shape.experts, shape.k) if shape else (1, 1)
    return ParamCounts(0, 0, 0, 0, routed, 0, rest, e, k)


def dense_standin(config):
    """The LlamaConfig traced for an MoE ``config``: same attention, embeddings and depth; per
    layer a dense MLP of ``E*I + I_shared`` intermediate (layers of both kinds: their mean,
    rounded to a multiple of ``I``, so tp divides it when it divides ``I``)."""
    from transformers import LlamaConfig

    shape = moe_shape(config)
    per_moe = shape.experts * shape.expert_inter + shape.shared_inter
    inter = per_moe
    if shape.dense_layers:
        mean = (shape.moe_layers * per_moe + shape.dense_layers * shape.dense_inter) / (
            shape.moe_layers + shape.dense_layers
        )
        inter = max(1, round(mean / shape.expert_inter)) * shape.expert_inter
    heads = config.num_attention_heads
    return LlamaConfig(
        hidden_size=config.hidden_size,
        intermediate_size=inter,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=heads,
        num_key_value_heads=config.num_key_value_heads or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        vocab_size=config.vocab_size,
        rope_theta=getattr(config, "rope_theta", 10000.0),
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
    )


def tp_refusal(config, tp: int) -> str:
    """Why the tp-sharded MoE layer cannot run at ``tp`` ("" when it can): tp splits every
    expert's (and the shared expert's) intermediate dim."""
    shape = moe_shape(config)
    if shape is None:  # a dense model: no expert to split
        return ""
    dims = {"expert intermediate size": shape.expert_inter}
    if shape.shared_inter:
        dims["shared expert intermediate size"] = shape.shared_inter
    bad = {n: d for n, d in dims.items() if d % tp}
    if not bad:
        return ""
    name, dim = next(iter(bad.items()))
    return f"tp={tp} does not divide the {name} {dim}"


def summary(config, seq_len: int) -> list[str]:
    """Lines for the report: parameter counts, and for MoE the routing overhead traced."""
    c = param_counts(config)
    lines = [f"parameters: {c.total / 1e9:.2f}B total, {c.active / 1e9:.2f}B active per token"]
    shape = moe_shape(config)  # not None when there are experts
    if c.experts > 1 and shape is not None:
        lines.append(
            f"MoE: {c.experts} experts, top-{c.k}, {shape.moe_layers} MoE layer(s); routed "
            f"experts {c.routed_experts / 1e9:.2f}B (x{c.k}/{c.experts} per token), router "
            f"{c.routers / 1e6:.2f}M, shared experts {c.shared_experts / 1e6:.1f}M"
        )
        lines.append(
            "FLOPs: static dense routing (every expert computed on every token, no "
            f"data-dependent shapes) = {c.static_dense_overhead:.1f}x the routed experts' "
            f"FLOPs; per token {flops_per_token(config, seq_len, dense=True) / 1e9:.2f} GFLOP "
            f"computed vs {flops_per_token(config, seq_len) / 1e9:.2f} GFLOP from the active "
            "parameters (training: 6 x parameters + attention); MFU counts the active ones; "
            "one all-reduce per MoE layer forward and one backward, as a dense MLP"
        )
    return lines


def flops_per_token(config, seq_len: int, dense: bool = False) -> float:
    """Training matrix FLOPs per token (forward + backward = 3 x forward): 2 x the parameters a
    token multiplies (its active ones, or every expert when ``dense``; the input embedding is a
    lookup, unless tied to the output head) plus attention scores and values (``4 x seq x q
    dim`` per layer, every key counted as the traced sdpa computes them)."""
    c = param_counts(config)
    matmul = c.total if dense else c.active
    if not config.tie_word_embeddings:
        matmul -= config.vocab_size * config.hidden_size
    heads = config.num_attention_heads
    q = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 3.0 * (2 * matmul + 4 * seq_len * q * config.num_hidden_layers)
