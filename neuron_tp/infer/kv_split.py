"""The slot KV cache split over tp ranks by SEQUENCE (flash-decoding style).

When a model has fewer key/value heads than tp, tensor parallelism replicates each kv head on
the ``r = tp / kv`` ranks whose query heads read it (:func:`~neuron_tp.hf.attention.kv_slots`),
so with the plain layout every one of them holds the whole cache of that head. Split by
sequence, the ``r`` ranks sharing a kv head (a :class:`SeqSplit` group) each hold ``1/r`` of
the positions instead:

- position ``p`` lives on group rank ``p % r`` at local index ``p // r`` (round robin: a
  prefill chunk spreads over every rank, shapes stay static); each rank's cache is
  ``[slots, local kv heads, ceil(max_len / r) + 1, head dim]``, its last index a scratch row
  that the positions other ranks own, chunk padding and inactive rows write to;
- attention (:func:`split_attention`, registered in transformers as :data:`NAME` and switched
  on only while a slot step is traced, :func:`tracing`): the queries of the group are
  all-gathered (every rank needs the queries of the heads it holds positions for), each rank
  computes its partial softmax over its own positions, (out, log-sum-exp) per query, and an
  all-to-all brings each rank the partials of its own heads, which it combines by their
  log-sum-exps (shifted by the largest): exact up to fp32 rounding.

The graphs stay one set for every rank: which positions a rank owns enters them as its group
rank tensor (device data). Imports transformers lazily.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..errors import UserError
from ..hf.attention import kv_slots, model_heads
from ..parallel import comm
from ..parallel.mesh import Group, Mesh

NAME = "ntp-kv-split"
MODES = ("auto", "heads", "sequence")


@dataclass(frozen=True)
class SeqSplit:
    """This rank's part of a sequence-split cache: ``group`` holds the ranks sharing its kv
    heads (``r = group.size`` of them); a slot holds ``max_len`` positions."""

    group: Group
    max_len: int

    @property
    def r(self) -> int:
        return self.group.size

    @property
    def local_len(self) -> int:
        """Positions per rank (``ceil(max_len / r)``); the cache has one more (scratch)."""
        return -(-self.max_len // self.r)

    def rank(self, device) -> torch.Tensor:
        return self.group.rank_tensor(device)

    def local_index(self, positions: torch.Tensor) -> torch.Tensor:
        """The local cache index each global position is written at: its own row on the rank
        owning it, the scratch row elsewhere (and for the global scratch ``max_len``)."""
        mine = (positions % self.r == self.rank(positions.device)) & (positions < self.max_len)
        return torch.where(mine, positions // self.r, torch.full_like(positions, self.local_len))

    def visible(self, positions: torch.Tensor) -> torch.Tensor:
        """``[B, 1, Q, local_len + 1]``: a query at global position ``p`` sees this rank's
        keys at global positions ``<= p`` (never the scratch row)."""
        j = torch.arange(self.local_len, device=positions.device)
        held = j * self.r + self.rank(positions.device)  # global position of each local row
        seen = (held[None, None, :] <= positions[:, :, None]) & (held < self.max_len)
        return torch.cat([seen, torch.zeros_like(seen[..., :1])], -1)[:, None]


def kv_replication(config, tp: int) -> int:
    """How many tp ranks hold each kv head with the plain (by-heads) layout: 1 when tp divides
    the kv heads, else ``tp / kv`` (the ranks sharing a head are consecutive)."""
    heads = model_heads(config.get_text_config(decoder=True))
    if heads is None or tp == 1:
        return 1
    slots = kv_slots(heads, tp)
    return sum(1 for s in slots if s == slots[0])


def resolve(mode: str, config, tp: int) -> str:
    """``heads`` or ``sequence`` for ``--kv-split mode``: ``auto`` is ``sequence`` when kv heads
    would be replicated (fewer than tp); an explicit ``sequence`` where no kv head is
    replicated is a UserError."""
    check_mode(mode)
    r = kv_replication(config, tp)
    if mode == "auto":
        return "sequence" if r > 1 else "heads"
    if mode == "sequence" and r == 1:
        raise UserError(
            f"--kv-split sequence splits kv heads that tp replicates, but tp={tp} divides the "
            "model's kv heads (nothing is replicated); use --kv-split heads or auto"
        )
    return mode


def check_mode(mode: str) -> None:
    """UserError for an unknown ``--kv-split`` mode; needs no model."""
    if mode not in MODES:
        raise UserError(f"--kv-split must be one of {', '.join(MODES)}, got {mode!r}")


def split_group(mesh: Mesh, r: int) -> Group:
    """The ranks of this rank's tp group that share its kv heads: consecutive blocks of ``r``
    (every rank calls this, in the same order: gloo process groups are created here)."""
    tp = mesh.tp
    if r == tp.size:
        return tp
    blocks = [tuple(g[i : i + r]) for g in tp.all_groups for i in range(0, len(g), r)]
    mine = next(b for b in blocks if mesh.rank in b)
    pg = None
    if tp.process_group is not None:
        import torch.distributed as dist

        for b in blocks:  # every rank creates every group
            made = dist.new_group(list(b))
            pg = made if b == mine else pg
    return Group(
        name="kv-split",
        ranks=mine,
        all_groups=tuple(blocks),
        rank=mine.index(mesh.rank),
        virtual=tp.virtual,
        process_group=pg,
        reduce_dtype=tp.reduce_dtype,
    )


def make_split(model, mesh: Mesh, max_len: int) -> SeqSplit:
    """The :class:`SeqSplit` of ``model`` (parallelized on ``mesh``) for slots of ``max_len``
    positions; UserError when tp replicates none of its kv heads."""
    r = kv_replication(model.config, mesh.tp_size)
    if r == 1:
        raise UserError(
            f"a sequence-split KV cache needs kv heads replicated over tp; tp={mesh.tp_size} "
            "divides the model's kv heads: use the by-heads cache (--kv-split heads)"
        )
    return SeqSplit(split_group(mesh, r), max_len)


def combine(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Softmax outputs over disjoint key sets (dim 0) merged by their log-sum-exps ``lse``
    (``[..., 1]``; ``-inf``: no key seen), shifted by the largest so nothing overflows."""
    top = lse.amax(0)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    w = torch.exp(lse - top)
    return (w * out).sum(0) / w.sum(0).clamp(min=torch.finfo(w.dtype).tiny)


