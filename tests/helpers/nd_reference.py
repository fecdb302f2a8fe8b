"""Shared checks of the 2D/3D layers against plain-torch computations on full tensors.

Every check builds full inputs identical on all ranks, computes the unsharded reference with
plain torch ops, runs the sharded layer on this rank's block and compares the gathered output,
the input gradient (through split_input's backward) and every gathered parameter gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import neuron_tp as ntp
from neuron_tp.blocks.block_nd import TransformerBlockND
from neuron_tp.layers import nd
from reference import assert_close

HID, HEADS, FFN, VOCAB, S = 12, 2, 20, 20, 3


def _grads_match(module: nn.Module, ref_grads: dict, mesh, what: str, scale: float = 1.0):
    for name, got in ntp.gather_params(module, mesh, grads=True).items():
        assert_close(got, ref_grads[name] * scale, f"{what}: grad of {name}")


def check_layer(
    layer: nn.Module, ref: nn.Module, in_layout, out_layout, mesh, x_shape, what: str
) -> None:
    """``layer`` (sharded from ``ref``) vs ``ref``: output, input grad, parameter grads."""
    torch.manual_seed(5)
    x_full = torch.randn(x_shape)
    y_ref = ref(x_full.clone().requires_grad_(True))
    g_full = torch.randn_like(y_ref)
    x_ref = x_full.clone().requires_grad_(True)
    ref.zero_grad()
    (ref(x_ref) * g_full).sum().backward()

    x = x_full.clone().requires_grad_(True)
    y = layer(nd.split_input(x, in_layout, mesh))
    (y * nd.split_input(g_full, out_layout, mesh)).sum().backward()
    assert_close(nd.gather_output(y.detach(), out_layout, mesh), y_ref.detach(), f"{what}: out")
    assert_close(x.grad, x_ref.grad, f"{what}: input grad")
    _grads_match(layer, {n: p.grad for n, p in ref.named_parameters()}, mesh, what)


def check_one_grad(layer, ref, in_layout, out_layout, mesh, x_shape, what: str) -> None:
    """Backward needing one operand's gradient only: a frozen weight (the input gradient
    alone), then an input without grad (the parameter gradients alone)."""
    torch.manual_seed(6)
    x_full = torch.randn(x_shape)
    g_full = torch.randn(*x_shape[:-1], ref.out_features)
    g = nd.split_input(g_full, out_layout, mesh)
    x_ref = x_full.clone().requires_grad_(True)
    ref.zero_grad()
    (ref(x_ref) * g_full).sum().backward()
    layer.zero_grad()
    layer.weight.requires_grad_(False)
    x = x_full.clone().requires_grad_(True)
    (layer(nd.split_input(x, in_layout, mesh)) * g).sum().backward()
    assert_close(x.grad, x_ref.grad, f"{what}: input grad (frozen weight)")
    layer.weight.requires_grad_(True)
    layer.zero_grad()
    (layer(nd.split_input(x_full, in_layout, mesh)) * g).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    _grads_match(layer, ref_grads, mesh, f"{what} (input without grad)")


def check_gathered_linears(mesh, batch: int, regather: bool) -> None:
    """Each linear (from_linear) alone and as a stacked pair, with ``regather`` (save the
    local blocks, all-gather again in backward) or without (save the gathered operands)."""
    mode = mesh.tp_mode
    kw = {"mesh": mesh, "regather": regather}
    what = f"regather={regather}"
    torch.manual_seed(0)
    if mode == "2d":
        lin = nn.Linear(HID, 10)
        layer = nd.Linear2D.from_linear(lin, **kw)
        check_layer(layer, lin, "2d", "2d", mesh, (batch, S, HID), f"Linear2D {what}")
        check_one_grad(layer, lin, "2d", "2d", mesh, (batch, S, HID), f"Linear2D {what}")
        pair = nn.Sequential(nn.Linear(HID, 8), nn.GELU(), nn.Linear(8, HID))
        sharded = nn.Sequential(
            nd.Linear2D.from_linear(pair[0], **kw),
            nn.GELU(),
            nd.Linear2D.from_linear(pair[2], **kw),
        )
        layout = "2d"
    else:
        lin = nn.Linear(HID, 6)
        layer = nd.Linear3D.from_linear(lin, **kw)  # orientation ab: 3d-a -> 3d-b
        check_layer(layer, lin, "3d-a", "3d-b", mesh, (batch, S, HID), f"Linear3D ab {what}")
        check_one_grad(layer, lin, "3d-a", "3d-b", mesh, (batch, S, HID), f"Linear3D ab {what}")
        lin = nn.Linear(8, 10)
        layer = nd.Linear3D.from_linear(lin, orientation="ba", **kw)
        check_layer(layer, lin, "3d-b", "3d-a", mesh, (batch, S, 8), f"Linear3D ba {what}")
        pair = nn.Sequential(nn.Linear(HID, 8), nn.GELU(), nn.Linear(8, HID))
        sharded = nn.Sequential(
            nd.Linear3D.from_linear(pair[0], **kw),
            nn.GELU(),
            nd.Linear3D.from_linear(pair[2], orientation="ba", **kw),
        )
        layout = "3d-a"
    check_layer(sharded, pair, layout, layout, mesh, (batch, S, HID), f"{mode} stacked pair {what}")


def check_linears(mesh, batch: int) -> None:
    """Each linear (from_linear, both schedules, and TP-invariant init), stacked pairs, norms,
    embedding."""
    mode = mesh.tp_mode
    for regather in (True, False):
        check_gathered_linears(mesh, batch, regather)
    if mode == "2d":
        norm_layouts, lin_cls = ["2d"], nd.Linear2D
    else:
        norm_layouts, lin_cls = ["3d-a", "3d-b"], nd.Linear3D

    # TP-invariant init: the gathered weights equal the full tensors drawn from the same seed
    torch.manual_seed(3)
    fresh = lin_cls(HID, 8, mesh=mesh)
    torch.manual_seed(3)
    w = torch.empty(8, HID)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    b = torch.empty(8).uniform_(-1 / math.sqrt(HID), 1 / math.sqrt(HID))
    init = ntp.gather_params(fresh, mesh)
    assert_close(init["weight"], w, f"{mode} init weight")
    assert_close(init["bias"], b, f"{mode} init bias")

    # from_embedding with a padding row: output and weight grad (padding row gets none)
    emb = nn.Embedding(VOCAB, HID, padding_idx=3)
    emb_nd = (nd.Embedding2D if mode == "2d" else nd.Embedding3D).from_embedding(emb, mesh=mesh)
    torch.manual_seed(4)
    ids = torch.randint(0, VOCAB, (batch, S))
    ids[0, 0] = 3
    g_full = torch.randn(batch, S, HID)
    emb.zero_grad()
    (emb(ids) * g_full).sum().backward()
    out = emb_nd(nd.split_input(ids, emb_nd.output_layout, mesh, feature_dim=False))
    (out * nd.split_input(g_full, emb_nd.output_layout, mesh)).sum().backward()
    assert_close(
        nd.gather_output(out.detach(), emb_nd.output_layout, mesh),
        emb(ids).detach(),
        f"{mode} embedding out",
    )
    _grads_match(emb_nd, {"weight": emb.weight.grad}, mesh, f"{mode} embedding")

    ln_cls = nd.LayerNorm2D if mode == "2d" else nd.LayerNorm3D
    rms_cls = nd.RMSNorm2D if mode == "2d" else nd.RMSNorm3D
    for lay in norm_layouts:
        ln = nn.LayerNorm(HID)
        rms = nn.RMSNorm(HID, eps=1e-6)
        with torch.no_grad():
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
            rms.weight.uniform_(0.5, 1.5)
        check_layer(
            ln_cls.from_layernorm(ln, layout=lay, mesh=mesh),
            ln,
            lay,
            lay,
            mesh,
            (batch, S, HID),
            f"{ln_cls.__name__} {lay}",
        )
        check_layer(
            rms_cls.from_layernorm(rms, layout=lay, mesh=mesh),
            rms,
            lay,
            lay,
            mesh,
            (batch, S, HID),
            f"{rms_cls.__name__} {lay}",
        )


def _ref_block(p: dict, pre: str, x: torch.Tensor) -> torch.Tensor:
    """Pre-norm block with per-head fused QKV ``[heads, (q,k,v), head_dim]``, plain torch."""
    b, s, h = x.shape
    y = F.layer_norm(x, (h,), p[pre + "ln1.weight"], p[pre + "ln1.bias"])
    qkv = F.linear(y, p[pre + "attn.qkv.weight"], p[pre + "attn.qkv.bias"])
    q, k, v = (t.transpose(1, 2) for t in qkv.view(b, s, HEADS, 3, h // HEADS).unbind(3))
    scores = q @ k.transpose(-1, -2) / math.sqrt(h // HEADS)
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    att = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2)
    x = x + F.linear(att.reshape(b, s, h), p[pre + "attn.out.weight"], p[pre + "attn.out.bias"])
    y = F.layer_norm(x, (h,), p[pre + "ln2.weight"], p[pre + "ln2.bias"])
    y = F.linear(
        F.gelu(F.linear(y, p[pre + "mlp.up.weight"], p[pre + "mlp.up.bias"])),
        p[pre + "mlp.down.weight"],
        p[pre + "mlp.down.bias"],
    )
    return x + y


ref_block_nd = _ref_block  # the plain-torch 2D/3D block, for other test modules


def _randomize_norms(model: nn.Module) -> None:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nd.LayerNorm2D, nd.LayerNorm3D)):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)


def check_block(mesh, batch: int, regather: bool = True) -> None:
    """TransformerBlockND vs the plain-torch block: output, input grad, parameter grads.
    With dp > 1 each replica sees its own batch; grads are dp-averaged and compared with the
    reference on the concatenated batch. ``regather``: the linears' backward schedule."""
    torch.manual_seed(0)
    block = TransformerBlockND(HID, HEADS, FFN, mesh=mesh, regather=regather)
    _randomize_norms(block)
    layout = block.input_layout
    full = {n: t.clone().requires_grad_(True) for n, t in ntp.gather_params(block, mesh).items()}
    torch.manual_seed(1)
    x_all = torch.randn(mesh.dp_size * batch, S, HID, requires_grad=True)
    y_ref = _ref_block(full, "", x_all)
    g_all = torch.randn_like(y_ref)
    ((y_ref * g_all).sum() / mesh.dp_size).backward()

    rows = slice(mesh.dp_rank * batch, (mesh.dp_rank + 1) * batch)
    x = x_all.detach()[rows].clone().requires_grad_(True)
    y = block(nd.split_input(x, layout, mesh))
    (y * nd.split_input(g_all[rows], layout, mesh)).sum().backward()
    ntp.allreduce_data_parallel_grads(block, mesh)
    what = f"{mesh.tp_mode} block regather={regather}"
    out = nd.gather_output(y.detach(), layout, mesh)
    assert_close(out, y_ref.detach()[rows], f"{what}: out")
    assert_close(x.grad, x_all.grad[rows] * mesh.dp_size, f"{what}: input grad")
    _grads_match(block, {n: t.grad for n, t in full.items()}, mesh, what)
    # the global grad norm (clip_grad_norm_ path) counts every element once
    ref_norm = torch.sqrt(sum(t.grad.square().sum() for t in full.values()))
    assert_close(ntp.global_grad_norm(block, mesh), ref_norm, "global grad norm")


