"""Cases run on N XLA CPU devices by tests/backend/test_xla_multi_models.py (one thread per device,
see xla_dist.py): 1D transformer blocks (tp, tp x dp, with and without sequence parallelism), 2D and
3D blocks, and patched HF models, each against an unsharded reference computed with plain torch
/ transformers on the CPU: outputs, input gradients, every gathered parameter (and gradient),
the global grad norm.

Block weights are drawn here as full tensors and loaded into the sharded modules with
``shard_of`` (pure slicing, no collective): the reference maths never reads a weight back from
the module under test. HF models are the transformers model itself (reference) and a
parallelized deep copy of it. Each case traces forward + backward + the gathers, then
``torch_xla.sync()`` once, then compares on the CPU (graphs are few: compiles dominate).

Threads share the process: references, drawings from the global RNG and transformers' lazy
imports happen inside ``serial()``; nothing collective may run while holding it.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
import torch_xla
import transformers  # noqa: F401  (imported before the device threads start)
from torch import nn

import block_reference as b1d
import nd_reference as ndr
import neuron_tp as ntp
from hf_archs import V as HF_VOCAB  # noqa: E402
from hf_archs import build
from neuron_tp.blocks.block_nd import TransformerBlockND
from neuron_tp.hf import gather_hf_state_dict, parallelize
from neuron_tp.layers import nd
from neuron_tp.parallel.sharding import named_parameter_meta, shard_of
from xla_dist import serial

TOL = dict(atol=2e-5, rtol=1e-5)  # seen: max |XLA - CPU| about 4e-6


class Checks:
    """(what, XLA tensor, CPU expectation, tolerance) compared after one ``torch_xla.sync()``."""

    def __init__(self):
        self.pending, self.done = [], []

    def add(self, what: str, got: torch.Tensor, want: torch.Tensor, tol: dict) -> None:
        # clone: the value now (a replicated parameter's "gathered" grad is the grad itself,
        # and clipping later scales it in place)
        self.pending.append((what, got.detach().clone(), want.detach().clone(), tol))

    def flush(self) -> None:
        torch_xla.sync()  # the case's one graph: forward, backward, grad sync, gathers
        for what, got, want, tol in self.pending:
            got = got.detach().cpu()
            torch.testing.assert_close(got, want, **tol, msg=lambda m, w=what: f"{w}: {m}")
            self.done.append((what, float((got - want).abs().max()) if want.numel() else 0.0))
        self.pending = []


def _dev(t: torch.Tensor, grad: bool = False) -> torch.Tensor:
    out = t.detach().to(torch_xla.device())
    return out.requires_grad_(True) if grad else out


def _load_drawn_weights(model: nn.Module, mesh, seed: int) -> dict[str, torch.Tensor]:
    """Draw every parameter as a FULL tensor (norm weights around 1, biases and projections
    around 0), load this rank's piece (``shard_of``); returns the full tensors by name."""
    gen = torch.Generator().manual_seed(seed)
    full = {}
    with torch.no_grad():
        for name, p, meta in named_parameter_meta(model):
            shape = meta.sharding.full_shape if meta.sharding else tuple(p.shape)
            t = torch.rand(shape, generator=gen) - 0.5
            if ".ln" in f".{name}" and name.endswith("weight"):
                t = t + 1.0  # LayerNorm scales in [0.5, 1.5)
            elif len(shape) == 2:
                t = t * (2.0 / math.sqrt(shape[1]))  # projections: unit-scale activations
            p.copy_(shard_of(t, meta.sharding, mesh) if meta.sharding else t)
            full[name] = t
    return full


def _check_params_and_grads(c: Checks, model, mesh, full: dict, what: str) -> None:
    params = ntp.gather_params(model, mesh)
    grads = ntp.gather_params(model, mesh, grads=True)
    assert set(params) == set(full) == set(grads), (what, set(params) ^ set(full), set(grads))
    for name, t in full.items():
        c.add(f"{what} param {name}", params[name], t, dict(atol=0, rtol=0))
        c.add(f"{what} grad {name}", grads[name], t.grad, TOL)


