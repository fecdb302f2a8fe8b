"""Blockwise (flash-style) attention in plain torch ops: the [heads, s, s] scores never exist.

Queries are cut into blocks of ``block`` rows, keys/values into blocks of ``block`` columns; each
query block runs an online softmax over the key/value blocks (running max and running sum in
fp32, the partial output rescaled when the max grows). Every loop is a static Python loop over
static shapes, so one XLA graph serves every step; under a causal mask the key/value blocks that
lie wholly above the diagonal (or wholly outside a sliding window) are never visited.

Backward is written out (FlashAttention-2's): the forward saves only q, k, v, the output and
each row's log-sum-exp; backward recomputes each score tile from them and accumulates dq, dk,
dv block by block. So the saved tensors are O(s * d) per head and backward holds one query
block's tiles at a time.

On XLA the whole step is one graph and the compiler's scheduler is free to compute the tiles of
every query block at once (it does: measured, the peak is then the s x s scores again). Each
query block's inputs are therefore made to depend on the previous block's results (``_after``),
which orders the blocks: one query block's [block, s] tiles live at a time.

GQA: queries are viewed as [batch, kv_heads, group, s, d] and broadcast against the kv heads;
the kv heads are never repeated in memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..backend.xla import is_xla

__all__ = ["blockwise_attention", "tile_forward", "tile_backward", "Segments"]

_NEG = torch.finfo(torch.float32).min


def _after(x: torch.Tensor, done: list[torch.Tensor]) -> torch.Tensor:
    """``x``, made to depend on the tensors ``done`` (XLA only; eager runs in program order):
    work on the result cannot start before ``done`` is computed. XLA's CPU compiler drops
    optimization barriers (measured: no ordering left after its passes), a data dependency
    it must keep; x + 0 * sum is not folded for floats (0 * inf is NaN)."""
    if not done or not is_xla(x):
        return x
    total = sum(d.float().sum() for d in done)
    return x + (0.0 * total).to(x.dtype)  # type: ignore[union-attr]  # done is not empty


def _pad_to(x: torch.Tensor, dim: int, size: int, value=0) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad, value=value)


@dataclass(frozen=True)
class _Tiling:
    """The static layout: block sizes, padded lengths, which tiles to visit and mask."""

    bq: int
    bk: int
    sq: int  # padded query length
    sk: int  # padded key length
    kv_len: int  # real key length
    causal: bool
    window: int | None
    scale: float
    softcap: float | None

    def kv_blocks(self, q0: int) -> list[int]:
        last_row, out = q0 + self.bq - 1, []
        for k0 in range(0, self.sk, self.bk):
            if self.causal and k0 > last_row:
                break
            if self.window is not None and k0 + self.bk - 1 <= q0 - self.window:
                continue
            out.append(k0)
        return out or [0]  # only for padded rows; keeps the shapes static

    def allowed(self, q0: int, k0: int, device) -> torch.Tensor | None:
        """Bool [Bq, Bk] of the tile (True: attend), None when the whole tile is allowed."""
        q_pos = torch.arange(q0, q0 + self.bq, device=device).view(-1, 1)
        k_pos = torch.arange(k0, k0 + self.bk, device=device).view(1, -1)
        allowed = None

        def both(a, b):
            return b if a is None else a & b

        if self.causal and k0 + self.bk - 1 > q0:
            allowed = both(allowed, k_pos <= q_pos)
        if self.window is not None and k0 <= q0 + self.bq - 1 - self.window:
            allowed = both(allowed, k_pos > q_pos - self.window)
        if self.sk != self.kv_len and k0 + self.bk > self.kv_len:
            allowed = both(allowed, k_pos < self.kv_len)
        return allowed


class Segments(NamedTuple):
    """Segment ids of packed rows for one tile pair: ``q`` [b, sq] of the queries, ``k``
    [b, sk] of the keys (0: padding). A query attends only the keys of its own non-zero
    segment; under ``causal`` (the queries are the keys) a token also attends itself, so a
    padding row is never fully masked."""

    q: torch.Tensor
    k: torch.Tensor

    def allowed(self, t: _Tiling, q0: int, k0: int) -> torch.Tensor:
        """Bool [b, 1, 1, Bq, Bk] of the tile."""
        sq, sk = self.q[:, q0 : q0 + t.bq], self.k[:, k0 : k0 + t.bk]
        allowed = (sq[:, :, None] == sk[:, None, :]) & (sk != 0)[:, None, :]
        if t.causal and k0 + t.bk > q0 and k0 < q0 + t.bq:
            q_pos = torch.arange(q0, q0 + t.bq, device=sq.device).view(-1, 1)
            k_pos = torch.arange(k0, k0 + t.bk, device=sq.device).view(1, -1)
            allowed = allowed | (q_pos == k_pos)
        return allowed[:, None, None]

    def padded(self, t: _Tiling) -> Segments:
        return Segments(_pad_to(self.q, 1, t.sq), _pad_to(self.k, 1, t.sk))


def _tile_scores(t: _Tiling, qf, kb, mask_i, q0, k0, *, segments: Segments | None = None):
    """Scores of one tile [b, hkv, g, Bq, Bk] (fp32, masked), the tanh of the softcap (or
    None) and the bool mask (or None)."""
    b, hkv, g, rows, _ = qf.shape
    scores = torch.matmul(qf, kb.transpose(-1, -2))
    tanh = None
    if t.softcap is not None:
        tanh = torch.tanh(scores / t.softcap)
        scores = tanh * t.softcap
    allowed = t.allowed(q0, k0, qf.device)
    if segments is not None:
        seg = segments.allowed(t, q0, k0)
        allowed = seg if allowed is None else allowed & seg
    if mask_i is not None:
        mb = mask_i[..., k0 : k0 + t.bk]  # [b, h|1, Bq, Bk]
        shape = (b, 1, 1, rows, t.bk) if mb.shape[1] == 1 else (b, hkv, g, rows, t.bk)
        mb = mb.reshape(shape)
        if mb.dtype == torch.bool:
            allowed = mb if allowed is None else allowed & mb
        else:
            scores = scores + mb.float()
    if allowed is not None:
        scores = torch.where(allowed, scores, _NEG)
    return scores, tanh, allowed


def _kv(x, k0, bk):
    return x[:, :, k0 : k0 + bk].float().unsqueeze(2)  # [b, hkv, 1, Bk, d]


def _forward(t: _Tiling, q, k, v, mask, *, segments: Segments | None = None):
    """q [b, hkv, g, Sq, d] (padded), k/v [b, hkv, Sk, d]: the fp32 output and the fp32
    log-sum-exp of each row [b, hkv, g, Sq, 1]."""
    b, hkv, g, _, _ = q.shape
    outs, lses, prev = [], [], list[torch.Tensor]()
    for q0 in range(0, t.sq, t.bq):
        qi = q[:, :, :, q0 : q0 + t.bq]
        qi = _after(qi, prev)  # this block starts when the previous one is done (XLA)
        mask_i = None if mask is None else mask[:, :, q0 : q0 + t.bq]
        qf = qi.float() * t.scale
        m = qf.new_full((b, hkv, g, t.bq, 1), _NEG)
        s_sum = qf.new_zeros((b, hkv, g, t.bq, 1))
        acc = qf.new_zeros((b, hkv, g, t.bq, v.shape[-1]))
        for k0 in t.kv_blocks(q0):
            kb = _kv(k, k0, t.bk)
            scores, _, allowed = _tile_scores(t, qf, kb, mask_i, q0, k0, segments=segments)
            m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
            p = torch.exp(scores - m_new)
            if allowed is not None:  # rows with nothing allowed yet: no weight on masked keys
                p = torch.where(allowed, p, 0.0)
            alpha = torch.exp(m - m_new)
            s_sum = s_sum * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, _kv(v, k0, t.bk))
            m = m_new
        s_sum = torch.clamp(s_sum, min=torch.finfo(torch.float32).tiny)
        out = acc / s_sum
        outs.append(out)
        lses.append(m + torch.log(s_sum))
        prev = [out]
    return torch.cat(outs, dim=3), torch.cat(lses, dim=3)


def _backward(t: _Tiling, q, k, v, *, mask, out, lse, dout, segments=None):
    b, hkv, g, _, d = q.shape
    dk: list[torch.Tensor | None] = [None] * (t.sk // t.bk)
    dv: list[torch.Tensor | None] = [None] * (t.sk // t.bk)
    dqs: list[torch.Tensor] = []
    prev: list[torch.Tensor] = []
    for q0 in range(0, t.sq, t.bq):
        rows = slice(q0, q0 + t.bq)
        qi, doi = q[:, :, :, rows], dout[:, :, :, rows]
        qi, doi = _after(qi, prev), _after(doi, prev)  # one query block after the other (XLA)
        mask_i = None if mask is None else mask[:, :, rows]
        qf, dof = qi.float() * t.scale, doi.float()
        lse_i = lse[:, :, :, rows]
        delta = (dof * out[:, :, :, rows].float()).sum(-1, keepdim=True)
        dq = torch.zeros_like(qf)
        for k0 in t.kv_blocks(q0):
            j = k0 // t.bk
            kb, vb = _kv(k, k0, t.bk), _kv(v, k0, t.bk)
            scores, tanh, allowed = _tile_scores(t, qf, kb, mask_i, q0, k0, segments=segments)
            p = torch.exp(scores - lse_i)
            if allowed is not None:
                p = torch.where(allowed, p, 0.0)
            dv_j = torch.einsum("bhgqk,bhgqd->bhkd", p, dof)
            dp = torch.matmul(dof, vb.transpose(-1, -2))
            ds = p * (dp - delta)
            if tanh is not None:
                ds = ds * (1 - tanh * tanh)
            dq = dq + torch.matmul(ds, kb)
            dk_j = torch.einsum("bhgqk,bhgqd->bhkd", ds, qf)
            dk_old, dv_old = dk[j], dv[j]
            dk[j] = dk_j if dk_old is None else dk_old + dk_j
            dv[j] = dv_j if dv_old is None else dv_old + dv_j
        dqs.append(dq * t.scale)
        # Everything of this block, dk and dv included: the compiler would otherwise put their
        # updates off and keep this block's tiles alive for them.
        prev = [dqs[-1], *(x for x in dk + dv if x is not None)]
    zero = k.new_zeros((b, hkv, t.bk, k.shape[-1]), dtype=torch.float32)
    zero_v = v.new_zeros((b, hkv, t.bk, v.shape[-1]), dtype=torch.float32)
    dk_all = torch.cat([zero if x is None else x for x in dk], dim=2)
    dv_all = torch.cat([zero_v if x is None else x for x in dv], dim=2)
    return torch.cat(dqs, dim=3), dk_all, dv_all  # fp32


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, tiling, segments):  # noqa: PLR0917 (autograd's order)
        out, lse = _forward(tiling, q, k, v, mask, segments=segments)
        out = out.to(q.dtype)
        seg = (None, None) if segments is None else segments
        ctx.save_for_backward(q, k, v, mask, out, lse, *seg)
        ctx.tiling = tiling
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, mask, out, lse, seg_q, seg_k = ctx.saved_tensors
        segments = None if seg_q is None else Segments(seg_q, seg_k)
        dq, dk, dv = _backward(
            ctx.tiling,
            q,
            k,
            v,
            mask=mask,
            out=out,
            lse=lse,
            dout=dout.contiguous(),
            segments=segments,
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


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
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v without materialising the scores.

    ``query`` [b, h, sq, d], ``key``/``value`` [b, hkv, sk, d] (h a multiple of hkv: GQA);
    ``attention_mask`` None, bool [b, h|1, sq, sk] (True attends) or additive float (no
    gradient flows into a mask); ``causal`` masks key j > query i (top-left aligned, as sdpa's
    ``is_causal``) and skips the blocks above the diagonal; ``sliding_window`` w (with
    ``causal``) also masks j <= i - w; ``softcap`` c: scores c * tanh(scores / c). Sequence
    lengths that ``block`` does not divide are padded inside. ``segment_ids`` [b, s] (packed
    rows, self-attention only: sq == sk; 0 = padding): a query attends only the keys of its own
    sample (a padding token itself), each tile masked from the ids, so no [s, s] mask exists.
    Returns [b, h, sq, d_v] in ``query``'s dtype.
    """
    b, h, sq, d = query.shape
    hkv, sk = key.shape[1], key.shape[2]
    if h % hkv:
        raise ValueError(f"query heads {h} are not a multiple of key/value heads {hkv}")
    if sliding_window is not None and not causal:
        raise ValueError("sliding_window needs causal=True")
    if segment_ids is not None and (tuple(segment_ids.shape) != (b, sq) or sk != sq):
        raise ValueError(
            f"segment_ids must be [batch, seq] = {(b, sq)} of a self-attention (as many keys "
            f"as queries, got {sk}), got {tuple(segment_ids.shape)}"
        )
    g = h // hkv
    bq, bk = min(block, sq), min(block, sk)
    sq_p, sk_p = math.ceil(sq / bq) * bq, math.ceil(sk / bk) * bk
    tiling = _Tiling(
        bq,
        bk,
        sq_p,
        sk_p,
        sk,
        causal,
        sliding_window,
        1.0 / math.sqrt(d) if scale is None else scale,
        softcap,
    )
    q = _pad_to(query, 2, sq_p).reshape(b, hkv, g, sq_p, d)
    k, v = _pad_to(key, 2, sk_p), _pad_to(value, 2, sk_p)
    mask = attention_mask
    if mask is not None:
        mask = mask.detach()
        fill = False if mask.dtype == torch.bool else torch.finfo(mask.dtype).min
        mask = _pad_to(_pad_to(mask, 3, sk_p, fill), 2, sq_p, fill)
    segments = None
    if segment_ids is not None:
        seg = segment_ids.detach()
        segments = Segments(seg, seg).padded(tiling)
    out = _BlockwiseAttention.apply(q, k, v, mask, tiling, segments)
    return out.reshape(b, h, sq_p, -1)[:, :, :sq]


