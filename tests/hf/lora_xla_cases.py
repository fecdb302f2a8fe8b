"""Run on 2 XLA CPU devices by tests/hf/test_lora.py (one thread per device, see
tests/helpers/xla_dist.py): a parallelized LoRA tiny Llama and a tiny Qwen3-MoE (attention LoRA)
(tp=2) vs the unsharded peft model on the CPU: logits, loss, every gathered adapter gradient,
the global grad norm."""

from __future__ import annotations

import copy

import peft  # noqa: F401  (imported before the device threads start)
import torch
import torch_xla
import transformers  # noqa: F401
import transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401

import neuron_tp as ntp
from lora_models import peft_model, sample_ids
from neuron_tp.hf import gather_hf_state_dict, parallelize
from xla_dist import serial

TOL = dict(atol=2e-5, rtol=1e-5)


MODELS = ("tiny-llama", "tiny-qwen3moe")  # a dense model and an MoE one


def _pending(name: str, dev, mesh) -> list:
    """(what, value on the device, expected on the CPU) of the LoRA model ``name``."""
    with serial():  # the global RNG and lazy imports are shared by the threads
        ref = peft_model(name)
        ids = sample_ids()
        want = ref(ids, labels=ids)
        want.loss.backward()
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    m = parallelize(copy.deepcopy(ref), mesh)  # collective: never under serial()
    m.to(dev)
    xids = ids.to(dev)
    out = m(xids, labels=xids)
    out.loss.backward()
    grads = gather_hf_state_dict(m, mesh, grads=True)
    norm = ntp.global_grad_norm(m, mesh)
    assert set(grads) == set(expected), set(grads) ^ set(expected)
    pending = [("logits", out.logits, want.logits), ("loss", out.loss, want.loss)]
    pending += [(f"grad {n}", grads[n], g) for n, g in expected.items()]
    ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in expected.values()))
    pending.append(("global_grad_norm", norm, ref_norm))
    return [(f"{name} {w}", got, exp) for w, got, exp in pending]


def job() -> dict:
    """This device thread's checks (names), compared on the CPU after one sync."""
    dev = torch_xla.device()
    mesh = ntp.init_mesh(tp=2)
    pending = [c for name in MODELS for c in _pending(name, dev, mesh)]
    torch_xla.sync()
    for what, got, exp in pending:
        torch.testing.assert_close(
            got.detach().cpu(), exp.detach(), **TOL, msg=lambda m, w=what: f"{w}: {m}"
        )
    return {"checks": [w for w, _, _ in pending]}
