"""Packed rows (neuron_tp.hf.packing.model_inputs) against plain transformers on the unsharded
model running each sample on its own: the loss (sum of token losses / token count) and every
gradient, unsharded, at tp 2 and 4 on gloo ranks (with sequence parallelism, eager attention,
selective recompute, tp 2 x dp 2) and on 2 XLA CPU devices, where 3 steps of different
packings also compile one graph."""

from __future__ import annotations

import copy
import os
import sys
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
import xla_dist  # noqa: E402
from neuron_tp.errors import UserError  # noqa: E402
from neuron_tp.hf import gather_hf_state_dict, parallelize  # noqa: E402
from neuron_tp.hf.packing import block_causal_mask, check_packable, model_inputs  # noqa: E402
from packing_ref import LAYOUTS, packed_batch, reference_loss  # noqa: E402
from tiny_configs import nd_config  # noqa: E402

V = 64
TOL = dict(atol=2e-5, rtol=1e-5)


def tiny_model(arch: str, impl: str = "sdpa", dtype=torch.float32):
    """A tiny random Llama / Qwen2 / Qwen3 / GPT-2 (seeded: the same weights on every rank).
    GPT-2's learned absolute positions are the ones that notice positions that do not restart
    (rotary attention only sees position differences, equal within a sample either way)."""
    import transformers as tf

    if arch == "gpt2":
        drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg = tf.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, **drop)
    elif arch == "qwen3":  # per-head q/k norms: replicated, gradients partial on each tp rank
        kw = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8)
        kw.update(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
        cfg = tf.Qwen3Config(vocab_size=V, max_position_embeddings=64, **kw)
    else:
        cfg = nd_config(arch, V)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _close(got, want, what):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _ref_grads(model, batches) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The reference loss of batches[0] and the gradient of the mean reference loss over
    ``batches`` (the dp average of the per-rank losses)."""
    model.zero_grad()
    losses = [reference_loss(model, b) for b in batches]
    (sum(losses) / len(losses)).backward()
    return losses[0], {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


# --- one process, the unsharded model -------------------------------------------------------


@pytest.mark.parametrize(
    "arch,impl",
    [
        ("llama", "sdpa"),
        ("llama", "eager"),
        ("qwen2", "sdpa"),
        ("qwen3", "eager"),
        ("gpt2", "sdpa"),
        ("gpt2", "eager"),
    ],
)
def test_packed_matches_per_sample(arch, impl):
    model = tiny_model(arch, impl)
    for name, layout in LAYOUTS.items():
        batch = packed_batch(layout, V, seed=len(name))
        want, grads = _ref_grads(model, [batch])
        model.zero_grad()
        loss = model(**model_inputs(batch)).loss
        _close(loss, want, f"{arch}/{impl} layout {name} loss")
        loss.backward()
        for n, p in model.named_parameters():
            _close(p.grad, grads[n], f"{arch}/{impl} layout {name} grad {n}")


def test_lora_model():
    """A peft LoRA model (the usual fine-tuning recipe) passes the mask and positions on."""
    import peft

    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_model("llama"), lora)
    batch = packed_batch(LAYOUTS["a"], V, seed=8)
    want, grads = _ref_grads(model, [batch])
    model.zero_grad()
    loss = model(**model_inputs(batch)).loss
    _close(loss, want, "lora loss")
    loss.backward()
    for n, p in model.named_parameters():
        if p.requires_grad:
            _close(p.grad, grads[n], f"lora grad {n}")


def test_sample_starts_and_padding_lose_their_labels():
    """Labels as raw tokens everywhere: model_inputs masks each sample's first token (it
    would be predicted by the previous sample) and the padding itself."""
    model = tiny_model("llama")
    batch = packed_batch(LAYOUTS["b"], V, seed=3)
    raw = {**batch, "labels": batch["input_ids"].clone()}
    _close(model(**model_inputs(raw)).loss, reference_loss(model, batch), "raw labels")


def test_padding_positions_are_ignored():
    """Padding positions beyond GPT-2's learned position table (64) do not matter."""
    model = tiny_model("gpt2")
    batch = packed_batch(LAYOUTS["a"], V, seed=6)
    far = {
        **batch,
        "position_ids": batch["position_ids"].masked_fill(batch["segment_ids"] == 0, 999),
    }
    _close(model(**model_inputs(far)).loss, reference_loss(model, batch), "padding at 999")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_padding_rows_stay_finite(impl):
    """A row of padding only (every query attends to itself only), in bf16: no NaN anywhere,
    and the padding does not change the other row's loss."""
    model = tiny_model("llama", impl, torch.bfloat16)
    batch = packed_batch([[7, 5], []], V, seed=4)
    out = model(**model_inputs(batch, dtype=torch.bfloat16))
    assert torch.isfinite(out.logits).all()
    one_row = {k: v[:1] for k, v in batch.items()}
    _close(out.loss.float(), model(**model_inputs(one_row)).loss.float(), "padding row")
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_bf16_mask_equals_fp32_mask(impl):
    """A bf16 model (``--bf16``) with the mask in bf16 (half the bytes): the loss and every
    gradient equal those with the fp32 mask within bf16 tolerance, and the per-sample
    reference (the bf16 model running each sample alone) too."""
    model = tiny_model("llama", impl, torch.bfloat16)
    bf16 = dict(atol=2e-2, rtol=2e-2)
    for name, layout in LAYOUTS.items():
        batch = packed_batch(layout, V, seed=11 + len(name))
        runs = {}
        for dtype in (torch.float32, torch.bfloat16):
            inputs = model_inputs(batch, dtype=dtype)
            assert inputs["attention_mask"].dtype == dtype
            model.zero_grad()
            loss = model(**inputs).loss
            loss.backward()
            runs[dtype] = (loss.float(), {n: p.grad.float() for n, p in model.named_parameters()})
        (loss32, grads32), (loss16, grads16) = runs[torch.float32], runs[torch.bfloat16]
        with torch.no_grad():
            want = reference_loss(model, batch)
        torch.testing.assert_close(loss16, loss32, **bf16, msg=f"{impl}/{name}: bf16 vs fp32")
        torch.testing.assert_close(loss16, want.float(), **bf16, msg=f"{impl}/{name}: vs ref")
        for n, g in grads16.items():
            torch.testing.assert_close(g, grads32[n], **bf16, msg=f"{impl}/{name}: grad {n}")


