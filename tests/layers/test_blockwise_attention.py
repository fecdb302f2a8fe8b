"""Blockwise attention (neuron_tp.layers.blockwise_attention) against sdpa on the same inputs:
the output and the gradients of q, k and v to fp32 rounding; causal and not, GQA, padding masks
(bool and additive), packed rows' segment ids (against sdpa given the block-diagonal causal
mask), sliding window, softcap, lengths that are and are not multiples of the block, on the CPU
and on the XLA device; backward recomputes the tiles: nothing of size s x s is saved."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from neuron_tp.layers.blockwise_attention import blockwise_attention


def _inputs(b, h, hkv, s, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, n, s, d, generator=g, requires_grad=True) for n in (h, hkv, hkv)]


def _reference(q, k, v, mask=None, causal=False, scale=None, window=None, softcap=None):
    """Plain softmax attention (sdpa where it has the feature, eager math otherwise)."""
    if window is None and softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
        )
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    i = torch.arange(q.shape[2]).view(-1, 1)
    j = torch.arange(k.shape[2]).view(1, -1)
    allowed = torch.ones_like(scores, dtype=torch.bool)
    if causal:
        allowed = allowed & (j <= i)
    if window is not None:
        allowed = allowed & (j > i - window)
    if mask is not None:
        allowed = allowed & mask
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def _check(q, k, v, out, ref, rows=slice(None)):
    go = torch.randn_like(ref)
    want = torch.autograd.grad(ref[:, :, rows], (q, k, v), go[:, :, rows])
    got = torch.autograd.grad(out[:, :, rows], (q, k, v), go[:, :, rows])
    torch.testing.assert_close(out[:, :, rows], ref[:, :, rows], rtol=1e-5, atol=1e-5)
    for name, a, b in zip("qkv", got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.parametrize("s", [16, 40, 64, 7, 100])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_matches_sdpa(s, causal, heads):
    q, k, v = _inputs(2, *heads, s)
    out = blockwise_attention(q, k, v, causal=causal, block=16)
    _check(q, k, v, out, _reference(q, k, v, causal=causal))


@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_padding_mask(kind):
    """Left padding as transformers builds it (causal & key is a real token); rows that are
    padding themselves are garbage in both, so only real rows are compared."""
    s, b = 45, 2
    q, k, v = _inputs(b, 4, 2, s, seed=1)
    real = torch.ones(b, s, dtype=torch.bool)
    real[1, :13] = False
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    mask = (causal & real[:, None, None, :]).expand(b, 1, s, s)
    ref = _reference(q, k, v, mask=mask)
    passed = mask if kind == "bool" else torch.zeros(mask.shape).masked_fill(~mask, -1e30)
    out = blockwise_attention(q, k, v, passed, causal=True, block=16)
    out = out * real[:, None, :, None]  # drop the padding rows from outputs and gradients
    ref = ref * real[:, None, :, None]
    _check(q, k, v, out, ref)


def packed_segments(b: int, s: int) -> torch.Tensor:
    """Segment ids [b, s] of packed rows: samples crossing block boundaries and starting on
    one, a one-token sample, padding (0) at the end of a row."""
    lengths = [[16, 7, 1, 12, 5], [3, 29, 9]]  # row 0: 41 tokens + 4 padding
    seg = torch.zeros(b, s, dtype=torch.long)
    for r in range(b):
        at = 0
        for i, n in enumerate(lengths[r % 2]):
            seg[r, at : at + n] = i + 1
            at += n
    return seg


def block_diagonal(seg: torch.Tensor) -> torch.Tensor:
    """The bool [b, 1, s, s] mask packing gives sdpa: causal, same sample, padding keys
    ignored; a padding token attends itself only."""
    s = seg.shape[1]
    causal = torch.tril(torch.ones(s, s, dtype=torch.bool))
    same = (seg[:, :, None] == seg[:, None, :]) & (seg != 0)[:, None, :]
    return ((causal & same) | torch.eye(s, dtype=torch.bool))[:, None]


@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
def test_segment_ids_equal_the_block_diagonal_mask(heads):
    """Packed rows by segment ids (each tile masked from the ids, no [s, s] mask) equal sdpa
    given the packed rows' 4D mask: every row, padding included; 45 tokens in blocks of 16."""
    s, b = 45, 2
    q, k, v = _inputs(b, *heads, s, seed=3)
    seg = packed_segments(b, s)
    out = blockwise_attention(q, k, v, causal=True, block=16, segment_ids=seg)
    _check(q, k, v, out, _reference(q, k, v, mask=block_diagonal(seg)))


def test_scale_window_softcap():
    q, k, v = _inputs(1, 4, 2, 70, seed=2)
    out = blockwise_attention(
        q,
        k,
        v,
        causal=True,
        block=16,
        scale=0.3,
        sliding_window=20,
        softcap=5.0,
    )
    ref = _reference(q, k, v, causal=True, scale=0.3, window=20, softcap=5.0)
    _check(q, k, v, out, ref)


