"""``parallelize``: shard a transformers model in place, driven by a tensor-parallel plan."""
from __future__ import annotations

import contextlib
import copy
import functools

import torch
from torch import nn

from ..layers import parallel_cross_entropy
from ..mesh import Mesh, get_mesh
from ..sharding import (Sharding, copy_param_meta, get_sharding, mark_sequence_parallel,
                        mark_sharded, shard_of)
from . import modules as M
from .attention import (ShardedRMSNorm, check_heads, is_plain_split, kv_slots, model_heads,
                        patch_attention_module)
from .layout import HFLayout, even_pieces, set_layout
from .plans import check_split_pairs, match_modules, resolve_plan
from .sequence_parallel import (apply_sequence_parallel, check_sequence_parallel, find_layers,
                                install_input_region)

_COLWISE = ("colwise", "colwise_gather_output", "packed_colwise", "packed_qkv")


def _is_attention(mod: nn.Module) -> bool:
    n = type(mod).__name__.lower()
    return "attention" in n or "attn" in n


def _owns_input(mod: nn.Module) -> bool:
    """Attention / MLP modules feed their own input to all their column-parallel children,
    so one input region (one all-reduce or all-gather) serves them all."""
    n = type(mod).__name__.lower()
    return any(k in n for k in ("attention", "attn", "mlp", "intermediate", "feedforward"))


def _split(name: str) -> tuple[str, str]:
    return tuple(name.rsplit(".", 1)) if "." in name else ("", name)


def _kv_rows(heads, tp: int, offset: int) -> list[list[int]]:
    return [[offset + h * heads.dim + i for h in slots for i in range(heads.dim)]
            for slots in kv_slots(heads, tp)]


