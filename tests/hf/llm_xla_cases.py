"""Run on 2 XLA CPU devices by tests/hf/test_llm_families.py (one thread per device, see
tests/helpers/xla_dist.py): tiny BLOOM (ALiBi sliced to each rank's heads), StarCoder
(multi-query: the one kv head replicated) and Granite-SWA (attention sinks split by heads),
parallelized at tp 2, vs the unsharded transformers model on the CPU: logits, parallel loss,
every gathered gradient."""

from __future__ import annotations

import copy

import torch
import torch_xla
import transformers  # noqa: F401  (imported before the device threads start)
import transformers.models.bloom.modeling_bloom  # noqa: F401
import transformers.models.gpt_bigcode.modeling_gpt_bigcode  # noqa: F401
import transformers.models.granite_swa.modeling_granite_swa  # noqa: F401

import neuron_tp as ntp
from dense_families import V, build_dense
from neuron_tp.hf import full_logits, gather_hf_state_dict, parallelize
from xla_dist import serial

TOL = dict(atol=1e-4, rtol=1e-3)
FAMILIES = ("bloom", "gpt_bigcode", "granite_swa")


def _pending(mt: str, dev, mesh) -> list:
    """(what, value on the device, expected on the CPU) of family ``mt``."""
    with serial():  # the global RNG and lazy imports are shared by the threads
        ref = build_dense(mt)
        ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(3))
        want = ref(ids, labels=ids)
        want.loss.backward()
    expected = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    m = parallelize(copy.deepcopy(ref), mesh, parallel_loss=True)  # collective
    m.to(dev)
    xids = ids.to(dev)
    with full_logits(m), torch.no_grad():
        logits = m(xids, use_cache=False).logits
    loss = m(xids, labels=xids, use_cache=False).loss
    loss.backward()
    grads = gather_hf_state_dict(m, mesh, grads=True)
    assert set(grads) == set(expected), set(grads) ^ set(expected)
    pending = [("logits", logits, want.logits), ("loss", loss, want.loss)]
    pending += [(f"grad {n}", grads[n], g) for n, g in expected.items()]
    return [(f"{mt} {w}", got, exp) for w, got, exp in pending]


def job() -> dict:
    """This device thread's checks (names), compared on the CPU after one sync."""
    dev = torch_xla.device()
    mesh = ntp.init_mesh(tp=2)
    pending = [c for mt in FAMILIES for c in _pending(mt, dev, mesh)]
    torch_xla.sync()
    for what, got, exp in pending:
        torch.testing.assert_close(
            got.detach().cpu(), exp.detach(), **TOL, msg=lambda m, w=what: f"{w}: {m}"
        )
    return {"checks": [w for w, _, _ in pending]}
