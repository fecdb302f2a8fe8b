"""``parallelize`` on 2d / 3d meshes (neuron_tp.hf.parallelize_nd) vs the unsharded transformers
model on gloo ranks: gathered logits, loss (HF's causal shift, ignore_index, padding mask) and
every parameter gradient of tiny random Llama-family models; and the refusals."""

from __future__ import annotations

import copy
import functools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from neuron_tp.hf import full_logits, gather_hf_state_dict, parallelize  # noqa: E402
from neuron_tp.layers.nd import Embedding2D, Embedding3D, Linear2D, Linear3D  # noqa: E402
from neuron_tp.parallel.state import is_parallel  # noqa: E402
from tiny_configs import nd_config  # noqa: E402

ATOL = 1e-5
V = 64  # divisible by q=2 (2D) and q^2=4 (3D)
V_ODD = 61  # divisible by neither: padded embedding table, LM head and logits


def _close(a, b, what):
    torch.testing.assert_close(
        a.as_subclass(torch.Tensor), b, atol=ATOL, rtol=0, msg=lambda m: f"{what}: {m}"
    )


def _config(arch: str = "llama", **kw):
    return nd_config(arch, **{"vocab_size": V, **kw})


def _model(arch: str = "llama", seed: int = 0, **kw):
    import transformers as tf

    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(_config(arch, **kw)).eval()


@functools.cache
def _mesh(tp: int, mode: str):
    return ntp.init_mesh(tp=tp, tp_mode=mode)


def _inputs(b: int = 4, s: int = 8, vocab: int = V, pads=None):
    gen = torch.Generator().manual_seed(123)
    ids = torch.randint(0, vocab, (b, s), generator=gen)
    ids[1, 4] = vocab - 1  # the last row / column: in the padded last shard of an odd vocab
    labels = ids.clone()
    labels[0, :3] = -100  # ignored tokens: the mean is over valid tokens of the global batch
    labels[-1, 5] = -100
    mask = torch.ones(b, s, dtype=torch.long)
    if pads is None:
        mask[1, :2] = 0  # left padding of one sample
    else:  # {row: left padding}; padded labels ignored
        for row, n in pads.items():
            mask[row, :n] = 0
        labels[mask == 0] = -100
    return ids, labels, mask


def _check_model(
    arch: str, tag: str, mask: bool = True, vocab: int = V, pads=None, positions=False, **kw
) -> None:
    ref = _model(arch, vocab_size=vocab, **kw)
    ids, labels, am = _inputs(vocab=vocab, pads=pads)
    extra = {"attention_mask": am} if mask else {}
    if positions:  # per-sample position_ids (as generate builds them): 0 at the first real token
        extra["position_ids"] = (am.cumsum(-1) - 1).clamp(min=0)
    m = parallelize(copy.deepcopy(ref))
    layer = m.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, (Linear2D, Linear3D)), tag  # never 1D layers
    assert isinstance(m.model.embed_tokens, (Embedding2D, Embedding3D)), tag
    logits = m(ids, **extra).logits
    assert logits.shape == (4, 8, vocab), (tag, logits.shape)  # the true vocab, padding trimmed
    _close(logits, ref(ids, **extra).logits, f"{tag} logits")
    out, want = m(ids, labels=labels, **extra), ref(ids, labels=labels, **extra)
    _close(out.logits, want.logits, f"{tag} logits with labels")
    _close(out.loss, want.loss, f"{tag} loss")
    n = torch.tensor(7)  # HF gradient accumulation: sum / num_items_in_batch
    _close(
        m(ids, labels=labels, num_items_in_batch=n, **extra).loss,
        ref(ids, labels=labels, num_items_in_batch=n, **extra).loss,
        f"{tag} loss / num_items",
    )
    want.loss.backward()
    out.loss.backward()
    grads = gather_hf_state_dict(m, grads=True)
    expected = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected), f"{tag}: gradient names differ {set(grads) ^ set(expected)}"
    for k, g in expected.items():
        _close(grads[k], g, f"{tag} grad {k}")
    params = gather_hf_state_dict(m)
    for k, p in ref.named_parameters():
        assert torch.equal(params[k], p.detach()), f"{tag} param {k}"

    # parallel_loss: the logits stay this rank's block; full_logits gathers them.
    pl = parallelize(copy.deepcopy(ref), parallel_loss=True)
    q = round(ntp.get_mesh().tp_size ** (1 / (2 if ntp.get_mesh().tp_mode == "2d" else 3)))
    nb = q if ntp.get_mesh().tp_mode == "2d" else q * q
    local = pl(ids, labels=labels, **extra)
    want_shape = (4 // nb, 8, -(-vocab // q))  # this rank's (padded) vocab chunk
    assert tuple(local.logits.shape) == want_shape, (tag, local.logits.shape)
    _close(local.loss, want.loss, f"{tag} parallel_loss loss")
    with full_logits(pl):
        _close(pl(ids, **extra).logits, want.logits, f"{tag} full_logits")


def _refusals() -> None:
    def refused(fn, *needles):
        with pytest.raises(ValueError) as e:
            fn()
        for needle in needles:
            assert needle in str(e.value), (needle, str(e.value))

    ref = _model(num_key_value_heads=1)
    refused(
        lambda: parallelize(ref),
        "2D q=2 needs num_key_value_heads divisible by 2; got 1",
        "valid 2D grids for this model: none",
        "tp_mode='1d' with tp in [1, 2, 4]",
    )
    assert not is_parallel(ref)
    assert isinstance(ref.model.layers[0].self_attn.k_proj, torch.nn.Linear)  # untouched
    refused(lambda: parallelize(_model(), sequence_parallel=True), "sequence_parallel=True")
    refused(lambda: parallelize(_model(tie_word_embeddings=True)), "tie_word_embeddings")
    refused(lambda: parallelize(_model(), plan={"lm_head": "colwise"}), "custom plan")
    with torch.device("meta"):
        meta = _model()
    refused(lambda: parallelize(meta), "meta-device model", "tp_mode='1d'")

    import transformers as tf

    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=1, n_head=4))
    refused(lambda: parallelize(gpt2), "GPT2LMHeadModel", "LlamaForCausalLM", "tp_mode='1d'")
    m = parallelize(_model())
    refused(lambda: m(torch.zeros(3, 8, dtype=torch.long)), "divisible by 2, got 3")