def _tiling(q: torch.Tensor, k: torch.Tensor, *, causal: bool, scale: float, block: int) -> _Tiling:
    sq, sk = q.shape[3], k.shape[2]
    bq, bk = min(block, sq), min(block, sk)
    sq_p, sk_p = math.ceil(sq / bq) * bq, math.ceil(sk / bk) * bk
    return _Tiling(bq, bk, sq_p, sk_p, sk, causal, None, scale, None)


def tile_forward(q, k, v, *, causal: bool, scale: float, block: int, segments=None):
    """One (queries, keys) tile pair for an outer merge (ring attention): ``q`` [b, hkv, g, sq,
    d] (GQA groups in dim 2), ``k``/``v`` [b, hkv, sk, d]; ``causal`` top-left aligned;
    ``segments`` (:class:`Segments`, or None) masks across packed samples. Returns the fp32
    output [b, hkv, g, sq, dv] and the fp32 log-sum-exp [b, hkv, g, sq, 1] of each row over
    these keys (outputs of two key sets combine by their log-sum-exps). A row with no allowed
    key here gets output 0 and a log-sum-exp near the fp32 minimum (finite: it weighs nothing
    in a merge with any row that has a key)."""
    t = _tiling(q, k, causal=causal, scale=scale, block=block)
    sq = q.shape[3]
    seg = None if segments is None else segments.padded(t)
    q, k, v = _pad_to(q, 3, t.sq), _pad_to(k, 2, t.sk), _pad_to(v, 2, t.sk)
    out, lse = _forward(t, q, k, v, None, segments=seg)
    return out[:, :, :, :sq], lse[:, :, :, :sq]


def tile_backward(
    q, k, v, out, lse, dout, *, causal: bool, scale: float, block: int, segments=None
):
    """The gradients (fp32) of q, k, v through one tile pair of :func:`tile_forward`, given the
    rows' FINAL output ``out`` and log-sum-exp ``lse`` over every key (FlashAttention-2: the
    tile's probabilities are exp(scores - lse), so the tiles' gradients simply add up)."""
    t = _tiling(q, k, causal=causal, scale=scale, block=block)
    sq, sk = q.shape[3], k.shape[2]
    seg = None if segments is None else segments.padded(t)
    q, out, lse, dout = (_pad_to(x, 3, t.sq) for x in (q, out, lse, dout))
    k, v = _pad_to(k, 2, t.sk), _pad_to(v, 2, t.sk)
    dq, dk, dv = _backward(t, q, k, v, mask=None, out=out, lse=lse, dout=dout, segments=seg)
    return dq[:, :, :, :sq], dk[:, :, :sk], dv[:, :, :sk]
