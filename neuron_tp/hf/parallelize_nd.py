"""``parallelize`` on a 2d or 3d mesh: shard a Llama-family transformers model with the 2D
(SUMMA/Optimus, ``P = q*q``) or 3D (``P = q^3``) layers, in place.

The residual stream is in the mode's layout (2D: ``LAYOUT_2D`` ``[b/q, s, h/q]``; 3D:
``LAYOUT_3D_A`` ``[b/q^2, s, h/q]``): every rank gets the full ``input_ids`` / ``labels``
``[b, s]`` and keeps its batch chunk (the embedding takes that chunk of the ids). Heads are split
over the feature axis and sequences are never split, so attention (with its rotary embedding and
causal mask) runs locally on this rank's batch chunk and head chunk:

* ``embed_tokens`` -> :class:`Embedding2D` / :class:`Embedding3D`;
* ``q/k/v/o_proj``, ``gate/up/down_proj`` -> :class:`Linear2D` (3D: :class:`Linear3D`, ``ab``
  into the attention / MLP, ``ba`` out of it);
* ``input_layernorm``, ``post_attention_layernorm``, the final norm -> :class:`RMSNorm2D` /
  :class:`RMSNorm3D`;
* ``lm_head`` -> :class:`Classifier2D` / :class:`Classifier3D`; with ``labels`` the loss is
  :func:`cross_entropy_nd` of the vocab-sharded logits (HF's causal shift, ``ignore_index``
  -100, mean over every valid token of the global batch, or sum / ``num_items_in_batch``).

``model(ids).logits`` is the full (gathered) logits ``[b, s, vocab_size]``; with
``parallel_loss`` it stays this rank's block (batch chunk, vocab chunk),
:func:`neuron_tp.hf.full_logits` gathers it again. A vocabulary the split does not divide (q
for the head, q^2 for the 3D embedding) is padded with zero rows: the loss masks the padded
logit columns, the full logits are trimmed to ``vocab_size`` and ``gather_hf_state_dict``
drops the padding; the local block of ``parallel_loss`` has ``ceil(vocab_size / q)`` columns.
Everything that cannot be split is refused (ValueError) before any collective and before the
model is changed. A model whose parameters are on the meta device (``neuron_tp.from_pretrained``
builds one) gets meta-device sharded layers, which refuse to run until this rank's blocks are
loaded (:func:`neuron_tp.hf.from_pretrained` reads only those from the checkpoint).

Collectives of one decoder layer, forward + backward (pinned by tests/hf/test_hf_nd_hlo.py):
per linear (7) 2D: 4 all-gathers (X and W, again in backward) + 2 reduce-scatters (dX, dW)
over q ranks; 3D: 5 all-gathers + 3 reduce-scatters over q ranks; per RMSNorm (2) three
all-reduces (statistics forward and backward, weight gradient; 3D: the last over q^2 ranks).
Attention itself communicates nothing.
"""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING

from torch import nn

from ..layers.activation_layout import (
    LAYOUT_2D,
    LAYOUT_3D_B,
    ActivationLayout,
    residual_layout,
    split_input,
)
from ..layers.common import load_shards_from
from ..layers.linear_2d import Linear2D
from ..layers.linear_3d import Linear3D
from ..layers.norm_nd import RMSNorm2D, RMSNorm3D
from ..layers.vocab_nd import (
    Classifier2D,
    Classifier3D,
    Embedding2D,
    Embedding3D,
    cross_entropy_nd,
    gather_logits,
)
from ..parallel.mesh import Mesh, valid_tp_degrees
from ..parallel.state import ParallelState, attach
from .attention import Heads, is_supported_attention, model_heads, patch_attention_module

# Causal LMs with the Llama structure: model.embed_tokens / layers[i].{input_layernorm,
# self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj} / norm, lm_head.
SUPPORTED_ND = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")

if TYPE_CHECKING:
    # transformers is not analysed (pyproject): a Llama-family causal LM read by its attribute
    # names (``model.layers``, ``lm_head``, ``config``), a documented dynamic boundary.
    from transformers import PreTrainedModel


def logits_layout(mesh: Mesh) -> ActivationLayout:
    """Layout of the LM head output (3D: the classifier maps 3d-a to 3d-b)."""
    return LAYOUT_2D if mesh.tp_mode == "2d" else LAYOUT_3D_B