def _generate(vocab: int = V) -> None:
    ref = _model(vocab_size=vocab)
    m = parallelize(copy.deepcopy(ref))
    ids = torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(7))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    want = ref.generate(ids, min_new_tokens=6, pad_token_id=0, **kw)
    got = m.generate(ids, min_new_tokens=6, pad_token_id=0, **kw)
    assert got.shape == (2, 11) and torch.equal(got, want), (got, want)


ND2_CASES = ["llama", "llama-nomask", "qwen2", "mistral", "generate", "refusals", "llama-v61"]


def _nd2_case(case: str) -> None:
    _mesh(4, "2d")
    if case == "refusals":
        _refusals()
    elif case == "generate":
        _generate()
    elif case == "llama-nomask":
        _check_model("llama", "2d llama (no mask)", mask=False)
    elif case == "llama-v61":  # q=2 does not divide the vocabulary
        _check_model("llama", "2d llama vocab 61", vocab=V_ODD)
        _generate(V_ODD)
    else:
        _check_model(case, f"2d {case}")


@pytest.mark.parametrize("case", ND2_CASES)
def test_2d(case):
    gloo_dist.run_case(_nd2_case, case, cases=ND2_CASES, world_size=4)


def _refusals_3d() -> None:
    def refused(fn, *needles):
        with pytest.raises(ValueError) as e:
            fn()
        for needle in needles:
            assert needle in str(e.value), (needle, str(e.value))

    refused(
        lambda: parallelize(_model(num_key_value_heads=1)),
        "3D q=2 needs num_key_value_heads divisible by 2; got 1",
        "valid 3D grids for this model: none",
    )
    refused(lambda: parallelize(_model(intermediate_size=42)), "intermediate_size divisible by 4")
    refused(lambda: parallelize(_model(), sequence_parallel=True), "sequence_parallel=True")
    m = parallelize(_model())
    ids, _, mask = _inputs()
    refused(lambda: m(ids[:2]), "divisible by 4, got 2")
    refused(lambda: m(ids, attention_mask=mask[:2]), "attention_mask: batch size 2", "input_ids' 4")


# Left padding on every 3d-b / 3d-a chunk but one (batch 4 = q^2 chunks of one row each): the
# attention core runs on the 3d-b chunk, the residual stream on the 3d-a chunk.
PADS_3D = {0: 3, 1: 1, 3: 5}


def _generate_padded(b: int = 4, s: int = 6, vocab: int = V) -> None:
    ref = _model(vocab_size=vocab)
    m = parallelize(copy.deepcopy(ref))
    ids = torch.randint(1, vocab, (b, s), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    for row, n in PADS_3D.items():
        mask[row, :n] = 0
    ids[mask == 0] = 0  # the pad token
    kw = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    want = ref.generate(ids, pad_token_id=0, **kw)
    got = m.generate(ids, pad_token_id=0, **kw)
    assert got.shape == (b, s + 6) and torch.equal(got, want), (got, want)


ND3_CASES = ["llama", "qwen2", "refusals", "llama-v61", "llama-padded"]


def _nd3_case(case: str) -> None:
    _mesh(8, "3d")
    if case == "refusals":
        _refusals_3d()
    elif case == "llama-v61":  # neither q=2 (LM head) nor q^2=4 (embedding) divides it
        _check_model("llama", "3d llama vocab 61", mask=False, vocab=V_ODD)
    elif case == "llama-padded":  # per-sample attention_mask / position_ids, generate
        _check_model("llama", "3d llama left-padded", pads=PADS_3D)
        _check_model("llama", "3d llama left-padded positions", pads=PADS_3D, positions=True)
        _generate_padded()
    else:
        _check_model(case, f"3d {case}", mask=False)


@pytest.mark.parametrize("case", ND3_CASES)
def test_3d(case):
    gloo_dist.run_case(_nd3_case, case, cases=ND3_CASES, world_size=8)
