"""Ring attention: causal attention over a sequence split across the context-parallel ring.

The global sequence of length S is cut into ``2 * cp`` chunks of ``c = S / (2 cp)`` tokens;
ring rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (one from the front, its mirror from
the back), so under a causal mask every rank does the same work (:func:`split_sequence`).

Each rank keeps its queries; keys/values travel the ring (``cp - 1`` hops of
:func:`neuron_tp.parallel.comm.ring_shift`, keys and values in one message). Each hop's
block is consumed by the blockwise online softmax (:func:`~.blockwise_attention.tile_forward`)
and merged into the running output by the log-sum-exps. Which (query chunk, key chunk) pairs
are needed is fixed by the layout:

- hop 0 (own keys): causal attention over the local ``2c`` tokens (they are in global order);
- hop ``j >= 1`` (keys of rank ``s = r - j mod cp``): the back query chunk sees the source's
  front chunk whole (always), and one more full ``c x c`` tile: the front queries against the
  source's front keys when ``s < r`` (``j <= r``), else the back queries against the source's
  back keys. That choice is made on the device from the rank tensor (``torch.where``), so
  every rank traces one graph; every other pair is skipped.

Backward is written out: hop 0 and every hop's tiles are recomputed from the saved q, k, v,
output and log-sum-exp (FlashAttention-2), keys/values travel the ring again, and the
gradient of each key/value block travels with it, gathering each rank's contribution, and
takes one more hop home to its owner (``cp`` hops). GQA: the kv heads are never repeated.

Bytes each rank sends per attention call (elements of the local k/v: ``b * hkv * 2c * d`` each):
forward ``(cp - 1) * 2 * kv`` elements in the input dtype; backward the same again plus
``cp * 2 * kv`` fp32 for the gradients (collective-permute on Neuron; on XLA:CPU devices the
ring hop is carried by an all-gather: ``cp`` times that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..backend.xla import is_xla
from ..errors import UserError
from ..parallel import comm
from ..parallel.mesh import Group
from .blockwise_attention import Segments, tile_backward, tile_forward

__all__ = ["ring_attention", "split_sequence", "gather_sequence", "chunk_order"]


def chunk_order(cp: int) -> list[int]:
    """The global chunks (of ``2 * cp``) in ring-rank order: rank r holds entries 2r, 2r+1."""
    return [c for r in range(cp) for c in (r, 2 * cp - 1 - r)]


def check_length(length: int, cp: int, what: str = "sequence length") -> None:
    """Refuse a length the ring cannot split into ``2 * cp`` equal chunks."""
    if length % (2 * cp):
        raise UserError(
            f"{what} {length} cannot be split over the context-parallel ring of cp={cp}: it "
            f"must be a multiple of 2 x cp = {2 * cp} (e.g. {length // (2 * cp) * 2 * cp} or "
            f"{(length // (2 * cp) + 1) * 2 * cp})"
        )


def _my_chunks(group: Group, device) -> torch.Tensor:
    r = group.rank_tensor(device)
    return torch.cat([r, 2 * group.size - 1 - r])


def split_sequence(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """This ring rank's part of a global sequence along ``dim``: chunks r and 2cp-1-r (on XLA
    chosen by a device-side rank tensor: one graph for every rank)."""
    n = group.size
    if n == 1:
        return x
    dim = dim % x.dim()
    check_length(x.shape[dim], n)
    c = x.shape[dim] // (2 * n)
    if not is_xla(x):
        r = group.rank
        return torch.cat([x.narrow(dim, r * c, c), x.narrow(dim, (2 * n - 1 - r) * c, c)], dim)
    chunks = x.unflatten(dim, (2 * n, c))
    return chunks.index_select(dim, _my_chunks(group, x.device)).flatten(dim, dim + 1)


def gather_sequence(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """The global sequence from every ring rank's part (the inverse of
    :func:`split_sequence`; an all-gather, not differentiable)."""
    n = group.size
    if n == 1:
        return x
    dim = dim % x.dim()
    parts = comm.all_gather(x.detach().contiguous(), group, dim)  # chunk_order(n) along dim
    chunks = parts.unflatten(dim, (2 * n, x.shape[dim] // 2))
    inverse = [chunk_order(n).index(i) for i in range(2 * n)]
    index = torch.tensor(inverse, device=x.device)
    return chunks.index_select(dim, index).flatten(dim, dim + 1)


@dataclass(frozen=True)
class _Ring:
    group: Group
    scale: float
    block: int

    def tile(self, q, k, v, causal=False, *, segments=None):
        return tile_forward(
            q, k, v, causal=causal, scale=self.scale, block=self.block, segments=segments
        )

    def tile_grad(self, q, k, v, out, lse, dout, *, causal=False, segments=None):  # noqa: PLR0917 (tile_backward's order)
        return tile_backward(
            q,
            k,
            v,
            out,
            lse,
            dout,
            causal=causal,
            scale=self.scale,
            block=self.block,
            segments=segments,
        )

    def front_hop(self, j: int, device) -> torch.Tensor:
        """Bool [1]: at hop j the extra tile is (front queries, source's front keys)."""
        return self.group.rank_tensor(device) >= j


class _RingSegments(NamedTuple):
    """Packed rows under the ring: every rank holds the GLOBAL segment ids ``[b, S]`` and
    picks the chunks of the keys it holds at each hop (no message: the keys' owner at hop j
    is known), so each tile masks by segment; the causal order comes from the layout."""

    chunks: torch.Tensor  # [b, 2cp, c]
    group: Group

    def hop(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Segment ids [b, c] of the front and back chunks of the keys held at hop ``j`` (those
        of ring rank r - j mod cp; hop 0: this rank's own tokens)."""
        n = self.group.size
        src = (self.group.rank_tensor(self.chunks.device) - j) % n
        picked = self.chunks.index_select(1, torch.cat([src, 2 * n - 1 - src]))
        return picked[:, 0], picked[:, 1]

    def tiles(self, j: int, front: torch.Tensor) -> tuple[Segments, Segments]:
        """The segments of hop ``j``'s two tiles: (back queries, source's front keys) and the
        extra tile chosen by ``front`` (see :func:`_ring_forward`)."""
        q_f, q_b = self.hop(0)
        k_f, k_b = self.hop(j)
        extra = Segments(_where(front, q_f, q_b), _where(front, k_f, k_b))
        return Segments(q_b, k_f), extra


def _own(segments: _RingSegments | None) -> Segments | None:
    if segments is None:
        return None
    mine = torch.cat(segments.hop(0), 1)
    return Segments(mine, mine)


def _merge(out1, lse1, out2, lse2):
    """Two softmax results over disjoint key sets combined by their log-sum-exps (shifted by
    the larger one, so nothing overflows; ``lse2 = -inf`` adds nothing)."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    return (out1 * w1 + out2 * w2) / total, m + torch.log(total)


def _halves(x, dim=3):
    c = x.shape[dim] // 2
    return x.narrow(dim, 0, c), x.narrow(dim, c, c)


def _where(a, x, y):
    """``x`` where the bool [1] ``a`` holds, else ``y`` (same shapes)."""
    return torch.where(a.view([1] * x.dim()), x, y)


def _ring_forward(ring: _Ring, q, k, v, *, segments: _RingSegments | None = None):
    out, lse = ring.tile(q, k, v, causal=True, segments=_own(segments))
    (out_f, out_b), (lse_f, lse_b) = _halves(out), _halves(lse)
    q_f, q_b = _halves(q)
    kv, dk = torch.cat([k, v], -1), k.shape[-1]
    none = torch.tensor(float("-inf"), device=q.device)
    for j in range(1, ring.group.size):
        kv = comm.ring_shift(kv, ring.group)
        (k_f, k_b), (v_f, v_b) = _halves(kv[..., :dk], 2), _halves(kv[..., dk:], 2)
        front = ring.front_hop(j, q.device)
        seg_b, seg_x = (None, None) if segments is None else segments.tiles(j, front)
        o, s = ring.tile(q_b, k_f, v_f, segments=seg_b)
        out_b, lse_b = _merge(out_b, lse_b, o, s)
        o, s = ring.tile(
            _where(front, q_f, q_b),
            _where(front, k_f, k_b),
            _where(front, v_f, v_b),
            segments=seg_x,
        )
        out_f, lse_f = _merge(out_f, lse_f, o, _where(front, s, none))
        out_b, lse_b = _merge(out_b, lse_b, o, _where(front, none, s))
    return torch.cat([out_f, out_b], 3), torch.cat([lse_f, lse_b], 3)


def _ring_backward(ring: _Ring, q, k, v, *, out, lse, dout, segments=None):
    dq, dk, dv = ring.tile_grad(q, k, v, out, lse, dout, causal=True, segments=_own(segments))
    if ring.group.size == 1:
        return dq, dk, dv
    (q_f, q_b), (o_f, o_b), (l_f, l_b), (g_f, g_b) = (_halves(x) for x in (q, out, lse, dout))
    dq_f, dq_b = _halves(dq)
    kv, d = torch.cat([k, v], -1), k.shape[-1]
    dkv = torch.cat([dk, dv], -1)  # fp32, travels with the keys/values it belongs to
    for j in range(1, ring.group.size):
        kv, dkv = comm.ring_shift(kv, ring.group), comm.ring_shift(dkv, ring.group)
        (k_f, k_b), (v_f, v_b) = _halves(kv[..., :d], 2), _halves(kv[..., d:], 2)
        dkv_f, dkv_b = _halves(dkv, 2)
        front = ring.front_hop(j, q.device)
        seg_b, seg_x = (None, None) if segments is None else segments.tiles(j, front)
        gq, gk, gv = ring.tile_grad(q_b, k_f, v_f, o_b, l_b, g_b, segments=seg_b)
        dq_b, dkv_f = dq_b + gq, dkv_f + torch.cat([gk, gv], -1)
        gq, gk, gv = ring.tile_grad(
            *(_where(front, a, b) for a, b in ((q_f, q_b), (k_f, k_b), (v_f, v_b))),
            *(_where(front, a, b) for a, b in ((o_f, o_b), (l_f, l_b), (g_f, g_b))),
            segments=seg_x,
        )
        zero, gkv = torch.zeros_like(gq), torch.cat([gk, gv], -1)
        dq_f, dq_b = dq_f + _where(front, gq, zero), dq_b + _where(front, zero, gq)
        zero = torch.zeros_like(gkv)
        dkv = torch.cat([dkv_f + _where(front, gkv, zero), dkv_b + _where(front, zero, gkv)], 2)
    dkv = comm.ring_shift(dkv, ring.group)  # home: the gradients of this rank's own keys/values
    return torch.cat([dq_f, dq_b], 3), dkv[..., :d], dkv[..., d:]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, segments):  # noqa: PLR0917
        out, lse = _ring_forward(ring, q, k, v, segments=segments)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.segments = ring, segments
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(
            ctx.ring, q, k, v, out=out, lse=lse, dout=dout.contiguous(), segments=ctx.segments
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    group: Group,
    *,
    scale: float | None = None,
    block: int = 512,
    segment_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax(q k^T * scale) v over a sequence split across the ring ``group``.

    ``query`` [b, h, s, d], ``key``/``value`` [b, hkv, s, d] (h a multiple of hkv: GQA), where
    ``s`` is this rank's part of the global sequence as :func:`split_sequence` lays it out
    (chunks r and 2cp-1-r). Returns this rank's rows of the output [b, h, s, d_v] in
    ``query``'s dtype. Every rank of ``group`` must call it (it exchanges keys/values).

    ``segment_ids``: packed rows, the GLOBAL segment ids ``[b, S]`` (S = s x cp; 1..k the
    samples of a row, 0 padding; the same on every rank): a token attends only the earlier
    tokens of its own sample (a padding token only itself), in forward and backward.
    """
    b, h, s, d = query.shape
    hkv = key.shape[1]
    if h % hkv:
        raise ValueError(f"query heads {h} are not a multiple of key/value heads {hkv}")
    if s % 2:
        raise UserError(
            f"ring attention needs an even local length (two chunks per rank), got {s}; "
            "split the global sequence with split_sequence"
        )
    ring = _Ring(group, 1.0 / math.sqrt(d) if scale is None else scale, block)
    segments = None
    if segment_ids is not None:
        if tuple(segment_ids.shape) != (b, s * group.size) or segment_ids.is_floating_point():
            raise UserError(
                f"ring attention: segment_ids must be integer [batch, global length] = "
                f"[{b}, {s * group.size}] (this rank's {s} tokens x cp {group.size}), got "
                f"{segment_ids.dtype} {tuple(segment_ids.shape)}"
            )
        chunks = segment_ids.detach().unflatten(1, (2 * group.size, s // 2))
        segments = _RingSegments(chunks, group)
    q = query.reshape(b, hkv, h // hkv, s, d)
    out = _RingAttention.apply(q, key, value, ring, segments)
    return out.reshape(b, h, s, -1)
