"""Blockwise (flash-style) attention in plain torch ops: the [heads, s, s] scores never exist.

Queries are cut into blocks of ``block`` rows, keys/values into blocks of ``block`` columns; each
query block runs an online softmax over the key/value blocks (running max and running sum in
fp32, the partial output rescaled when the max grows). Every loop is a static Python loop over
static shapes, so one XLA graph serves every step; under a causal mask the key/value blocks that
lie wholly above the diagonal (or wholly outside a sliding window) are never visited.

Memory: the forward holds one [block, block] score tile per head at a time. For backward each
query block runs under ``recompute`` (an activation-checkpoint function): only its inputs and
output are kept, its tiles are recomputed in backward, so backward holds one query block's
[block, s] worth of tiles, not [s, s].

GQA: queries are viewed as [batch, kv_heads, group, s, d] and broadcast against the kv heads;
the kv heads are never repeated in memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["blockwise_attention"]


def _pad_to(x: torch.Tensor, dim: int, size: int, value=0) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad, value=value)


def _query_block(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    q0: int,
    kv_blocks: list[int],
    block: int,
    kv_len: int,
    kv_padded: bool,
    causal: bool,
    window: int | None,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """One query block ``q`` [b, hkv, g, B, d] (rows ``q0..q0+B``) against the key/value blocks
    starting at ``kv_blocks`` of ``k``/``v`` [b, hkv, S, d]. ``mask`` (bool: True attends, or
    additive float) is [b, h|1, B, S] for this block's rows, or None. Returns [b, hkv, g, B, d]."""
    b, hkv, g, rows, d = q.shape
    qf = q.float() * scale
    neg = torch.finfo(torch.float32).min
    m = qf.new_full((b, hkv, g, rows, 1), neg)
    s_sum = qf.new_zeros((b, hkv, g, rows, 1))
    acc = qf.new_zeros((b, hkv, g, rows, v.shape[-1]))
    q_pos = torch.arange(q0, q0 + rows, device=q.device).view(rows, 1)
    for k0 in kv_blocks:
        kb = k[:, :, k0 : k0 + block].float().unsqueeze(2)  # [b, hkv, 1, B, d]
        vb = v[:, :, k0 : k0 + block].float().unsqueeze(2)
        scores = torch.matmul(qf, kb.transpose(-1, -2))  # [b, hkv, g, Bq, Bk]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        allowed = None
        k_pos = torch.arange(k0, k0 + block, device=q.device).view(1, block)
        needs_causal = causal and k0 + block - 1 > q0
        needs_window = window is not None and k0 <= q0 + rows - 1 - window
        needs_valid = kv_padded and k0 + block > kv_len
        if needs_causal:
            allowed = k_pos <= q_pos
        if needs_window:
            inside = k_pos > q_pos - window
            allowed = inside if allowed is None else allowed & inside
        if needs_valid:
            valid = k_pos < kv_len
            allowed = valid if allowed is None else allowed & valid
        if mask is not None:
            mb = mask[..., k0 : k0 + block]  # [b, h|1, Bq, Bk]
            mb = (
                mb.reshape(b, -1, 1, rows, block)
                if mb.shape[1] == 1
                else mb.reshape(b, hkv, g, rows, block)
            )
            if mb.dtype == torch.bool:
                allowed = mb if allowed is None else allowed & mb
            else:
                scores = scores + mb.float()
        if allowed is not None:
            scores = torch.where(allowed, scores, neg)
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        p = torch.exp(scores - m_new)
        if allowed is not None:
            # A row with nothing allowed yet has m_new == neg and p == 1 on masked keys: zero
            # them so that fully masked rows give 0 (their later real keys rescale anyway).
            p = torch.where(allowed, p, 0.0)
        alpha = torch.exp(m - m_new)
        s_sum = s_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, vb)
        m = m_new
    out = acc / torch.clamp(s_sum, min=torch.finfo(torch.float32).tiny)
    return out.to(q.dtype)


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
    block: int = 512,
    sliding_window: int | None = None,
    softcap: float | None = None,
    recompute: Callable | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v without materialising the scores.

    ``query`` [b, h, sq, d], ``key``/``value`` [b, hkv, sk, d] (h a multiple of hkv: GQA);
    ``attention_mask`` None, bool [b, h|1, sq, sk] (True attends) or additive float;
    ``causal`` masks key j > query i (top-left aligned, as sdpa's ``is_causal``) and skips the
    blocks above the diagonal; ``sliding_window`` w (with ``causal``) also masks j <= i - w.
    ``recompute(fn, *tensors)`` (e.g. activation checkpointing) wraps each query block when
    gradients are needed. Sequence lengths that ``block`` does not divide are padded inside.
    Returns [b, h, sq, d_v] in ``query``'s dtype.
    """
    b, h, sq, d = query.shape
    hkv, sk = key.shape[1], key.shape[2]
    if h % hkv:
        raise ValueError(f"query heads {h} are not a multiple of key/value heads {hkv}")
    if sliding_window is not None and not causal:
        raise ValueError("sliding_window needs causal=True")
    g = h // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    bq, block_k = min(block, sq), min(block, sk)
    nq, nk = math.ceil(sq / bq), math.ceil(sk / block_k)
    sq_p, sk_p = nq * bq, nk * block_k
    q = _pad_to(query, 2, sq_p).view(b, hkv, g, sq_p, d)
    k = _pad_to(key, 2, sk_p)
    v = _pad_to(value, 2, sk_p)
    mask = attention_mask
    if mask is not None:
        fill = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        mask = _pad_to(_pad_to(mask, 3, sk_p, fill), 2, sq_p, fill)
    train = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    outs = []
    for i in range(nq):
        q0 = i * bq
        last_row = q0 + bq - 1
        kv_blocks = []
        for j in range(nk):
            k0 = j * block_k
            if causal and k0 > last_row:
                break
            if sliding_window is not None and k0 + block_k - 1 <= q0 - sliding_window:
                continue
            kv_blocks.append(k0)
        if not kv_blocks:  # only possible for padded rows; keep shapes static
            kv_blocks = [0]
        mask_i = None if mask is None else mask[:, :, q0 : q0 + bq]

        def run(qi, k_, v_, mask_i=mask_i, q0=q0, kv_blocks=kv_blocks):
            return _query_block(
                qi,
                k_,
                v_,
                mask_i,
                q0=q0,
                kv_blocks=kv_blocks,
                block=block_k,
                kv_len=sk,
                kv_padded=sk_p != sk,
                causal=causal,
                window=sliding_window,
                scale=scale,
                softcap=softcap,
            )

        qi = q[:, :, :, q0 : q0 + bq]
        if train and recompute is not None:
            outs.append(recompute(run, qi, k, v))
        else:
            outs.append(run(qi, k, v))
    out = torch.cat(outs, dim=3).view(b, h, sq_p, -1)
    return out[:, :, :sq]