def _check_norm(c: Checks, model, mesh, full: dict, what: str) -> None:
    """global_grad_norm vs the reference norm; clip_grad_norm_ to half of it, norm again."""
    ref_norm = torch.sqrt(sum(t.grad.double().square().sum() for t in full.values())).float()
    c.add(f"{what} global grad norm", ntp.global_grad_norm(model, mesh), ref_norm, TOL)
    before = ntp.clip_grad_norm_(model, max_norm=0.5 * ref_norm.item(), mesh=mesh)
    c.add(f"{what} norm returned by clip", before, ref_norm, TOL)
    c.add(
        f"{what} norm after clip",
        ntp.global_grad_norm(model, mesh),
        0.5 * ref_norm,
        dict(atol=1e-4, rtol=1e-4),
    )


# --- 1D blocks ------------------------------------------------------------------------------


def block_1d_case(c: Checks, mesh, sp: bool) -> None:
    """neuron_tp.blocks.block_1d.TransformerBlock vs the plain-torch block of
    tests/helpers/block_reference.py; each dp replica sees its own rows of the batch, the
    reference the concatenation (loss / dp)."""
    tp, dp, r = mesh.tp_size, mesh.dp_size, mesh.tp_rank
    what = f"1D block tp={tp} dp={dp} sp={sp} [rank {mesh.rank}]"
    with serial():
        torch.manual_seed(0)
        block = ntp.blocks.TransformerBlock(
            b1d.HID, b1d.HEADS, b1d.FFN, mesh=mesh, sequence_parallel=sp
        )
    full = _load_drawn_weights(block, mesh, seed=11)
    for t in full.values():
        t.requires_grad_(True)
    gen = torch.Generator().manual_seed(12)
    x_all = torch.randn(dp * b1d.B, b1d.S, b1d.HID, generator=gen, requires_grad=True)
    y_ref = b1d.ref_block(full, x_all)
    g_all = torch.randn(y_ref.shape, generator=gen)
    ((y_ref * g_all).sum() / dp).backward()

    rows = slice(mesh.dp_rank * b1d.B, (mesh.dp_rank + 1) * b1d.B)
    local = (lambda t: t[rows].chunk(tp, 1)[r]) if sp else (lambda t: t[rows])
    block.to(torch_xla.device())
    x = _dev(local(x_all), grad=True)
    y = block(x)
    y.backward(_dev(local(g_all)))
    ntp.sync_sequence_parallel_grads(block, mesh)
    ntp.allreduce_data_parallel_grads(block, mesh, bucket_mb=0.001)  # several buckets
    c.add(f"{what} out", y, local(y_ref), TOL)
    c.add(f"{what} dX", x.grad, local(x_all.grad) * dp, TOL)  # local loss is not / dp
    _check_params_and_grads(c, block, mesh, full, what)
    _check_norm(c, block, mesh, full, what)


# --- 2D / 3D blocks -------------------------------------------------------------------------


