"""Zero1 EXECUTED on XLA CPU devices (run by tests/optim/test_zero1_xla.py through xla_dist): dp =
the number of devices, AdamW with a device learning rate and ``capturable`` (as the training loop
makes it), clipping every step; parameters and gradient norms against plain AdamW on the
unsharded model in CPU torch with the same global batch, and the compiles after warm-up."""

from __future__ import annotations

import threading

import torch
import torch_xla
from torch import nn

import neuron_tp as ntp
from neuron_tp.backend.graphs import graph_counters
from neuron_tp.optim.zero1 import Zero1
from xla_dist import serial

IN, HID, OUT, BATCH, STEPS, WARMUP = 6, 10, 3, 8, 8, 3
LR, CLIP = 1e-2, 0.3
_barriers: dict[int, threading.Barrier] = {}


def _together(n: int) -> None:
    """Wait for every device thread: they then compile and launch each graph side by side
    (XLA:CPU aborts a collective whose devices arrive ~10 s apart; the machine may be busy)."""
    with serial():
        barrier = _barriers.setdefault(n, threading.Barrier(n))
    barrier.wait(timeout=300)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def _batch(step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def job(dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    mesh = ntp.init_mesh(tp=1)
    dev = torch_xla.device()
    with serial():
        ref = _mlp()
        model = _mlp().to(dtype).to(dev)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
    lr = torch.tensor([LR], dtype=torch.float32, device=dev)
    zero = Zero1(
        [{"params": list(model.parameters()), "lr": lr}],
        mesh,
        model=model,
        weight_decay=0.1,
        capturable=True,
        foreach=False,
    )
    _together(mesh.dp_size)
    torch_xla.sync()
    n = BATCH // mesh.dp_size
    norms, ref_norms, before = [], [], None
    for i in range(STEPS):
        if i == WARMUP:  # every thread compiled its graphs so far (compiles run in sync())
            _together(mesh.dp_size)
            before = graph_counters()
        x, y = _batch(i)
        zero.zero_grad()
        xl, yl = x[mesh.dp_rank * n : (mesh.dp_rank + 1) * n], y[mesh.dp_rank * n :][:n]
        loss = (model(xl.to(dev, dtype)).float() - yl.to(dev)).pow(2).mean()
        loss.backward()
        norms.append(zero.clip_grad_norm_(CLIP))
        zero.step()
        _together(mesh.dp_size)
        torch_xla.sync()
        ref_opt.zero_grad()
        (ref(x) - y).pow(2).mean().backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP))
        ref_opt.step()
    _together(mesh.dp_size)
    after = graph_counters()
    full = zero.full_state_dict()
    _together(mesh.dp_size)
    torch_xla.sync()
    if dtype == torch.float32:
        got = [p.detach().cpu() for p in model.parameters()]
    else:
        got = [full["params"][name]["master"].cpu() for name, _ in model.named_parameters()]
    return {
        "rank": mesh.dp_rank,
        "param_diff": max((a - b).abs().max().item() for a, b in zip(got, ref.parameters())),
        "norm_diff": max(abs(a.item() - b.item()) for a, b in zip(norms, ref_norms)),
        "min_ref_norm": min(r.item() for r in ref_norms),
        "compiles_in_warmup": before["compiles"],
        "compiles_after_warmup": after["compiles"] - before["compiles"],
        "host_reads_after_warmup": after["transfers_to_host"] - before["transfers_to_host"],
        "exp_avg_numel": sum(
            st["exp_avg"].numel() for st in zero.state.values() if "exp_avg" in st
        ),
    }