def check_model_loss(mesh, batch: int) -> None:
    """Embedding -> block -> LayerNorm -> classifier -> cross-entropy vs plain torch."""
    two = mesh.tp_mode == "2d"
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "emb": (nd.Embedding2D if two else nd.Embedding3D)(VOCAB, HID, mesh=mesh),
            "block": TransformerBlockND(HID, HEADS, FFN, mesh=mesh),
            "lnf": (nd.LayerNorm2D if two else nd.LayerNorm3D)(HID, mesh=mesh),
            "head": (nd.Classifier2D if two else nd.Classifier3D)(HID, VOCAB, mesh=mesh),
        }
    )
    _randomize_norms(model)
    full = {n: t.clone().requires_grad_(True) for n, t in ntp.gather_params(model, mesh).items()}
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (batch, S))
    labels = torch.randint(0, VOCAB, (batch, S))
    labels[0, 1] = -100  # an ignored position
    h = _ref_block(full, "block.", F.embedding(ids, full["emb.weight"]))
    h = F.layer_norm(h, (HID,), full["lnf.weight"], full["lnf.bias"])
    logits = F.linear(h, full["head.weight"])
    loss_ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss_ref.backward()

    in_layout = model["emb"].output_layout
    out_layout = model["head"].output_layout
    x = model["emb"](nd.split_input(ids, in_layout, mesh, feature_dim=False))
    x = model["lnf"](model["block"](x))
    logits_local = model["head"](x)
    ce = nd.cross_entropy_2d if two else nd.cross_entropy_3d
    loss = ce(logits_local, nd.split_input(labels, out_layout, mesh, feature_dim=False), mesh)
    loss.backward()
    assert_close(loss.detach(), loss_ref.detach(), "loss")
    assert_close(
        nd.gather_output(logits_local.detach(), out_layout, mesh), logits.detach(), "logits"
    )
    _grads_match(model, {n: t.grad for n, t in full.items()}, mesh, f"{mesh.tp_mode} model")