def block_nd_case(c: Checks, mesh, batch: int, regather: bool = True) -> None:
    """TransformerBlockND vs tests/helpers/nd_reference.py's plain-torch block (split_input /
    gather_output move full activations in and out; dp replicas see their own rows).
    ``regather``: the linears save their local blocks and all-gather them again in backward
    (the default) or save the gathered operands."""
    dp = mesh.dp_size
    what = f"{mesh.tp_mode} block tp={mesh.tp_size} dp={dp} regather={regather} [rank {mesh.rank}]"
    with serial():
        torch.manual_seed(0)
        block = TransformerBlockND(ndr.HID, ndr.HEADS, ndr.FFN, mesh=mesh, regather=regather)
    full = _load_drawn_weights(block, mesh, seed=21)
    for t in full.values():
        t.requires_grad_(True)
    gen = torch.Generator().manual_seed(22)
    x_all = torch.randn(dp * batch, ndr.S, ndr.HID, generator=gen, requires_grad=True)
    y_ref = ndr._ref_block(full, "", x_all)
    g_all = torch.randn(y_ref.shape, generator=gen)
    ((y_ref * g_all).sum() / dp).backward()

    rows = slice(mesh.dp_rank * batch, (mesh.dp_rank + 1) * batch)
    layout = block.input_layout
    block.to(torch_xla.device())
    x = _dev(x_all[rows], grad=True)
    y = block(nd.split_input(x, layout, mesh))
    (y * nd.split_input(_dev(g_all[rows]), layout, mesh)).sum().backward()
    ntp.allreduce_data_parallel_grads(block, mesh)
    c.add(f"{what} out", nd.gather_output(y.detach(), layout, mesh), y_ref[rows], TOL)
    c.add(f"{what} dX", x.grad, x_all.grad[rows] * dp, TOL)
    _check_params_and_grads(c, block, mesh, full, what)
    _check_norm(c, block, mesh, full, what)


def model_nd_case(c: Checks, mesh, batch: int) -> None:
    """Embedding -> block -> LayerNorm -> classifier -> 2D/3D cross-entropy (an ignored label)
    vs plain torch: loss, gathered logits, every parameter gradient (tp only, dp = 1)."""
    assert mesh.dp_size == 1
    two = mesh.tp_mode == "2d"
    what = f"{mesh.tp_mode} model loss tp={mesh.tp_size} [rank {mesh.rank}]"
    with serial():
        torch.manual_seed(0)
        model = nn.ModuleDict(
            {
                "emb": (nd.Embedding2D if two else nd.Embedding3D)(ndr.VOCAB, ndr.HID, mesh=mesh),
                "block": TransformerBlockND(ndr.HID, ndr.HEADS, ndr.FFN, mesh=mesh),
                "lnf": (nd.LayerNorm2D if two else nd.LayerNorm3D)(ndr.HID, mesh=mesh),
                "head": (nd.Classifier2D if two else nd.Classifier3D)(
                    ndr.HID, ndr.VOCAB, mesh=mesh
                ),
            }
        )
    full = _load_drawn_weights(model, mesh, seed=31)
    for t in full.values():
        t.requires_grad_(True)
    gen = torch.Generator().manual_seed(32)
    ids = torch.randint(0, ndr.VOCAB, (batch, ndr.S), generator=gen)
    labels = torch.randint(0, ndr.VOCAB, (batch, ndr.S), generator=gen)
    labels[0, 1] = -100
    h = ndr._ref_block(full, "block.", F.embedding(ids, full["emb.weight"]))
    h = F.layer_norm(h, (ndr.HID,), full["lnf.weight"], full["lnf.bias"])
    logits = F.linear(h, full["head.weight"])
    loss_ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss_ref.backward()

    model.to(torch_xla.device())
    in_layout, out_layout = model["emb"].output_layout, model["head"].output_layout
    x = model["emb"](nd.split_input(_dev(ids), in_layout, mesh, feature_dim=False))
    logits_local = model["head"](model["lnf"](model["block"](x)))
    ce = nd.cross_entropy_2d if two else nd.cross_entropy_3d
    loss = ce(logits_local, nd.split_input(_dev(labels), out_layout, mesh, feature_dim=False), mesh)
    loss.backward()
    c.add(f"{what} loss", loss, loss_ref, TOL)
    c.add(f"{what} logits", nd.gather_output(logits_local.detach(), out_layout, mesh), logits, TOL)
    _check_params_and_grads(c, model, mesh, full, what)


# --- HF models ------------------------------------------------------------------------------


