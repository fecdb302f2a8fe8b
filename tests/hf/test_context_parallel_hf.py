"""Context parallelism for transformers models (neuron_tp.hf.context_parallel): a tiny Llama
(GQA) split over a cp ring against the unsharded model with sdpa on the full sequence: loss
(the mean over every label token of the global rows), logits and every gradient (summed over
the ring, as the replicas reduction does), at cp 2 alone and at cp 2 x tp 2 with sequence
parallelism, on gloo ranks; packed rows (segment ids crossing the ring) at cp 2 x tp 2 and cp 4
against the unsharded model given the block-diagonal causal 4D mask and per-sample positions
(its loss also the per-sample reference's); refusals before any collective."""

from __future__ import annotations

import copy

import pytest
import torch

import gloo_dist
import neuron_tp as ntp
import packing_ref
from neuron_tp.errors import UserError
from neuron_tp.hf import full_logits, gather_hf_state_dict, parallelize
from neuron_tp.hf.context_parallel import context_parallel
from neuron_tp.hf.packing import model_inputs
from neuron_tp.job.presets import build_model
from neuron_tp.layers.ring_attention import gather_sequence
from neuron_tp.optim.grads import allreduce_data_parallel_grads
from neuron_tp.parallel.mesh import Mesh

V = 257
TOL = dict(rtol=1e-5, atol=2e-5)


def _close(a, b, what):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_grads(model, ref, mesh, tp: int) -> None:
    """Every gradient, summed over dp x cp (and gathered over tp), equals the reference's."""
    allreduce_data_parallel_grads(model, mesh)  # the sum over dp x cp
    grads = gather_hf_state_dict(model, grads=True) if tp > 1 else _grads(model)
    expected = _grads(ref)
    assert set(grads) == set(expected)
    for n, g in expected.items():
        _close(grads[n], g, f"grad {n}")


def _data(seq=64):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (2, seq), generator=g)
    labels = ids.clone()
    labels[0, 10:19] = -100  # a few ignored labels: the mean is over the real ones
    return ids, labels


def _run(tp: int, sp: bool):
    mesh = gloo_dist.shared_mesh(tp, cp=2)
    ref = build_model("tiny-llama", V, 0).train()
    model = copy.deepcopy(ref)
    if tp > 1:
        model = parallelize(model, mesh, sequence_parallel=sp, parallel_loss=True)
    context_parallel(model, mesh, block=16)
    ids, labels = _data()
    out, want = model(ids, labels=labels), ref(ids, labels=labels)
    _close(out.loss, want.loss, "loss")
    out.loss.backward()
    want.loss.backward()
    ntp.sync_sequence_parallel_grads(model, mesh)
    _check_grads(model, ref, mesh, tp)
    model.eval()
    if tp > 1:
        with full_logits(model):
            logits = model(ids).logits
    else:
        logits = model(ids).logits
    _close(gather_sequence(logits, mesh.cp, 1), ref.eval()(ids).logits, "logits")


# 64 tokens a row: samples start at 16 and 32 (chunk boundaries at cp 2 and cp 4), the one of
# 20 tokens crosses 48; row 1 ends in 8 padding tokens
PACKED = [[16, 5, 11, 20, 12], [7, 30, 9, 10]]


def _reference_inputs(batch: dict) -> dict:
    """The unsharded model's inputs, written out here: causal AND same sample (padding: itself
    only), positions restarting per sample (0 on padding)."""
    seg, s = batch["segment_ids"], batch["input_ids"].shape[1]
    i = torch.arange(s)
    allowed = (seg[:, :, None] == seg[:, None, :]) & (i[:, None] >= i[None, :])
    allowed = (allowed & (seg != 0)[:, None, :]) | torch.eye(s, dtype=torch.bool)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    pos = batch["position_ids"].masked_fill(seg == 0, 0)
    return dict(
        input_ids=batch["input_ids"],
        labels=batch["labels"],
        position_ids=pos,
        attention_mask=mask[:, None],
    )


