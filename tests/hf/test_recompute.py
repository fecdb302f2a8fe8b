"""Activation recompute (neuron_tp.hf.recompute): the same loss and gradients as without it, fewer
saved activations (eager, counted with saved_tensors_hooks), and on XLA the recomputed ops
survive the compiler (HLO after optimizations, executed in a fresh process)."""

from __future__ import annotations

import copy
import glob
import os
import re
import sys
import tempfile

import pytest
import torch

import xla_zygote
from neuron_tp.hf.recompute import apply_activation_checkpointing
from neuron_tp.job.presets import build_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _step(model, ids):
    """Loss, parameter grads and saved-for-backward bytes (storage-deduplicated) of one step."""
    model.zero_grad()
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(1)  # the same dropout masks in every run
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], sum(seen.values())


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-gpt2"])
def test_recompute_modes_keep_numerics_and_save_less(arch):
    torch.manual_seed(0)
    ids = torch.randint(0, 257, (2, 64))
    base = build_model(arch, 257, 0).train()
    loss, grads, saved = _step(copy.deepcopy(base), ids)
    kept = {}
    for mode in ("full", "selective"):
        model = copy.deepcopy(base)
        apply_activation_checkpointing(model, mode)
        got_loss, got_grads, kept[mode] = _step(model, ids)
        torch.testing.assert_close(got_loss, loss, rtol=0, atol=0)
        for g, want in zip(got_grads, grads):
            torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)
    # full keeps each layer's input (and what the head and loss save), far less than none
    assert kept["full"] < 0.35 * saved, (kept, saved)
    assert kept["selective"] < saved, (kept, saved)


def test_recompute_rejects_unknown_mode():
    with pytest.raises(ValueError, match="'sometimes' is not a valid Recompute"):
        apply_activation_checkpointing(build_model("tiny-llama", 257, 0), "sometimes")


_DUMP = r"""
import sys, torch, torch_xla
import neuron_tp as ntp
from neuron_tp.hf.recompute import apply_activation_checkpointing
from neuron_tp.job.presets import build_model
dev = ntp.xla_device()
torch.manual_seed(0)
ids = torch.randint(0, 257, (2, 16)).to(dev)
model = build_model("tiny-llama", 257, 0).train().to(dev)
apply_activation_checkpointing(model, sys.argv[1])
model(input_ids=ids, labels=ids).loss.backward()
torch_xla.sync()
"""


def _optimized_ops(mode: str) -> dict[str, int]:
    with tempfile.TemporaryDirectory() as d:
        env = {
            **os.environ,
            "PJRT_DEVICE": "CPU",
            "PYTHONPATH": REPO,
            "XLA_FLAGS": f"--xla_dump_to={d} --xla_dump_hlo_as_text "
            "--xla_backend_optimization_level=0",
        }
        proc = xla_zygote.python(["-c", _DUMP, mode], env, 300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        step = max(glob.glob(f"{d}/*after_optimizations.txt"), key=os.path.getsize)
        hlo = open(step).read()
    return {op: len(re.findall(rf" {op}\(", hlo)) for op in ("dot", "exponential")}


def test_full_recompute_survives_the_xla_compiler():
    """The step graph after XLA's optimizations (CSE included) still runs each decoder layer's
    forward matmuls twice: 2 layers x 6 projection matmuls more than without recompute."""
    none, full = _optimized_ops("none"), _optimized_ops("full")
    assert full["dot"] >= none["dot"] + 12, (none, full)
    assert full["exponential"] > none["exponential"], (none, full)


def _selective_on_sharded_model():
    """tp=2 gloo ranks: a parallelized model (attention modules hold their own config copy)
    recomputes its attention core under selective recompute: the same loss and gradients,
    without the attention probabilities saved."""
    import neuron_tp as ntp

    mesh = ntp.init_mesh(tp=2)
    ids = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(0))
    base = build_model("tiny-llama", 257, 0).train()
    base.config._attn_implementation = "eager"  # saves the probabilities (CPU sdpa does not)
    results = {}
    for mode in ("none", "selective"):
        model = copy.deepcopy(base)
        ntp.parallelize(model, mesh, parallel_loss=True)
        apply_activation_checkpointing(model, mode)
        results[mode] = _step(model, ids)
    (loss, grads, saved), (got_loss, got_grads, kept) = results["none"], results["selective"]
    torch.testing.assert_close(got_loss, loss, rtol=0, atol=0)
    for g, want in zip(got_grads, grads):
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)
    assert kept < 0.9 * saved, (kept, saved)


def test_selective_recompute_on_a_parallelized_model():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gloo_dist

    gloo_dist.run(_selective_on_sharded_model, world_size=2)
