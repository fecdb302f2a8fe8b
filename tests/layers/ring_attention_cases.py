"""Cases of tests/layers/test_ring_attention.py, run on every ring rank (gloo ranks or XLA CPU
devices): ring attention over the cp ring against sdpa on the full sequence."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import neuron_tp as ntp
from neuron_tp.errors import UserError
from neuron_tp.layers.ring_attention import gather_sequence, ring_attention, split_sequence

# name: (batch, q heads, kv heads, global length, head dim, block, score scale)
CASES = {
    "mha": (1, 4, 4, 48, 8, 16, 1.0),
    "gqa": (2, 4, 2, 40, 8, 8, 1.0),  # chunks of 5 (cp 4) / 10 (cp 2): not multiples of 8
    "mqa_large_scores": (1, 4, 1, 32, 8, 4, 40.0),  # scores ~1e3: the lse merge must shift
}
NAMES = (*CASES, "chunk_order", "odd_length_refused")
XLA_NAMES = ("gqa", "mqa_large_scores", "chunk_order")  # compiles are slow: mha runs on gloo


def _inputs(b, h, hkv, s, d, mult):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, h, s, d, generator=g) * mult
    k, v = (torch.randn(b, hkv, s, d, generator=g) for _ in range(2))
    return q, k, v, torch.randn(b, h, s, d, generator=g)


def _reference(q, k, v, dout):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _run(name: str, group, device):
    b, h, hkv, s, d, block, mult = CASES[name]
    q, k, v, dout = _inputs(b, h, hkv, s, d, mult)
    want = _reference(q, k, v, dout)
    local = [split_sequence(t.to(device), group, 2).detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, group, block=block)
    grads = torch.autograd.grad(out, local, split_sequence(dout.to(device), group, 2))
    hlo = None
    got = [gather_sequence(t.detach(), group, 2) for t in (out, *grads)]
    if device.type == "xla":  # one graph for everything (each .cpu() would compile its own)
        import torch_xla

        hlo = torch_xla._XLAC._get_xla_tensors_hlo([out, *grads])
        torch_xla.sync()
    got = [t.cpu() for t in got]
    for what, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        tol = 1e-4 * max(1.0, mult)
        torch.testing.assert_close(a, w, rtol=tol, atol=tol, msg=lambda m, n=what: f"{n}: {m}")
    return hlo


def _chunk_order(group, device):
    """Rank r holds global chunks r and 2cp-1-r (checked on token positions)."""
    n, c = group.size, 3
    pos = torch.arange(2 * n * c, device=device).view(1, -1)
    mine = split_sequence(pos, group, 1).cpu().view(-1).tolist()
    r = group.rank
    assert mine == [*range(r * c, r * c + c), *range((2 * n - 1 - r) * c, (2 * n - r) * c)], mine


def _odd_length(group, device):
    x = torch.zeros(1, 2 * group.size + 1, device=device)
    try:
        split_sequence(x, group, 1)
    except UserError as e:
        assert f"multiple of 2 x cp = {2 * group.size}" in str(e), e
    else:
        raise AssertionError("a length the ring cannot split was accepted")


def check(name: str, device_kind: str = "cpu"):
    """One case on this rank; returns the traced HLO of the XLA cases (ranks compare it)."""
    if device_kind == "xla":
        import torch_xla.runtime as xr

        mesh, device = ntp.init_mesh(cp=xr.world_size()), ntp.xla_device()
    else:
        import torch.distributed as dist

        from gloo_dist import shared_mesh

        mesh, device = shared_mesh(1, cp=dist.get_world_size()), torch.device("cpu")
    group = mesh.cp
    if name == "chunk_order":
        return _chunk_order(group, device)
    if name == "odd_length_refused":
        return _odd_length(group, device)
    return _run(name, group, device)


def xla_job(name: str):
    return check(name, "xla")
