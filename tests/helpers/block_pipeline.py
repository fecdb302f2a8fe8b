"""Pipeline training of stacks of the layer library's blocks (:func:`neuron_tp.pipeline.
stages_of_blocks`), run in the gloo launches of tests/pipeline/test_pipeline_gloo.py (4 ranks)
and tests/train/test_train_nd.py (8 ranks), against the same model
computed with plain torch ops on full weights (tests/helpers/block_reference.py,
nd_reference.py) and trained with stock torch AdamW and clip_grad_norm_ on the same global
batch: the step's loss, the global gradient norm, every gradient (gathered over tp) of this
stage's parameters, and every weight after the steps.

``blocks_pp2_tp2_sp``: 4 ``TransformerBlock`` at pp 2 x tp 2 with sequence parallelism
(vocab-parallel embedding scattering the sequence, SP final norm, vocab-sharded classifier and
loss). ``blocks2d_pp2_dp2_v2``: 4 ``TransformerBlockND`` on a 2D mesh at pp 2 x dp 2,
interleaved (2 chunks a stage): 4 ranks leave a 1 x 1 grid; ``blocks2d_pp2_tp4``: the same
stack on a 2 x 2 grid at pp 2 (8 ranks: the batch, features, heads and vocabulary split)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

import block_reference as b1d
import nd_reference as bnd
import neuron_tp as ntp
from neuron_tp.blocks import TransformerBlock, TransformerBlockND
from neuron_tp.layers import (
    Classifier2D,
    ColumnParallelLinear,
    Embedding2D,
    LayerNorm2D,
    VocabParallelEmbedding,
)
from neuron_tp.optim.adamw import make_optimizer
from neuron_tp.optim.grads import reduce_gradients
from neuron_tp.parallel import comm
from neuron_tp.parallel.sharding import mark_sequence_parallel
from neuron_tp.pipeline import BlockStack, PipelineRunner, stages_of_blocks
from neuron_tp.pipeline import schedule as schedules
from neuron_tp.pipeline.stages import plan_stages

BLOCKS, VOCAB, BATCH, SEQ, MICRO = 4, 64, 2, 8, 4
LR, WD, MAX_NORM = 1e-2, 0.1, 0.05
TOL = dict(atol=2e-5, rtol=2e-4)


def micro_batches(m: int, dp: int) -> list[list[dict]]:
    """``m`` micro-batches ``[BATCH, SEQ]`` for each of ``dp`` replicas, some labels ignored."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(dp):
        mine = []
        for _ in range(m):
            ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
            labels = ids.clone()
            labels[torch.rand(BATCH, SEQ, generator=gen) < 0.25] = -100
            mine.append({"input_ids": ids, "labels": labels})
        out.append(mine)
    return out


def _whole(nd: bool, mesh, sp: bool) -> BlockStack:
    """The whole sharded model (same seed on every rank), norms randomised."""
    torch.manual_seed(0)
    if nd:
        hid = bnd.HID
        emb = Embedding2D(VOCAB, hid, mesh=mesh)
        blocks = [TransformerBlockND(hid, bnd.HEADS, bnd.FFN, mesh=mesh) for _ in range(BLOCKS)]
        head = nn.Sequential(LayerNorm2D(hid, mesh=mesh), Classifier2D(hid, VOCAB, mesh=mesh))
    else:
        hid = b1d.HID
        emb = VocabParallelEmbedding(VOCAB, hid, sequence_parallel=sp, mesh=mesh)
        blocks = [
            TransformerBlock(hid, b1d.HEADS, b1d.FFN, mesh, sequence_parallel=sp)
            for _ in range(BLOCKS)
        ]
        norm = nn.LayerNorm(hid)
        if sp:
            mark_sequence_parallel(norm)
        cls = ColumnParallelLinear(hid, VOCAB, bias=False, sequence_parallel=sp, mesh=mesh)
        head = nn.Sequential(norm, cls)
    model = BlockStack(emb, {str(i): b for i, b in enumerate(blocks)}, head)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln" in name or name.startswith("head.0"):
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.5, 0.5)
    return model


