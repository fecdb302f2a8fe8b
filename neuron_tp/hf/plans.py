"""Tensor-parallel plans: which module of a transformers model is sharded how.

A plan maps module-name patterns (``*`` = one path component, e.g. a layer index) to a style:

- ``colwise``: output features split (per attention head for q/k/v projections; GQA key/value
  heads that tp does not divide are replicated on as few ranks as needed).
- ``colwise_gather_output``: like colwise, the full output gathered (the LM head: vocab padded
  to a multiple of tp; with ``parallel_loss`` it stays vocab-sharded).
- ``rowwise``: input features split, partial outputs summed; ``rowwise_split_input``: the same
  for a replicated input (it is split first).
- ``packed_colwise``: two packed projections (gate_up) split per half; ``packed_qkv``: a fused
  ``[q | k | v]`` projection split per head of each part.
- ``embedding_rowwise``: vocabulary-parallel embedding.
- ``replicated_with_grad_allreduce``: kept whole, gradients summed over tp after backward.
- ``sharded_norm``: an RMSNorm over features sharded like the preceding projection.

Plans come from ``plan=``, a built-in plan below, or the one transformers ships
(``model._tp_plan`` / ``config.base_model_tp_plan``), in that order.
"""
from __future__ import annotations

import re

import torch
from torch import nn

STYLES = ("colwise", "colwise_gather_output", "rowwise", "rowwise_split_input", "packed_colwise",
          "packed_qkv", "embedding_rowwise", "replicated_with_grad_allreduce", "sharded_norm")

_LLAMA_LIKE = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise", "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}

# Base-model plans (names relative to the base model), for models whose shipped plan is
# missing or replicates what can be sharded (Phi-3's fused qkv/gate_up, OLMo-2's q/k norms).
BUILTIN_BASE_PLANS: dict[str, dict[str, str]] = {
    "phi3": {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn.qkv_proj": "packed_qkv", "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_up_proj": "packed_colwise", "layers.*.mlp.down_proj": "rowwise",
    },
    "olmo2": {**_LLAMA_LIKE, "layers.*.self_attn.q_norm": "sharded_norm",
              "layers.*.self_attn.k_norm": "sharded_norm"},
    "gpt2": {
        "wte": "embedding_rowwise",
        "h.*.attn.c_attn": "packed_qkv", "h.*.attn.c_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise",
    },
    "bert": {
        "embeddings.word_embeddings": "embedding_rowwise",
        "encoder.layer.*.attention.self.query": "colwise",
        "encoder.layer.*.attention.self.key": "colwise",
        "encoder.layer.*.attention.self.value": "colwise",
        "encoder.layer.*.attention.output.dense": "rowwise",
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    },
    "opt": {
        "decoder.embed_tokens": "embedding_rowwise",
        "decoder.layers.*.self_attn.q_proj": "colwise",
        "decoder.layers.*.self_attn.k_proj": "colwise",
        "decoder.layers.*.self_attn.v_proj": "colwise",
        "decoder.layers.*.self_attn.out_proj": "rowwise",
        "decoder.layers.*.fc1": "colwise", "decoder.layers.*.fc2": "rowwise",
    },
    "gpt_neo": {
        "wte": "embedding_rowwise",
        "h.*.attn.attention.q_proj": "colwise", "h.*.attn.attention.k_proj": "colwise",
        "h.*.attn.attention.v_proj": "colwise", "h.*.attn.attention.out_proj": "rowwise",
        "h.*.mlp.c_fc": "colwise", "h.*.mlp.c_proj": "rowwise",
    },
    "gptj": {
        "wte": "embedding_rowwise",
        "h.*.attn.q_proj": "colwise", "h.*.attn.k_proj": "colwise",
        "h.*.attn.v_proj": "colwise", "h.*.attn.out_proj": "rowwise",
        "h.*.mlp.fc_in": "colwise", "h.*.mlp.fc_out": "rowwise",
    },
}
BUILTIN_BASE_PLANS["roberta"] = BUILTIN_BASE_PLANS["bert"]


def _falcon_plan(config) -> dict[str, str]:
    """Falcon: multi-query ``[q heads | k | v]`` is packed_qkv, multi-head interleaves q/k/v
    per head (a plain split by heads); the grouped new_decoder_architecture and ALiBi (biases
    for all heads built outside the attention) are refused."""
    if getattr(config, "new_decoder_architecture", False) or getattr(config, "alibi", False):
        raise ValueError("falcon: new_decoder_architecture / alibi models are not supported "
                         "(grouped fused qkv layout, ALiBi over all heads); pass plan= to "
                         "shard only the MLPs")
    qkv = "packed_qkv" if getattr(config, "multi_query", False) else "colwise"
    return {"word_embeddings": "embedding_rowwise",
            "h.*.self_attention.query_key_value": qkv, "h.*.self_attention.dense": "rowwise",
            "h.*.mlp.dense_h_to_4h": "colwise", "h.*.mlp.dense_4h_to_h": "rowwise"}


BUILTIN_PLAN_FACTORIES = {"falcon": _falcon_plan}

# The LM head (``get_output_embeddings()``) is always ``colwise_gather_output``.


def _compile(pattern: str) -> re.Pattern:
    return re.compile("^" + r"[^.]+".join(re.escape(p) for p in pattern.split("*")) + "$")