def partial_attention(q, k, v, allowed, *, scale: float):
    """fp32 softmax attention of ``q`` [r, B, hkv, g, Q, D] (the queries of ``r`` ranks) over
    the keys ``k``/``v`` [B, hkv, L, D] that ``allowed`` (bool ``[B, 1, Q, L]``) admits: the
    output [r, B, hkv, g, Q, Dv] and the log-sum-exp [r, B, hkv, g, Q, 1] of each query
    (``-inf`` and 0 when it sees none). Two matmuls over ``[B, hkv, r*g*Q, .]``."""
    r, b, h, g, nq, d = q.shape
    rows = q.float().permute(1, 2, 0, 3, 4, 5).reshape(b, h, r * g * nq, d)
    s = torch.matmul(rows, k.float().transpose(-1, -2)).view(b, h, r, g, nq, -1) * scale
    s = s.masked_fill_(~allowed.view(b, 1, 1, 1, nq, -1), float("-inf"))
    top = s.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    p = s.sub_(top).exp_()
    total = p.sum(-1, keepdim=True)
    out = torch.matmul(p.view(b, h, r * g * nq, -1), v.float()).view(b, h, r, g, nq, -1)
    out = out / total.clamp(min=torch.finfo(out.dtype).tiny)
    lse = top + torch.log(total)
    return out.permute(2, 0, 1, 3, 4, 5), lse.permute(2, 0, 1, 3, 4, 5)


def split_attention(query, key, value, allowed, *, group: Group, scale: float) -> torch.Tensor:
    """Attention of this rank's ``query`` [B, H, Q, D] over the keys of every rank of
    ``group``, each holding its own positions in ``key``/``value`` [B, hkv, L, D] and
    ``allowed`` ``[B, 1, Q, L]`` (bool); returns [B, H, Q, Dv] in the query's dtype. Every
    rank of ``group`` must call it."""
    b, h, nq, d = query.shape
    hkv, dv = key.shape[1], value.shape[-1]
    q = query.reshape(b, hkv, h // hkv, nq, d)
    qs = comm.all_gather(q.unsqueeze(0).contiguous(), group, 0)  # [r, B, hkv, g, Q, D]
    out, lse = partial_attention(qs, key, value, allowed, scale=scale)
    parts = comm.all_to_all(torch.cat([out, lse], -1), group, 0, 0)  # mine, from each rank
    merged = combine(parts[..., :dv], parts[..., dv:])
    return merged.reshape(b, h, nq, dv).to(query.dtype)


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):  # noqa: PLR0917 (transformers' attention-function signature)
    where = type(module).__name__
    split = getattr(module, "kv_split", None)
    if not isinstance(split, SeqSplit):
        raise UserError(f"{where}: the sequence-split attention runs only in slot steps")
    for name in ("softcap", "s_aux"):
        if kw.get(name) is not None:
            raise UserError(
                f"{where}: {name} is not supported with a sequence-split KV cache; use "
                "--kv-split heads"
            )
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise UserError(f"{where}: the sequence-split attention needs the slot step's bool mask")
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    out = split_attention(query, key, value, attention_mask, group=split.group, scale=scale)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register :func:`split_attention` in transformers (its mask function sdpa's: the slot
    step passes its own 4-D mask, used as it is); returns :data:`NAME`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME


def attach(model, split: SeqSplit) -> None:
    """Give every attention module of ``model`` (those with a ``layer_idx`` and a config)
    the split it attends over."""
    for module in model.modules():
        if isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "config"):
            module.kv_split = split


@contextlib.contextmanager
def tracing(model):
    """While tracing a slot step: the model's attention (every config that names one) is the
    sequence-split attention; restored afterwards."""
    name = register()
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    old = {key: c._attn_implementation for key, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = name
        yield
    finally:
        for key, c in configs.items():
            c._attn_implementation = old[key]