def _ref_loss(nd: bool, p: dict, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The token-loss sum of one micro-batch, plain torch on full weights."""
    hid = bnd.HID if nd else b1d.HID
    h = F.embedding(ids, p["embedding.weight"])
    for i in range(BLOCKS):
        pre = f"blocks.{i}."
        if nd:
            h = bnd.ref_block_nd(p, pre, h)
        else:
            h = b1d.ref_block({k[len(pre) :]: v for k, v in p.items() if k.startswith(pre)}, h)
    h = F.layer_norm(h, (hid,), p["head.0.weight"], p["head.0.bias"])
    logits = F.linear(h, p["head.1.weight"])
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), reduction="sum")


def _reference(nd: bool, start: dict, batches: list[list[dict]], steps: int) -> dict:
    params = {k: nn.Parameter(v.detach().clone()) for k, v in start.items()}
    flat = [b for rep in batches for b in rep]
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for b in flat)
    decay = [p for p in params.values() if p.dim() >= 2]
    rest = [p for p in params.values() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR
    )
    out = {"loss": [], "norm": [], "grads": []}
    for _ in range(steps):
        opt.zero_grad()
        loss = sum(_ref_loss(nd, params, b["input_ids"], b["labels"]) for b in flat) / n
        loss.backward()
        out["norm"].append(float(torch.nn.utils.clip_grad_norm_(params.values(), MAX_NORM)))
        out["grads"].append({k: p.grad.clone() for k, p in params.items()})
        out["loss"].append(float(loss.detach()))
        opt.step()
    out["weights"] = {k: p.detach().clone() for k, p in params.items()}
    return out


def _noise(grads: list[torch.Tensor]) -> torch.Tensor:
    """Elements whose reference gradient was float32 noise at some step (the key bias: softmax
    ignores it, its true gradient is 0): AdamW's first steps turn a 1e-9 gradient into a step
    of ~lr whose sign the noise decides, so they are held to AdamW's step bound only."""
    return functools.reduce(torch.logical_or, [(g != 0) & (g.abs() < 1e-7) for g in grads])


def run(case: str, steps: int = 2) -> list[str]:
    """Train the case's block stack for ``steps`` steps; returns what was compared."""
    nd, sp = case.startswith("blocks2d"), "_sp" in case
    tp = 4 if "_tp4" in case else 2 if "_tp2" in case else 1
    v = 2 if "_v2" in case else 1
    mesh = ntp.init_mesh(tp=tp, pp=2, tp_mode="2d" if nd else "1d")
    whole = _whole(nd, mesh, sp)
    start = ntp.gather_params(whole, mesh)
    batches = micro_batches(MICRO, mesh.dp_size)
    ref = _reference(nd, start, batches, steps)
    blocks = [whole.blocks[str(i)] for i in range(BLOCKS)]
    plan = plan_stages(BLOCKS, 2, v)
    stage = stages_of_blocks(blocks, mesh, plan, embedding=whole.embedding, head=whole.head)
    opt = make_optimizer(stage.model, LR, WD, torch.device("cpu"))
    sched = schedules.build("interleaved" if v > 1 else "1f1b", 2, MICRO, v)
    runner = PipelineRunner(stage, sched, batch=BATCH, seq=SEQ, device="cpu")
    n = sum(int((b["labels"][:, 1:] != -100).sum()) for rep in batches for b in rep)
    checked = []
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = runner.step(batches[mesh.dp_rank], torch.tensor([mesh.dp_size / n]))
        runner.cut()
        norm = reduce_gradients(stage.model, opt, mesh, MAX_NORM, False, pp_sum=runner.pp_sum)
        grads = ntp.gather_params(stage.model, mesh, grads=True)
        opt.step()
        loss = comm.all_reduce(loss, mesh.dp) / mesh.dp_size
        torch.testing.assert_close(float(loss), ref["loss"][i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(float(norm), ref["norm"][i], atol=1e-5, rtol=1e-4)
        for k, g in grads.items():
            want = ref["grads"][i][k]
            torch.testing.assert_close(g, want, **TOL, msg=lambda m, k=k: f"grad {k}: {m}")
            checked.append(f"grad {k}")
    for k, w in ntp.gather_params(stage.model, mesh).items():
        want = ref["weights"][k]
        noise = _noise([g[k] for g in ref["grads"]])
        got = torch.where(noise, want, w)
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, k=k: f"weight {k}: {m}")
        assert bool(((w - want).abs() <= 2 * LR * steps).all()), f"weight {k} moved too far"
        checked.append(f"weight {k}")
    ends = ("embedding.weight",) if mesh.pp.rank == 0 else ("head.0.weight", "head.1.weight")
    assert all(f"weight {e}" in checked for e in ends), checked
    return checked