def parallelize_nd(
    model: nn.Module,
    mesh: Mesh,
    sequence_parallel: bool = False,
    parallel_loss: bool = False,
    plan: dict[str, str] | None = None,
) -> nn.Module:
    """:func:`neuron_tp.hf.parallelize` on a 2d/3d mesh (see the module docstring), called by
    it once the ranks agree on model and options."""
    if mesh.tp_mode not in ("2d", "3d"):
        raise ValueError(f"parallelize_nd needs a 2d or 3d mesh, got {mesh}")
    _validate(model, mesh, sequence_parallel, plan)  # no collective: same verdict on every rank
    built = _build(model, mesh)
    _install(model, built, mesh, parallel_loss)
    return model


# -- 1. validate ----------------------------------------------------------------------------


def _heads(config) -> Heads:
    """The head counts of a Llama-family config (ValueError without them)."""
    heads = model_heads(config)
    if heads is None:
        raise ValueError(f"{type(config).__name__}: no attention head counts")
    return heads


def _sizes(config, mesh_mode: str, q: int) -> list[tuple[str, int, int]]:
    """``(what, size, divisor)`` every split of ``mode`` with side ``q`` needs (the vocabulary
    needs none: the embedding and the LM head pad it to a multiple of their split)."""
    heads = _heads(config)
    hidden, ffn = config.hidden_size, config.intermediate_size
    attn = heads.q * heads.dim
    if mesh_mode == "2d":
        return [
            ("num_attention_heads", heads.q, q),
            ("num_key_value_heads", heads.kv, q),
            ("hidden_size", hidden, q),
            ("intermediate_size", ffn, q),
        ]
    return [
        ("num_attention_heads", heads.q, q),
        ("num_key_value_heads", heads.kv, q),
        ("hidden_size", hidden, q * q),  # the input features of an ab Linear3D
        ("num_attention_heads * head_dim", attn, q * q),  # o_proj (ba) input
        ("intermediate_size", ffn, q * q),  # down_proj (ba) input
    ]


def _valid_grids(config, mode: str, world_size: int) -> list[str]:
    """The 2D/3D grids (tp = q*q / q^3 dividing the world size) that split this model."""
    out = []
    for q in range(2, world_size + 1):
        tp = q * q if mode == "2d" else q**3
        if tp > world_size:
            break
        if world_size % tp == 0 and all(s % d == 0 for _, s, d in _sizes(config, mode, q)):
            out.append(f"q={q} (tp={tp})")
    return out


def _alternatives(config, world_size: int) -> str:
    heads = _heads(config)
    parts = []
    for mode in ("2d", "3d"):
        grids = _valid_grids(config, mode, world_size)
        parts.append(f"valid {mode.upper()} grids for this model: {grids or 'none'}")
    one = valid_tp_degrees(world_size, heads.q)
    parts.append(f"or tp_mode='1d' with tp in {one}")
    return "; ".join(parts)


def _validate(model: nn.Module, mesh: Mesh, sequence_parallel: bool, plan) -> None:
    """ValueError for anything this path cannot shard exactly (nothing is built or changed)."""
    name, mode = type(model).__name__, mesh.tp_mode
    q = mesh.grid_side
    if name not in SUPPORTED_ND:
        raise ValueError(
            f"{name}: tp_mode={mode!r} supports only {list(SUPPORTED_ND)} so far; "
            f"use tp_mode='1d' (ntp.init_mesh(tp=..., tp_mode='1d')) for this model"
        )
    if sequence_parallel:
        raise ValueError(
            f"{name}: sequence_parallel=True is a 1d option; a {mode} mesh already splits the "
            "batch (and the features), so use sequence_parallel=False"
        )
    if plan is not None:
        raise ValueError(
            f"{name}: a custom plan is a 1d option; tp_mode={mode!r} uses its fixed "
            "Llama-family layout (plan=None)"
        )
    meta_buffers = [n for n, b in model.named_buffers() if b.is_meta]
    if meta_buffers:  # meta parameters are fine (loaded afterwards), meta buffers never are
        raise ValueError(
            f"{name}: a meta-device model with meta buffers (e.g. {meta_buffers[0]}, built "
            f"under torch.device('meta')) cannot run on a {mode} mesh: nothing loads buffers. "
            "Use neuron_tp.from_pretrained(path, mesh) (parameters on meta, buffers real, "
            "each rank reads only its blocks), or load the full model with transformers; "
            "unlike tp_mode='1d', meta buffers are refused here"
        )
    cfg = model.config
    impl = getattr(cfg, "_attn_implementation", None)
    if not is_supported_attention(impl):
        raise ValueError(
            f"{name}: attention implementation {impl!r} is not supported under tensor "
            "parallelism; load with attn_implementation='sdpa' or 'eager'"
        )
    if getattr(cfg, "tie_word_embeddings", False):
        raise ValueError(
            f"{name}: tie_word_embeddings=True is not supported on a {mode} mesh (the "
            "embedding and the LM head split the table over different axes); untie them "
            "or use tp_mode='1d'"
        )
    for what, size, d in _sizes(cfg, mode, q):
        if size % d:
            raise ValueError(
                f"{name}: {mode.upper()} q={q} needs {what} divisible by {d}; got {size}: "
                f"{_alternatives(cfg, mesh.world_size)}"
            )
    _check_modules(model, name)