def _split0(layer: nn.Module) -> tuple[str, int]:
    """The (mesh axis, dim 0) split of ``layer.weight``: its vocabulary split."""
    split = ntp.parallel.sharding.get_sharding(layer, "weight").splits[0]
    assert split[1] == 0, split
    return split


def check_padded_vocab(mesh, batch: int, vocab: int) -> None:
    """A vocabulary the split does not divide (q for the classifier, q^2 for the 3D
    embedding): zero-padded shards, recorded full shapes (gathered weights and grads trimmed),
    full logits trimmed to ``vocab``, cross-entropy (ignore_index, label smoothing, every
    reduction) and every gradient equal to the unsharded computation's."""
    two = mesh.tp_mode == "2d"
    what = f"{mesh.tp_mode} padded vocab={vocab}"
    torch.manual_seed(7)
    emb, head = nn.Embedding(vocab, HID), nn.Linear(HID, vocab)
    emb_nd = (nd.Embedding2D if two else nd.Embedding3D).from_embedding(emb, mesh=mesh)
    head_nd = (nd.Classifier2D if two else nd.Classifier3D).from_linear(head, mesh=mesh)
    q = mesh.group("row" if two else "input").size
    assert head_nd.out_features == vocab and head_nd.padded_vocab % q == 0, what
    assert head_nd.weight.shape[0] == -(-vocab // q), (what, head_nd.weight.shape)
    assert emb_nd.weight.shape[0] == -(-vocab // emb_nd.layout.batch_split(mesh)), what
    params = ntp.gather_params(nn.ModuleDict({"emb": emb_nd, "head": head_nd}), mesh)
    assert_close(params["emb.weight"], emb.weight.detach(), f"{what}: gathered table")
    assert_close(params["head.weight"], head.weight.detach(), f"{what}: gathered head")
    assert_close(params["head.bias"], head.bias.detach(), f"{what}: gathered bias")

    # TP-invariant init: the padded classifier draws exactly the [vocab, HID] tensor
    torch.manual_seed(3)
    fresh = (nd.Classifier2D if two else nd.Classifier3D)(HID, vocab, mesh=mesh)
    torch.manual_seed(3)
    w = torch.empty(vocab, HID)
    nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    assert_close(ntp.gather_params(fresh, mesh)["weight"], w, f"{what}: init")

    torch.manual_seed(8)
    ids = torch.randint(0, vocab, (batch, S))
    ids[0, 0] = vocab - 1  # the last row, in the last (padded) shard
    labels = torch.randint(0, vocab, (batch, S))
    labels[-1, -1] = vocab - 1
    labels[0, 1] = -100
    ce = nd.cross_entropy_2d if two else nd.cross_entropy_3d
    out_layout = head_nd.output_layout
    for reduction, smoothing in (("mean", 0.0), ("mean", 0.1), ("sum", 0.2), ("none", 0.0)):
        for m in (emb, head, emb_nd, head_nd):
            m.zero_grad()
        logits = head(emb(ids))
        ref = F.cross_entropy(
            logits.transpose(1, 2), labels, reduction=reduction, label_smoothing=smoothing
        )
        g = torch.randn_like(ref) if reduction == "none" else torch.tensor(1.0)
        (ref * g).sum().backward()

        x = emb_nd(nd.split_input(ids, emb_nd.output_layout, mesh, feature_dim=False))
        local = head_nd(x)
        assert local.shape[-1] == head_nd.weight.shape[0], what
        loss = ce(
            local,
            nd.split_input(labels, out_layout, mesh, feature_dim=False),
            mesh,
            reduction=reduction,
            label_smoothing=smoothing,
            vocab_size=vocab,
        )
        tag = f"{what} {reduction} smoothing={smoothing}"
        if reduction == "none":
            g_local = nd.split_input(g, out_layout, mesh, feature_dim=False)
            (loss * g_local).sum().backward()
            loss = nd.gather_output(loss.detach(), out_layout, mesh, feature_dim=False)
        else:
            loss.backward()
        assert_close(loss.detach(), ref.detach(), f"{tag}: loss")
        full = head_nd.gather_logits(local.detach())
        assert full.shape == (batch, S, vocab), (tag, full.shape)
        assert_close(full, logits.detach(), f"{tag}: logits")
        grads = {"emb.weight": emb.weight.grad, "head.weight": head.weight.grad}
        grads["head.bias"] = head.bias.grad
        _grads_match(nn.ModuleDict({"emb": emb_nd, "head": head_nd}), grads, mesh, tag)
        # this rank's padded rows (past the true vocabulary) stay zero and get no gradient
        for layer, (axis, _) in ((head_nd, _split0(head_nd)), (emb_nd, _split0(emb_nd))):
            chunk = layer.weight.shape[0]
            rows = mesh.group(axis).rank * chunk + torch.arange(chunk)
            pad = rows >= vocab
            assert not layer.weight.detach()[pad].any(), f"{tag}: padded rows not zero"
            assert not layer.weight.grad[pad].any(), f"{tag}: padded rows got a gradient"