def _attention_column(mod, name, style, heads, mesh):
    """A q/k/v (or fused qkv) projection of an attention module, split per head."""
    tp, world = mesh.tp_size, mesh.world_size
    check_heads(heads, tp, world, name)
    out = M.linear_view(mod, name)[0].shape[0]
    q, kv = heads.q * heads.dim, heads.kv * heads.dim
    plain = is_plain_split(kv_slots(heads, tp), heads.kv)
    if style == "packed_qkv":
        if out != q + 2 * kv:
            raise ValueError(f"{name}: packed_qkv expects {q}+2*{kv} output features, got {out}")
        if plain:
            return M.column(mod, name, mesh, segments=[q, kv, kv])
        qrows = [list(range(r * q // tp, (r + 1) * q // tp)) for r in range(tp)]
        krows, vrows = _kv_rows(heads, tp, q), _kv_rows(heads, tp, q + kv)
        rows = [a + b + c for a, b, c in zip(qrows, krows, vrows)]
        return M.column(mod, name, mesh, rows, segments=[q, len(krows[0]) * tp,
                                                         len(vrows[0]) * tp], replicated_from=q)
    if out == kv and heads.kv != heads.q and not plain:
        return M.column(mod, name, mesh, _kv_rows(heads, tp, 0), replicated_from=0)
    return M.column(mod, name, mesh, segments=[out // 2] * 2 if style == "packed_colwise" else None)


def _set(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, attr = _split(name)
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def _tie_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    seen: dict[int, list[tuple[str, str]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            seen.setdefault(id(p), []).append((mname, pname))
    return [g for g in seen.values() if len(g) > 1]


def parallelize(model: nn.Module, mesh: Mesh | None = None, sequence_parallel: bool = False,
                parallel_loss: bool = False, plan: dict[str, str] | None = None) -> nn.Module:
    """Shard a transformers model over the tensor-parallel group of ``mesh`` (in place).

    Every rank must hold the same full model (same weights) or the same meta-device model.
    ``model(input_ids).logits`` stays the full logits; with ``parallel_loss`` the LM head
    output stays vocab-sharded (``[..., ceil(V/tp)]`` on each rank) and, when ``labels`` are
    given, the loss is computed by :func:`neuron_tp.parallel_cross_entropy`. With
    ``sequence_parallel`` the residual stream is sequence-sharded (sequence length must be a
    multiple of tp; generation with a KV cache needs it off). After ``backward`` call
    :func:`neuron_tp.sync_sequence_parallel_grads` (replicated parameters that saw only part
    of the data on each rank). Collective over tp: first verifies that every tp rank holds
    the same model, weights (checksums; skipped for meta-device ones) and options
    (:class:`neuron_tp.agreement.RankMismatchError` on every rank otherwise); then raises
    ValueError, identically on every rank, for what cannot be sharded exactly.
    """
    mesh = get_mesh(mesh)
    if getattr(model, "_ntp_parallel", False):
        raise ValueError(f"{type(model).__name__} is already parallelized")
    from ..agreement import check_same_model
    check_same_model(model, mesh.tp, {"plan": plan, "sequence_parallel": sequence_parallel,
                                      "parallel_loss": parallel_loss, "tp": mesh.tp_size,
                                      "tp_mode": mesh.tp_mode},
                     what=f"parallelize({type(model).__name__})")
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("eager", "sdpa", None):
        raise ValueError(f"{type(model).__name__}: attention implementation {impl!r} is not "
                         "supported under tensor parallelism; load with attn_implementation="
                         "'sdpa' or 'eager'")
    heads = model_heads(model.config)
    resolved = resolve_plan(model, plan)
    targets = match_modules(model, resolved)
    if plan is not None:
        unmatched = [k for k in resolved if not match_modules(model, {k: resolved[k]})]
        if unmatched:
            raise ValueError(f"{type(model).__name__}: plan patterns {unmatched} match no "
                             "module (nothing would be sharded for them); module names look "
                             f"like {[n for n, _ in model.named_modules()][1:6]}")
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = find_layers(model)
    layers_prefix = found[0] + "." if found else None
    ties = _tie_groups(model)

    # Validate everything first (the ranks agree on model and options: same outcome on all).
    if sequence_parallel:
        check_sequence_parallel(model)
    head = [n for n, m in model.named_modules() if out_emb is not None and m is out_emb]
    check_split_pairs(model, targets, _owns_input, gathered=tuple(head))
    for name, style in targets.items():
        mod = model.get_submodule(name)
        parent = model.get_submodule(_split(name)[0]) if _split(name)[0] else model
        if style in _COLWISE and mod is not out_emb and _is_attention(parent) and heads is None:
            raise ValueError(f"{name}: attention projection but the config has no head counts")

    plan_parents: dict[str, list[nn.Module]] = {}
    replacements: list[tuple[str, nn.Module]] = []
    grad_allreduce: list[nn.Module] = []
    attn_parents: dict[str, nn.Module] = {}
    for name, style in targets.items():
        mod = model.get_submodule(name)
        pname = _split(name)[0]
        parent = model.get_submodule(pname) if pname else model
        in_layers = layers_prefix is not None and name.startswith(layers_prefix)
        if style in _COLWISE:
            if mod is out_emb or (style == "colwise_gather_output" and not in_layers):
                new = M.column(mod, name, mesh, pad_output=True, gather_output=not parallel_loss)
            elif style == "colwise_gather_output":
                new = M.column(mod, name, mesh, gather_output=True)
            elif _is_attention(parent):
                new = _attention_column(mod, name, style, heads, mesh)
                attn_parents[pname] = parent
            else:
                new = M.column(mod, name, mesh, segments=None if style != "packed_colwise"
                               else [M.linear_view(mod, name)[0].shape[0] // 2] * 2)
            if not new.gather_output and pname and _owns_input(parent):
                plan_parents.setdefault(pname, []).append(new)
            elif not new.gather_output and sequence_parallel and in_layers:
                raise ValueError(
                    f"{name}: sequence_parallel needs column-parallel projections inside an "
                    f"attention or MLP module (this one sits in {type(parent).__name__}, whose "
                    "sequence layout is unknown); use sequence_parallel=False for this model")
        elif style in ("rowwise", "rowwise_split_input"):
            new = M.row(mod, name, mesh, style == "rowwise", sequence_parallel and in_layers)
        elif style == "embedding_rowwise":
            new = M.embedding(mod, name, mesh)
        elif style == "replicated_with_grad_allreduce":
            grad_allreduce.append(mod)
            continue
        else:  # sharded_norm
            new = _sharded_norm(mod, name, mesh, heads)
        replacements.append((name, new))

    # Everything validated and built: only now is the model modified.
    for name, new in replacements:
        _set(model, name, new)
    for mod in grad_allreduce:
        mark_sequence_parallel(mod)

    tp = mesh.tp_size
    for pname, parent in attn_parents.items():
        patch_attention_module(parent, heads, tp, len(kv_slots(heads, tp)[0]))
    for pname, children in plan_parents.items():
        sp_here = sequence_parallel and layers_prefix is not None and \
            (pname + ".").startswith(layers_prefix)
        install_input_region(model.get_submodule(pname), children, mesh, sp_here)
    _retie(model, ties)
    if sequence_parallel:
        apply_sequence_parallel(model, mesh)
    model._ntp_parallel, model._ntp_mesh = True, mesh
    _guard_meta(model)
    model._ntp_parallel_loss, model._ntp_sequence_parallel = parallel_loss, sequence_parallel
    if parallel_loss:
        _wrap_loss(model, mesh)
    return model


def _guard_meta(model: nn.Module) -> None:
    """A model parallelized on the meta device refuses to run until its weights are loaded
    (the hook removes itself at the first forward that finds none left on meta)."""
    if not any(p.is_meta for p in model.parameters()):
        return

    def check(module, args, kwargs):
        left = [n for n, p in module.named_parameters() if p.is_meta]
        if left:
            raise ValueError(
                f"{type(module).__name__}: {len(left)} parameters (e.g. {left[0]}) are still on "
                "the meta device: the model was parallelized without weights. Load them first: "
                "neuron_tp.from_pretrained(path, mesh) reads each rank's slices of a HF "
                "checkpoint; or parallelize a model built with real weights")
        handle.remove()

    handle = model.register_forward_pre_hook(check, with_kwargs=True)


def _sharded_norm(mod, name, mesh, heads) -> nn.Module:
    w = mod.weight
    full = w.shape[0]
    M.require(full, mesh.tp_size, mesh.world_size, name, "normalized features")
    if heads is not None and full == heads.kv * heads.dim and heads.kv % mesh.tp_size:
        ok = [d for d in range(1, mesh.world_size + 1)
              if mesh.world_size % d == 0 and heads.kv % d == 0 and heads.q % d == 0]
        raise ValueError(f"{name}: a norm over all key/value heads cannot be sharded when "
                         f"num_key_value_heads={heads.kv} is not divisible by tp="
                         f"{mesh.tp_size}; tp degrees that work: {ok}")
    _check_plain_rms_norm(mod, name, full)
    sh = Sharding((("tp", 0),), (full,))
    norm = ShardedRMSNorm(mod, mesh, full)
    norm.weight = nn.Parameter(shard_of(w.detach(), sh, mesh).clone(),
                               requires_grad=w.requires_grad)
    mark_sharded(norm, "weight", sh)
    set_layout(norm, "weight", HFLayout(0, tuple(even_pieces(full, mesh.tp_rank, mesh.tp_size))))
    return norm


def _check_plain_rms_norm(mod: nn.Module, name: str, features: int) -> None:
    """``sharded_norm`` re-implements ``weight * x / rms(x)``: check the module computes that."""
    probe = copy.deepcopy(mod).to_empty(device="cpu").float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(features, generator=gen) + 0.5)
        x = torch.randn(3, features, generator=gen)
        eps = getattr(probe, "variance_epsilon", getattr(probe, "eps", 1e-6))
        want = probe.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ok = torch.allclose(probe(x), want, atol=1e-5)
    if not ok:
        raise ValueError(f"{name}: sharded_norm needs a plain RMSNorm (weight * x / rms(x)); "
                         f"{type(mod).__name__} computes something else")


def _retie(model: nn.Module, ties) -> None:
    """Re-share parameters that were tied (embedding / LM head) after sharding."""
    for group in ties:
        owners = [(model.get_submodule(m) if m else model, p) for m, p in group]
        params = [getattr(o, p) for o, p in owners]
        sharded = [p for (o, n), p in zip(owners, params) if get_sharding(o, n) is not None]
        if not sharded:
            continue
        keep = sharded[0]
        keep_owner = next(on for on, p in zip(owners, params) if p is keep)
        for (m, p), (o, n), cur in zip(group, owners, params):
            if cur is not keep:
                if get_sharding(o, n) is not None and cur.shape != keep.shape:
                    raise ValueError(f"{m}.{p}: tied to a parameter sharded differently "
                                     f"({tuple(cur.shape)} vs {tuple(keep.shape)})")
                setattr(o, n, keep)
                copy_param_meta(*keep_owner, o, n)


@contextlib.contextmanager
def full_logits(model: nn.Module):
    """Inside this context a ``parallel_loss`` model returns full (gathered) logits, e.g. for
    ``generate()`` or evaluation; outside it the LM head output stays vocab-sharded."""
    head = model.get_output_embeddings()
    if not hasattr(head, "gather_output"):
        raise ValueError(f"{type(model).__name__} is not parallelized (no sharded LM head)")
    before = head.gather_output
    head.gather_output = True
    try:
        yield model
    finally:
        head.gather_output = before


def _is_causal(model: nn.Module) -> bool:
    n = type(model).__name__
    return "CausalLM" in n or "LMHead" in n


def _wrap_loss(model: nn.Module, mesh: Mesh) -> None:
    """With ``labels``: loss from the vocab-sharded logits (HF's shift for causal LMs)."""
    forward = model.forward
    vocab = model.config.vocab_size
    causal = _is_causal(model)

    @functools.wraps(forward)
    def wrapped(*args, labels=None, **kwargs):
        out = forward(*args, **kwargs)
        if labels is not None:
            logits = out.logits
            if causal:
                labels = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
            # HF gradient accumulation (causal LMs' loss_function): sum / num_items_in_batch
            n_items = kwargs.get("num_items_in_batch") if causal else None
            out.loss = parallel_cross_entropy(logits, labels.to(logits.device), mesh=mesh,
                                              vocab_size=vocab,
                                              reduction="mean" if n_items is None else "sum")
            if n_items is not None:
                out.loss = out.loss / n_items
        return out

    model.forward = wrapped