def _check_modules(model: nn.Module, name: str) -> None:
    """The modules are where and what the Llama layout says (plain linears, plain RMSNorms)."""
    from .norms import check_plain_rms_norm

    base = getattr(model, "model", None)
    if (
        base is None
        or not isinstance(getattr(base, "embed_tokens", None), nn.Embedding)
        or not isinstance(getattr(model, "lm_head", None), nn.Linear)
    ):
        raise ValueError(f"{name}: expected model.embed_tokens (nn.Embedding) and lm_head")
    norms = [("model.norm", base.norm)]
    for i, layer in enumerate(base.layers):
        for child, names in (("self_attn", _ATTN), ("mlp", _MLP)):
            for n in names:
                lin = getattr(getattr(layer, child, None), n, None)
                if type(lin) is not nn.Linear:
                    raise ValueError(
                        f"{name}: model.layers.{i}.{child}.{n} is {type(lin).__name__}, not "
                        "nn.Linear (quantized or custom projections are not supported on a "
                        "2d/3d mesh)"
                    )
        norms += [(f"model.layers.{i}.{n}", getattr(layer, n)) for n in _NORMS]
    for n, norm in norms:
        check_plain_rms_norm(norm, n, norm.weight.shape[0])


# -- 2. build -------------------------------------------------------------------------------


def _linear(mesh: Mesh, lin: nn.Linear, orientation: str) -> nn.Module:
    if mesh.tp_mode == "2d":
        return Linear2D.from_linear(lin, mesh)
    return Linear3D.from_linear(lin, mesh, orientation=orientation)


def _norm(mesh: Mesh, norm: nn.Module) -> nn.Module:
    cls = RMSNorm2D if mesh.tp_mode == "2d" else RMSNorm3D
    w = norm.get_parameter("weight")
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
    layer = cls(w.shape[0], eps=eps, mesh=mesh, device="meta", dtype=w.dtype)
    return load_shards_from(layer, norm)


def _build(model: PreTrainedModel, mesh: Mesh) -> dict[str, nn.Module]:
    """``{module name: sharded replacement}`` (the model is not touched)."""
    base = model.model
    out: dict[str, nn.Module] = {}
    emb = Embedding3D if mesh.tp_mode == "3d" else Embedding2D
    out["model.embed_tokens"] = emb.from_embedding(base.embed_tokens, mesh)
    for i, layer in enumerate(base.layers):
        p = f"model.layers.{i}"
        for n in _ATTN:
            lin = getattr(layer.self_attn, n)
            out[f"{p}.self_attn.{n}"] = _linear(mesh, lin, "ba" if n == "o_proj" else "ab")
        for n in _MLP:
            lin = getattr(layer.mlp, n)
            out[f"{p}.mlp.{n}"] = _linear(mesh, lin, "ba" if n == "down_proj" else "ab")
        for n in _NORMS:
            out[f"{p}.{n}"] = _norm(mesh, getattr(layer, n))
    out["model.norm"] = _norm(mesh, base.norm)
    head = Classifier3D if mesh.tp_mode == "3d" else Classifier2D
    out["lm_head"] = head.from_linear(model.lm_head, mesh)
    return out


# -- 3. install -----------------------------------------------------------------------------


