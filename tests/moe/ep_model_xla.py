"""A tiny MoE model trained with expert parallelism on the XLA CPU devices of one launch
(ep = the world, tp 1), next to the unsharded transformers model trained on the whole global
batch on the CPU: each rank's loss, every gathered gradient after the dp/edp reduction, and the
process-wide compile count after each step (tokens and routing differ every step); then the
same with ZeRO-1 (AdamW, experts' state cut over edp): losses, the clipped global norm and the
weights after the steps."""

from __future__ import annotations

import copy
import threading

import torch
from moe_xla_cases import XLA_OVERRIDES

import neuron_tp as ntp
from moe_archs import V, build_moe
from moe_families import build_family
from neuron_tp import hf
from neuron_tp.backend.graphs import graph_counters
from neuron_tp.optim.grads import reduce_gradients
from xla_dist import serial

ROWS = 2
_barriers: dict[int, threading.Barrier] = {}
_lock = threading.Lock()


def _counted(world: int) -> int:
    with _lock:
        barrier = _barriers.setdefault(world, threading.Barrier(world))
    barrier.wait()
    n = graph_counters()["compiles"]
    barrier.wait()
    return n


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().cpu().float() - b.detach().float()).abs().max())


def _models(name: str):
    """(mesh: ep = the world, tp 1; this rank's XLA device; the reference on the CPU; its copy
    parallelized onto the device)."""
    world = ntp.get_mesh().world_size
    mesh = ntp.init_mesh(tp=1, ep=world)
    dev = ntp.xla_device()
    with serial():  # "family:<model_type>": any MoE family (4 experts), its XLA-sized windows
        fam = name.removeprefix("family:")
        if fam != name:
            ref = build_family(fam, **XLA_OVERRIDES.get(fam, {})).train()
        else:
            ref = build_moe(name, num_experts=2 * world).train()
    m = ntp.move_to(hf.parallelize(copy.deepcopy(ref), mesh, parallel_loss=True), dev)
    return mesh, dev, ref, m


def _rows(seed: int, world: int) -> list[torch.Tensor]:
    """Every rank's ``ROWS`` sequences of one global batch."""
    ids = torch.randint(1, V, (world * ROWS, 8), generator=torch.Generator().manual_seed(seed))
    return [ids[i * ROWS : (i + 1) * ROWS] for i in range(world)]


def run_zero1(name: str = "qwen3_moe", steps: int = 2) -> dict:
    """ZeRO-1 AdamW steps with clipping vs torch's AdamW on the reference: per step the loss
    and norm differences, then the largest weight difference."""
    import torch_xla

    from neuron_tp.optim.zero1 import Zero1

    mesh, dev, ref, m = _models(name)
    world = mesh.world_size
    opt, opt_ref = Zero1(m, mesh=mesh, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    out = {"loss": [], "norm": []}
    d = mesh.dp_rank
    for step in range(steps):
        rows = _rows(300 + step, world)
        loss = m(rows[d].to(dev), labels=rows[d].to(dev)).loss
        loss.backward()
        norm = reduce_gradients(m, opt, mesh, 0.05, zero1=True)
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
        with serial():
            ref_losses = [ref(r, labels=r).loss for r in rows]
            (sum(ref_losses) / world).backward()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            opt_ref.step()
            opt_ref.zero_grad()
        out["loss"].append(_maxdiff(loss, ref_losses[d]))
        out["norm"].append(_maxdiff(norm, want))
    params = hf.gather_hf_state_dict(m)
    torch_xla.sync()
    out["weights"] = max(_maxdiff(params[n], p) for n, p in ref.named_parameters())
    return out


def run(name: str = "qwen3_moe", steps: int = 3) -> dict:
    """``steps`` SGD steps; per step the largest loss and gradient differences and the
    compile count."""
    import torch_xla

    mesh, dev, ref, m = _models(name)
    world = mesh.world_size
    opts = [torch.optim.SGD(x.parameters(), lr=0.2) for x in (m, ref)]
    out = {"loss": [], "grad": [], "compiles": []}
    d = mesh.dp_rank
    for step in range(steps):
        rows = _rows(200 + step, world)
        loss = m(rows[d].to(dev), labels=rows[d].to(dev)).loss
        loss.backward()
        reduce_gradients(m, opts[0], mesh, 0.0, zero1=False)
        grads = hf.gather_hf_state_dict(m, grads=True)
        torch_xla.sync()
        with serial():
            ref_losses = [ref(r, labels=r).loss for r in rows]
            (sum(ref_losses) / world).backward()
        out["loss"].append(_maxdiff(loss, ref_losses[d]))
        out["grad"].append(max(_maxdiff(grads[n], p.grad) for n, p in ref.named_parameters()))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch_xla.sync()
        out["compiles"].append(_counted(world))
    return out
