"""Blockwise attention as a transformers attention implementation: a tiny Llama (GQA) with it
against the same model with sdpa (logits, loss, every gradient, padded batches, packed rows
given as segment ids against sdpa given the 4D block-diagonal mask, greedy generation with a KV
cache), and at tp 2 with sequence parallelism on gloo ranks against the
unsharded sdpa model."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from neuron_tp.errors import UserError  # noqa: E402
from neuron_tp.hf import full_logits, gather_hf_state_dict, parallelize  # noqa: E402
from neuron_tp.hf.attention import use_blockwise_attention  # noqa: E402
from neuron_tp.job.presets import build_model  # noqa: E402

V = 257
TOL = dict(rtol=1e-5, atol=2e-5)


def _close(a, b, what):
    torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{what}: {m}")


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("seq", [32, 40, 9])
def test_plain_model_matches_sdpa(seq):
    ref = build_model("tiny-llama", V, 0).train()  # 4 query heads over 2 kv heads
    model = copy.deepcopy(ref)
    assert use_blockwise_attention(model, block=16) == "ntp-blockwise-16"
    ids = torch.randint(0, V, (2, seq), generator=torch.Generator().manual_seed(seq))
    out, want = model(ids, labels=ids), ref(ids, labels=ids)
    _close(out.logits, want.logits, "logits")
    _close(out.loss, want.loss, "loss")
    out.loss.backward()
    want.loss.backward()
    got, expected = _grads(model), _grads(ref)
    assert set(got) == set(expected)
    for n, g in expected.items():
        _close(got[n], g, f"grad {n}")


def test_packed_rows_by_segment_ids_match_sdpa_with_the_block_diagonal_mask():
    """``model_inputs(batch, segments=True)`` for a blockwise model: the segment ids go down to
    the attention (no [b, 1, s, s] mask is built) and the loss, logits and every gradient are
    those of the sdpa model given the packed rows' 4D mask."""
    from neuron_tp.hf.attention import takes_segments
    from neuron_tp.hf.packing import model_inputs
    from packing_ref import LAYOUTS, packed_batch

    ref = build_model("tiny-llama", V, 0).train()
    model = copy.deepcopy(ref)
    use_blockwise_attention(model, block=4)  # 16-token rows: samples cross blocks
    assert takes_segments(model.config) and not takes_segments(ref.config)
    batch = packed_batch(list(LAYOUTS.values())[0], V, 5)
    given = model_inputs(batch, segments=True)
    assert "attention_mask" not in given and "segment_ids" in given
    out, want = model(**given), ref(**model_inputs(batch))
    _close(out.logits, want.logits, "logits")
    _close(out.loss, want.loss, "loss")
    out.loss.backward()
    want.loss.backward()
    for n, g in _grads(ref).items():
        _close(_grads(model)[n], g, f"grad {n}")


def test_padded_batch_and_generation():
    ref = build_model("tiny-llama", V, 0).eval()
    model = copy.deepcopy(ref)
    use_blockwise_attention(model, block=8)
    ids = torch.randint(2, V, (2, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :6] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    want = ref(ids, attention_mask=mask, labels=labels)
    real = mask.bool()
    _close(out.logits[real], want.logits[real], "padded logits")
    _close(out.loss, want.loss, "padded loss")
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, **kw), ref.generate(ids, **kw))


def test_refuses_dropout():
    model = build_model("tiny-llama", V, 0).train()
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    use_blockwise_attention(model, block=8)
    with pytest.raises(UserError, match="no attention dropout"):
        model(torch.zeros(1, 8, dtype=torch.long))


def _tp2_sp():
    gloo_dist.shared_mesh(2)
    ref = build_model("tiny-llama", V, 0).train()
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(5))
    m = parallelize(copy.deepcopy(ref), sequence_parallel=True, parallel_loss=True)
    use_blockwise_attention(m, block=16)
    assert all(
        layer.self_attn.config._attn_implementation == "ntp-blockwise-16"
        for layer in m.model.layers
    )
    out, want = m(ids, labels=ids), ref(ids, labels=ids)
    _close(out.loss, want.loss, "tp2 sp loss")
    out.loss.backward()
    want.loss.backward()
    ntp.sync_sequence_parallel_grads(m)
    grads = gather_hf_state_dict(m, grads=True)
    expected = _grads(ref)
    assert set(grads) == set(expected)
    for n, g in expected.items():
        _close(grads[n], g, f"tp2 sp grad {n}")
    with full_logits(m.eval()):
        _close(m(ids).logits, ref.eval()(ids).logits, "tp2 sp logits")


def test_tp2_sequence_parallel_matches_unsharded_sdpa():
    gloo_dist.run(_tp2_sp, world_size=2)
