"""The transformer block of :mod:`neuron_tp.blocks.block_1d` computed from its full weights
with plain torch ops (an independent reference), and the sizes the tests build it with."""

import torch
import torch.nn.functional as F

HID, HEADS, FFN, B, S = 12, 4, 20, 2, 4


def ref_block(p, x, drop=lambda t: t):
    """The block computed from full weights with plain torch ops (independent reference)."""
    h = F.layer_norm(x, (HID,), p["ln1.weight"], p["ln1.bias"])
    qkv = F.linear(h, p["attn.qkv.weight"], p["attn.qkv.bias"])
    q, k, v = (t.view(x.shape[0], x.shape[1], HEADS, -1).transpose(1, 2) for t in qkv.chunk(3, -1))
    scores = (q @ k.transpose(-1, -2)) / (HID // HEADS) ** 0.5
    mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
    att = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v
    x = x + drop(
        F.linear(att.transpose(1, 2).reshape(x.shape), p["attn.out.weight"], p["attn.out.bias"])
    )
    h = F.layer_norm(x, (HID,), p["ln2.weight"], p["ln2.bias"])
    h = F.linear(
        F.gelu(F.linear(h, p["mlp.up.weight"], p["mlp.up.bias"])),
        p["mlp.down.weight"],
        p["mlp.down.bias"],
    )
    return x + drop(h)