def resolve_plan(model: nn.Module, plan: dict[str, str] | None = None) -> dict[str, str]:
    """The plan for ``model`` as ``{full module-name pattern: style}``."""
    if plan is None:
        model_type = getattr(model.config, "model_type", None)
        prefix = getattr(model, "base_model_prefix", "")
        has_prefix = bool(prefix) and hasattr(model, prefix)
        base = BUILTIN_BASE_PLANS.get(model_type)
        if model_type in BUILTIN_PLAN_FACTORIES:
            base = BUILTIN_PLAN_FACTORIES[model_type](model.config)
        if base is None:
            base = dict(getattr(model.config, "base_model_tp_plan", None) or {})
            shipped = dict(getattr(model, "_tp_plan", None) or {})
            if not base and not shipped:
                raise ValueError(
                    f"{type(model).__name__}: no tensor-parallel plan (model_type "
                    f"{model_type!r} ships none and there is no built-in one); pass "
                    f"plan={{'module.pattern': style}} with styles from {STYLES}")
            emb = model.get_input_embeddings()
            for name, mod in model.named_modules():
                if mod is emb:
                    shipped.setdefault(name, "embedding_rowwise")
        else:
            shipped = {}
        plan = {(f"{prefix}.{k}" if has_prefix else k): v for k, v in base.items()}
        plan.update(shipped)
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        for name, mod in model.named_modules():
            if head is not None and mod is head:
                plan = {k: v for k, v in plan.items() if not _compile(k).match(name) or
                        v == "colwise_gather_output"}
                plan[name] = "colwise_gather_output"
    bad = {k: v for k, v in plan.items() if v not in STYLES}
    if bad:
        raise ValueError(f"{type(model).__name__}: unsupported tensor-parallel styles {bad}; "
                         f"supported styles: {STYLES}")
    return dict(plan)


def match_modules(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """``{module name: style}`` for every module a plan pattern names (exact full names)."""
    compiled = [(_compile(k), v) for k, v in plan.items()]
    found: dict[str, str] = {}
    for name, _ in model.named_modules():
        for rx, style in compiled:
            if rx.match(name):
                found[name] = style
    return found


_SPLIT_OUTPUT = ("colwise", "packed_colwise", "packed_qkv")  # output stays split over tp
_SPLIT_INPUT = ("rowwise",)  # expects its input split over tp


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def check_split_pairs(model: nn.Module, targets: dict[str, str], owns_input,
                      gathered: tuple[str, ...] = ()) -> None:
    """Refuse a plan whose split activations have no consumer (ValueError naming the module
    and the plan entry that would work): a projection whose output stays split over tp
    (``colwise``) needs a ``rowwise`` one after it, and a ``rowwise`` one needs a split
    producer before it. Judged on the module tree: the nearest ancestor of a projection that
    contains a partner decides; its partners must come after (before) it in registration order
    unless the ancestor is an attention / MLP module (``owns_input(module)``), which is self
    contained. ``gathered``: modules whose output is gathered whatever their style (LM head)."""
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}

    def linear(n: str) -> bool:  # other modules are refused with their own error later
        w = getattr(model.get_submodule(n), "weight", None)
        return isinstance(w, torch.Tensor) and w.dim() == 2

    for name, style in targets.items():
        if name in gathered or style not in _SPLIT_OUTPUT + _SPLIT_INPUT or not linear(name):
            continue
        producer = style in _SPLIT_OUTPUT
        want = _SPLIT_INPUT if producer else _SPLIT_OUTPUT
        partners = [n for n, s in targets.items() if s in want and n not in gathered
                    and linear(n)]
        parts = name.split(".")
        ok = False
        for depth in range(len(parts) - 1, -1, -1):
            scope = ".".join(parts[:depth])
            inside = [n for n in partners if n.startswith(scope + ".") or not scope]
            if inside:
                ok = owns_input(model.get_submodule(scope)) or any(
                    (order[n] > order[name]) == producer for n in inside)
                break
        if ok:
            continue
        home = next((".".join(parts[:d]) for d in range(len(parts) - 1, 0, -1)
                     if owns_input(model.get_submodule(".".join(parts[:d])))),
                    ".".join(parts[:-1]))
        where = f"{home} ({type(model.get_submodule(home)).__name__})" if home else "the model"
        cands = [_pattern(n) for n, m in model.get_submodule(home).named_modules(prefix=home)
                 if n != name and n in order and linear(n) and (order[n] > order[name]) == producer]
        if producer:
            fix = (f"put {{{cands[-1]!r}: 'rowwise'}} (the projection that reads its output)"
                   if cands else "put the projection that reads its output as 'rowwise'")
            raise ValueError(
                f"plan: {name} is {style!r} (its output stays split over tp) but nothing after "
                f"it in {where} is 'rowwise' to consume the split features, so the next module "
                f"would get 1/tp of them; {fix} to the plan, or use 'colwise_gather_output' for "
                f"{_pattern(name)!r}")
        entries = ", ".join(f"{c!r}: 'colwise'" for c in cands)
        fix = (f"mark the projection(s) feeding it 'colwise' ({{{entries}}})"
               if cands else "mark the projection feeding it 'colwise'")
        raise ValueError(
            f"plan: {name} is 'rowwise' (it expects its input split over tp) but nothing before "
            f"it in {where} is colwise; {fix}, or use 'rowwise_split_input' for "
            f"{_pattern(name)!r} to split a replicated input")