def test_mask_and_unpacked_batches():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0]])
    allowed = block_causal_mask(seg)[0, 0] == 0
    want = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 0, 1, 0, 0, 0],
            [0, 0, 1, 1, 0, 0],
            [0, 0, 1, 1, 1, 0],
            [0, 0, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(allowed, want), allowed
    plain = {"input_ids": seg, "labels": seg}
    assert model_inputs(plain) == plain  # unpacked: passed through, HF's own causal mask


@pytest.mark.parametrize(
    "change,expect",
    [
        (lambda b: b.pop("labels"), "lacks \\['labels'\\]"),
        (lambda b: b.pop("segment_ids"), "lacks \\['segment_ids'\\]"),
        (lambda b: b.update(position_ids=b["position_ids"][:, :-1]), "position_ids is a"),
        (lambda b: b.update(segment_ids=b["segment_ids"].float()), "integer"),
    ],
)
def test_bad_batches(change, expect):
    batch = packed_batch(LAYOUTS["a"], V, seed=0)
    change(batch)
    with pytest.raises(UserError, match=expect):
        model_inputs(batch)


def test_check_packable():
    check_packable(nd_config("llama"), 4096)
    check_packable(nd_config("qwen2"), 4096)  # use_sliding_window=False by default
    check_packable(nd_config("mistral", sliding_window=64), 64)
    with pytest.raises(UserError, match="window 5.*--seq-len <= 5 or --no-packing"):
        check_packable(nd_config("mistral", sliding_window=5), 16)


# --- gloo ranks: the parallelized model -----------------------------------------------------

TP2_CASES = ["llama", "llama-sp", "llama-eager", "llama-selective", "qwen3", "qwen3-sp", "gpt2"]
W4_CASES = ["tp4-llama", "tp4-qwen3-sp", "tp2dp2-llama", "2d-llama"]


def _parallel_case(case: str, world: int) -> None:
    parts = case.split("-")
    tp, dp = (2, 1) if world == 2 else ((2, 2) if parts[0] == "tp2dp2" else (4, 1))
    parts = parts[1:] if world == 4 else parts
    arch, sp = parts[0], "sp" in parts
    # 2d: the batch rows are split over the grid's 2 rows (the mask with them)
    mesh = ntp.init_mesh(tp=4, tp_mode="2d") if case == "2d-llama" else gloo_dist.shared_mesh(tp)
    assert (mesh.tp_size, mesh.dp_size) == (tp, dp)
    ref = tiny_model(arch, "eager" if "eager" in parts else "sdpa")
    batches = [packed_batch(LAYOUTS["ab"[r % 2]], V, seed=11 + r) for r in range(dp)]
    mine = batches[mesh.dp_rank]
    batches.insert(0, batches.pop(mesh.dp_rank))  # this rank's reference loss first
    want, grads = _ref_grads(ref, batches)
    m = parallelize(copy.deepcopy(ref), mesh, sequence_parallel=sp, parallel_loss=True)
    if "selective" in parts:
        ntp.apply_activation_checkpointing(m, "selective")
        m.train()
    loss = m(**model_inputs(mine)).loss
    _close(loss, want, f"{case} loss")
    loss.backward()
    ntp.sync_sequence_parallel_grads(m, mesh)
    ntp.allreduce_data_parallel_grads(m, mesh)
    got = gather_hf_state_dict(m, mesh, grads=True)
    assert set(got) == set(grads), set(got) ^ set(grads)
    for n, g in grads.items():
        _close(got[n], g, f"{case} grad {n}")


@pytest.mark.parametrize("case", TP2_CASES)
def test_tp2(case):
    gloo_dist.run_case(_parallel_case, case, 2, cases=TP2_CASES, world_size=2)


@pytest.mark.parametrize("case", W4_CASES)
def test_world4(case):
    gloo_dist.run_case(_parallel_case, case, 4, cases=W4_CASES, world_size=4)


# --- XLA CPU devices ------------------------------------------------------------------------


def test_xla_two_devices():
    """tp=2 on 2 XLA CPU devices: loss and gradients against the per-sample reference, then 3
    steps of 3 different packings: the graph count after the first step does not grow."""
    results = xla_dist.run(_xla_job, devices=2)
    counts = results[0]["counters"]
    print("XLA (compiles, transfers to host), process-wide, before and after each of 3 steps:")
    print(f"  {counts}")
    compiles, transfers = zip(*counts)
    assert compiles[2] == compiles[3] == compiles[1] > compiles[0], counts  # one step graph
    assert transfers[3] == transfers[0], counts  # nothing read back (no mid-step graph cut)


_XLA_BARRIER = threading.Barrier(2)  # the device threads of one process


def _xla_job() -> dict:
    import torch_xla

    from neuron_tp.backend.graphs import graph_counters

    dev = torch_xla.device()
    mesh = ntp.init_mesh(tp=2)
    with xla_dist.serial():
        ref = tiny_model("llama")
        batch = packed_batch(LAYOUTS["b"], V, seed=5)
        want, grads = _ref_grads(ref, [batch])
    m = parallelize(copy.deepcopy(ref), mesh, parallel_loss=True).to(dev)
    loss = m(**model_inputs(batch, device=dev)).loss
    loss.backward()
    got = gather_hf_state_dict(m, mesh, grads=True)
    torch_xla.sync()
    _close(loss.detach().cpu(), want, "xla loss")
    for n, g in grads.items():
        _close(got[n].cpu(), g, f"xla grad {n}")
    _XLA_BARRIER.wait()

    def counters_now():
        c = graph_counters()
        return c["compiles"], c["transfers_to_host"]

    counters = [counters_now()]  # before the steps
    _XLA_BARRIER.wait()
    for name in ("a", "c", "b"):  # a step: forward, backward, the graph cut
        for p in m.parameters():
            p.grad = None
        step = packed_batch(LAYOUTS[name], V, seed=ord(name))
        m(**model_inputs(step, device=dev)).loss.backward()
        torch_xla.sync()
        _XLA_BARRIER.wait()  # both threads' graphs are compiled: the count is complete
        counters.append(counters_now())
        _XLA_BARRIER.wait()
    return {"counters": counters}