def hf_case(c: Checks, mesh, name: str, sp: bool | str) -> None:
    """A patched transformers model vs the model itself: full logits (parallelize without
    parallel_loss), then loss and every gradient with parallel_loss=True (SP grads synced,
    dp grads averaged, gathered in HF names/layout). Each dp replica has its own batch.
    ``sp="keep"``: sequence parallel keeping the gathered inputs (no backward re-gather)."""
    tp, dp, mode = mesh.tp_size, mesh.dp_size, mesh.tp_mode
    what = f"HF {name} tp={tp} {mode} dp={dp} sp={sp} [rank {mesh.rank}]"
    per = 4 if mode == "3d" else 2  # sequences per dp replica (3D splits the batch by q^2)
    with serial():  # transformers' lazy imports and the global RNG are shared by the threads
        torch.manual_seed(0)
        ref = build(name).eval()
        gen = torch.Generator().manual_seed(123)
        ids_all = torch.randint(2, HF_VOCAB, (per * dp, 8), generator=gen)
        logits_ref = ref(ids_all).logits
        # every replica has the same number of tokens: the mean of the dp means is the mean
        losses = [ref(ids, labels=ids).loss for ids in ids_all.chunk(dp)]
        loss_ref = sum(losses) / dp
        loss_ref.backward()
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    rows = slice(mesh.dp_rank * per, (mesh.dp_rank + 1) * per)
    # collective (the ranks compare checksums): never under serial()
    kw = dict(sequence_parallel=bool(sp), sequence_parallel_regather=sp != "keep")
    infer = parallelize(copy.deepcopy(ref), mesh=mesh, **kw)
    train = parallelize(copy.deepcopy(ref), mesh=mesh, parallel_loss=True, **kw)
    dev = torch_xla.device()
    for m in (infer, train):
        # A CPU -> XLA move makes new Parameters per module: tied ones (GPT-2's lm_head / wte)
        # come apart; re-tie them as transformers documents for XLA devices.
        m.to(dev).tie_weights()
    ids = _dev(ids_all[rows])
    c.add(f"{what} logits", infer(ids).logits, logits_ref[rows], TOL)
    loss = train(ids, labels=ids).loss
    loss.backward()
    ntp.sync_sequence_parallel_grads(train, mesh)
    ntp.allreduce_data_parallel_grads(train, mesh)
    c.add(f"{what} loss", loss, losses[mesh.dp_rank], TOL)
    grads = gather_hf_state_dict(train, mesh, grads=True)
    assert set(grads) == set(expected), f"{what}: grad names differ {set(grads) ^ set(expected)}"
    for n, g in expected.items():
        c.add(f"{what} grad {n}", grads[n], g, TOL)


# --- jobs (one per device count) ------------------------------------------------------------


def _summary(c: Checks, mesh) -> dict:
    return {
        "rank": mesh.rank,
        "world": mesh.world_size,
        "checks": [w for w, _ in c.done],
        "max_err": max(e for _, e in c.done),
    }


def job(plan: list[tuple]) -> dict:
    """Run ``plan`` on this device thread: entries ``("1d", tp, sp)``, ``("nd", tp, mode,
    batch, with_model[, regather])`` (``regather`` defaults to True), ``("hf", tp, name, sp)``,
    ``("hfnd", tp, mode, name)``;
    one sync per case."""
    torch_xla.device()  # register the device before the first backward of the process
    c = Checks()
    meshes = {}
    for kind, tp, *rest in plan:
        mode = rest[0] if kind in ("nd", "hfnd") else "1d"
        if (tp, mode) not in meshes:
            meshes[(tp, mode)] = ntp.init_mesh(tp=tp, tp_mode=mode)
        mesh = meshes[(tp, mode)]
        if kind == "1d":
            block_1d_case(c, mesh, sp=rest[0])
        elif kind == "nd":
            _, batch, with_model, *regather = rest
            block_nd_case(c, mesh, batch, *regather)
            if with_model:
                model_nd_case(c, mesh, batch)
        elif kind == "hfnd":  # a patched HF model on a 2d/3d mesh
            hf_case(c, mesh, rest[1], sp=False)
        else:
            hf_case(c, mesh, rest[0], sp=rest[1])
        c.flush()
    return _summary(c, mesh)