def _install(model: PreTrainedModel, built: dict[str, nn.Module], mesh: Mesh, parallel_loss: bool):
    from .meta_guard import guard_meta

    for name, new in built.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, new)
    heads = _heads(model.config)
    q = mesh.grid_side
    for layer in model.model.layers:
        patch_attention_module(layer.self_attn, heads, q, heads.kv // q)
    # full_logits() toggles this: False keeps the LM head output as this rank's block.
    model.lm_head.gather_output = not parallel_loss
    attach(model, ParallelState(mesh, parallel_loss, sequence_parallel=False))
    guard_meta(model)  # built from a meta-device model: refuses to run until loaded
    _wrap_forward(model, mesh)


def _wrap_forward(model: PreTrainedModel, mesh: Mesh) -> None:
    """Full ``input_ids`` (and ``attention_mask`` / ``position_ids`` / ``labels``) in, this
    rank's batch chunk through the model, the loss from the sharded logits. On a 3d mesh the
    per-sample ``attention_mask`` / ``position_ids`` are the 3d-b chunk (that of q/k/v), so the
    causal mask and rotary tables HF builds from them match the samples attention sees."""
    forward = model.forward
    sig = inspect.signature(forward)
    name = type(model).__name__
    res, out_layout = residual_layout(mesh.tp_mode), logits_layout(mesh)
    nb = res.batch_split(mesh)
    vocab_size = model.lm_head.vocab_size  # the true vocabulary (the head may be padded)
    # attention_mask / position_ids only feed the causal mask and the rotary tables, which only
    # the attention core reads: they take the batch chunk of q/k/v (3D: 3d-b, after the "ab"
    # q/k/v projections), not that of the residual stream (3d-a). Both chunks have b/q^2 rows.
    attn_layout = LAYOUT_3D_B if mesh.tp_mode == "3d" else res

    @functools.wraps(forward)
    def wrapped(*args, **kwargs):
        bound = sig.bind_partial(*args, **kwargs)
        a = bound.arguments
        labels = a.pop("labels", None)
        extra = a.get("kwargs", {})
        if a.get("inputs_embeds") is not None:
            raise ValueError(
                f"{name} on a {mesh.tp_mode} mesh takes input_ids (the embedding is "
                "sharded), not inputs_embeds"
            )
        ids = a.get("input_ids")
        if ids is None:
            raise ValueError(f"{name} on a {mesh.tp_mode} mesh needs input_ids")
        b = ids.shape[0]
        if b % nb:
            raise ValueError(
                f"{name} on a {mesh.tp_mode} mesh (q={mesh.grid_side}) splits the batch "
                f"into {nb} chunks: batch size must be divisible by {nb}, got {b}"
            )
        a["input_ids"] = split_input(ids, res, mesh, feature_dim=False)
        for key in ("attention_mask", "position_ids"):
            if a.get(key) is not None:
                a[key] = _split_batch(a[key], attn_layout, mesh, b, f"{name} {key}")
        out = forward(*bound.args, **bound.kwargs)
        logits = out.logits
        if labels is not None:
            # HF's causal-LM shift: token t predicts label t+1; the last position is ignored.
            shifted = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            local = split_input(shifted.to(logits.device), out_layout, mesh, feature_dim=False)
            n_items = extra.get("num_items_in_batch")
            loss = cross_entropy_nd(
                logits,
                local,
                out_layout,
                mesh,
                reduction="mean" if n_items is None else "sum",
                vocab_size=vocab_size,
            )
            out.loss = loss if n_items is None else loss / n_items
        if model.lm_head.gather_output:
            out.logits = gather_logits(logits, out_layout, mesh, vocab_size)
        return out

    model.forward = wrapped


def _split_batch(t, layout: ActivationLayout, mesh: Mesh, b: int, what: str):
    """The batch chunk in ``layout`` of a per-sample ``[b, ...]`` tensor (``attention_mask``,
    ``position_ids``), or of every such tensor of a dict of masks (one per layer type); shared
    ``[1, ...]`` tensors (one ``position_ids`` row for every sample) pass unchanged. A plain
    local chunk: no autograd, no layout tag (a float mask is added to the attention scores)."""
    import torch

    from ..parallel import comm

    if isinstance(t, dict):
        return {k: _split_batch(v, layout, mesh, b, f"{what}[{k!r}]") for k, v in t.items()}
    if t is None or not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == 1:
        return t
    if t.shape[0] != b:
        raise ValueError(f"{what}: batch size {t.shape[0]} does not match input_ids' {b}")
    return comm.local_chunk(t, mesh.group(layout.batch_group), 0)