def _run_packed(tp: int, cp: int):
    mesh = gloo_dist.shared_mesh(tp, cp=cp)
    ref = build_model("tiny-llama", V, 0).train()
    model = copy.deepcopy(ref)
    if tp > 1:
        model = parallelize(model, mesh, parallel_loss=True)
    context_parallel(model, mesh, block=4)  # several blocks per chunk (of 16 or 8 tokens)
    batch = packing_ref.packed_batch(PACKED, V, 3, length=64)
    inputs, want_in = model_inputs(batch, segments=True), _reference_inputs(batch)
    assert "attention_mask" not in inputs and "segment_ids" in inputs
    seen = []  # the positions RoPE gets: this rank's chunks of the per-sample positions
    rope = model.model.rotary_emb
    hook = rope.register_forward_hook(
        lambda _m, a, kw, _o: seen.append(kw.get("position_ids", a[1:2] and a[1])),
        with_kwargs=True,
    )
    out, want = model(**inputs), ref(**want_in)
    hook.remove()
    chunks = want_in["position_ids"].unflatten(1, (2 * cp, 64 // (2 * cp)))
    r = mesh.cp.rank
    torch.testing.assert_close(seen[0], chunks[:, [r, 2 * cp - 1 - r]].flatten(1))
    _close(out.loss, want.loss, "loss")
    with torch.no_grad():
        _close(want.loss, packing_ref.reference_loss(ref, batch), "per-sample loss")
    out.loss.backward()
    want.loss.backward()
    _check_grads(model, ref, mesh, tp)
    model.eval()
    inputs.pop("labels")
    if tp > 1:
        with full_logits(model):
            logits = model(**inputs).logits
    else:
        logits = model(**inputs).logits
    want_in.pop("labels")
    _close(gather_sequence(logits, mesh.cp, 1), ref.eval()(**want_in).logits, "logits")


def _cases(case: str):
    if case == "cp2":
        _run(1, False)
    elif case == "cp2-tp2-packed":
        _run_packed(2, 2)
    elif case == "cp4-packed":
        _run_packed(1, 4)
    else:
        _run(2, case == "cp2-tp2-sp")


@pytest.mark.parametrize("case", ["cp2"])
def test_cp2_matches_unsharded(case):
    gloo_dist.run_case(_cases, case, cases=["cp2"], world_size=2)


FOUR = ["cp2-tp2-sp", "cp2-tp2", "cp2-tp2-packed", "cp4-packed"]


@pytest.mark.parametrize("case", FOUR)
def test_cp2_tp2_and_packed_rows_match_unsharded(case):
    gloo_dist.run_case(_cases, case, cases=FOUR, world_size=4)


def test_refusals():
    mesh = Mesh(4, 0, cp=2)  # no process groups: every refusal comes before a collective
    model = context_parallel(build_model("tiny-llama", V, 0), mesh, block=8)
    with pytest.raises(UserError, match="multiple of 2 x cp = 4"):
        model(torch.zeros(1, 10, dtype=torch.long))
    with pytest.raises(UserError, match="no attention_mask"):
        model(torch.zeros(1, 8, dtype=torch.long), attention_mask=torch.ones(1, 8))
    windowed = build_model("tiny-llama", V, 0)
    windowed.config.sliding_window = 16
    with pytest.raises(UserError, match="sliding_window=16"):
        context_parallel(windowed, mesh)
    flash = build_model("tiny-llama", V, 0)
    flash.config._attn_implementation = "flash_attention_2"
    with pytest.raises(UserError, match="'sdpa', 'eager' or blockwise"):
        context_parallel(flash, mesh)
    base = build_model("tiny-llama", V, 0).model  # not a causal LM
    with pytest.raises(UserError, match="for causal LMs"):
        context_parallel(base, mesh)