def test_no_scores_are_saved():
    """What the forward saves for backward is O(s * d) per head (q, k, v, output, log-sum-exp):
    the score tiles (s*s/2 elements per head under a causal mask) are recomputed, not kept."""
    s = 256
    q, k, v = _inputs(1, 2, 2, s)
    sizes = {}

    def pack(t):  # elements per storage (each query block saves the same k and v)
        sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // 4
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = blockwise_attention(q, k, v, causal=True, block=32)
    out.sum().backward()
    heads, d = 2, 8
    assert sum(sizes.values()) <= heads * s * (4 * d + 1), sizes  # q, k, v, out; lse
    sizes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ref = _reference(q, k, v, causal=True, window=s)  # eager math: saves [2, s, s]
    assert max(sizes.values()) >= 2 * s * s
    del ref


_ON_XLA = r"""
import torch, torch.nn.functional as F, torch_xla
import neuron_tp as ntp
from neuron_tp.layers.blockwise_attention import blockwise_attention
from test_blockwise_attention import block_diagonal, packed_segments
dev = ntp.xla_device()
g = torch.Generator().manual_seed(0)
seg = packed_segments(2, 45)
for s, causal in ((40, True), (64, False), (45, "packed")):
    cpu = [3 * torch.randn(2, n, s, 8, generator=g) for n in (4, 2, 2)]
    go = torch.randn(2, 4, s, 8, generator=g)
    ref_in = [t.clone().requires_grad_() for t in cpu]
    packed = causal == "packed"  # segment ids against the block-diagonal mask
    mask = block_diagonal(seg) if packed else None
    ref = F.scaled_dot_product_attention(
        *ref_in, attn_mask=mask, is_causal=causal is True, enable_gqa=True
    )
    want = [ref.detach(), *torch.autograd.grad(ref, ref_in, go)]
    x_in = [t.to(dev).requires_grad_() for t in cpu]
    ids = seg.to(dev) if packed else None
    out = blockwise_attention(*x_in, causal=bool(causal), block=16, segment_ids=ids)
    (out * go.to(dev)).sum().backward()
    got = [out, *(t.grad for t in x_in)]
    torch_xla.sync()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=1e-4, msg=lambda m: f"{name}: {m}")
print("ok")
"""


def test_matches_sdpa_on_the_xla_device():
    """On the XLA CPU device (query blocks ordered by optimization barriers): output and the
    gradients of q, k, v equal CPU sdpa's (scores large enough that the running-max rescale
    matters), packed rows by segment ids too."""
    import os

    import xla_zygote

    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": f"{repo}{os.pathsep}{here}"}
    proc = xla_zygote.python(["-c", _ON_XLA], env, 300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


_XLA_BYTES = r"""
import sys, torch, torch.nn.functional as F, torch_xla
import neuron_tp as ntp
from neuron_tp.layers.blockwise_attention import blockwise_attention
dev = ntp.xla_device()
q, k, v = (torch.randn(1, 4, 2048, 64, device=dev, requires_grad=True) for _ in range(3))
if sys.argv[1] == "sdpa":
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
else:
    out = blockwise_attention(q, k, v, causal=True, block=256)
out.sum().backward()
torch_xla.sync()
"""


def _xla_buffer_bytes(attention: str) -> int:
    """XLA's own count of the buffers of the forward+backward graph (its buffer assignment)."""
    import glob
    import os
    import re
    import tempfile

    import xla_zygote

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory() as d:
        env = {
            **os.environ,
            "PJRT_DEVICE": "CPU",
            "PYTHONPATH": repo,
            "XLA_FLAGS": f"--xla_dump_to={d}",
        }
        proc = xla_zygote.python(["-c", _XLA_BYTES, attention], env, 300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        text = open(max(glob.glob(f"{d}/*buffer-assignment.txt"), key=os.path.getsize)).read()
    return int(re.search(r"Total bytes used: (\d+)", text).group(1))


def test_xla_graph_memory_is_not_quadratic():
    """s = 2048, 4 heads: XLA's buffers for sdpa's forward+backward hold several [4, s, s]
    fp32 tensors (64 MiB each); blockwise (block 256) holds one query block's tiles at a time."""
    sdpa, blockwise = _xla_buffer_bytes("sdpa"), _xla_buffer_bytes("blockwise")
    print(
        f"XLA buffers at s=2048: sdpa {sdpa / 2**20:.0f} MiB, blockwise {blockwise / 2**20:.0f} MiB"
    )
    assert sdpa > 3 * 64 * 2**20, sdpa
    assert blockwise < 0.3 * sdpa, (blockwise, sdpa)  # measured 65 vs 278 MiB
