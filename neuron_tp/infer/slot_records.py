"""The records of a :class:`~.slot_generator.SlotGenerator`: the per-slot device state its
graphs carry (:class:`SlotState`), the host values of a prefill chunk (:class:`ChunkMeta`), and
the small helpers of its shapes and results."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .sampling import TokenLogprob


class SlotState(NamedTuple):
    """The per-slot device tensors (one row per slot) every step reads and the last prompt
    chunk of a slot writes, in this order wherever they are graph arguments or results."""

    tokens: torch.Tensor  # the last token of each slot
    pos: torch.Tensor  # its cache index
    temperature: torch.Tensor
    top_k: torch.Tensor
    sample: torch.Tensor  # False: a greedy row
    params: torch.Tensor  # [slots, 5]: sampling.ROW_PARAMS (top_p, min_p, the penalties)
    counts: torch.Tensor  # [slots, vocab]: tokens generated so far
    seen: torch.Tensor  # [slots, vocab]: 1 at the prompt's tokens
    bias: torch.Tensor  # [slots, vocab]: the logit bias
    adapter: torch.Tensor  # the LoRA bank slot of each row's adapter (-1: the base model)


class ChunkMeta(NamedTuple):
    """The host values of one prefill chunk, uploaded as ONE int64 tensor (:meth:`tensor`):
    its slot, the position it starts at, how many of its tokens are real, whether it is the
    prompt's last (then a token is chosen and the slot's :class:`SlotState` row written),
    the row's ``top_k``, whether it samples, the prompt token after the chunk (the target
    of its last position's prompt log-probability) and the LoRA bank slot of the request's
    adapter (-1: the base model). In the graph :meth:`read` names the
    fields of the uploaded tensor, each a ``[1]`` tensor."""

    slot: int
    start: int
    length: int
    final: bool
    top_k: int
    sampled: bool
    next: int = 0
    adapter: int = -1

    def tensor(self) -> torch.Tensor:
        return torch.tensor([int(v) for v in self])

    @classmethod
    def read(cls, meta: torch.Tensor) -> ChunkMeta:
        return cls._make(meta[i : i + 1] for i in range(len(cls._fields)))


class DecodeVariant(NamedTuple):
    """What a decode graph computes beyond the model's step and the argmax: Gumbel-max draws
    (``sampled``: its noise is an argument), the rows' top_p (``nucleus``: a bisection over
    the vocabulary), the penalties, logit bias and grammar rows and the token counts they read
    (``adjust``: the packed grammar rows are an argument), the log-probabilities
    (``logprobs``)."""

    sampled: bool = False
    nucleus: bool = False
    adjust: bool = False
    logprobs: bool = False

    def covers(self, needs: DecodeVariant) -> bool:
        return all(have or not need for have, need in zip(self, needs))


# The fixed set of decode graphs (per decode bucket), cheapest first: a step runs the first
# that covers what its rows need; the nucleus one exists only with ``top_p`` graphs.
DECODE_VARIANTS = (
    DecodeVariant(),
    DecodeVariant(logprobs=True),
    DecodeVariant(adjust=True, logprobs=True),
    DecodeVariant(sampled=True, adjust=True, logprobs=True),
    DecodeVariant(sampled=True, nucleus=True, adjust=True, logprobs=True),
)


def decode_variant(needs: DecodeVariant) -> DecodeVariant:
    """The cheapest of :data:`DECODE_VARIANTS` that computes what ``needs`` asks for."""
    return next(v for v in DECODE_VARIANTS if v.covers(needs))


def check_chunk(n: int, start: int, *, filled: int, chunk: int, max_len: int) -> None:
    """ValueError unless a prefill chunk of ``n`` tokens at ``start`` fits: at most ``chunk``
    tokens, no gap after the ``filled`` positions of its slot, within ``max_len``."""
    if not 1 <= n <= chunk or not 0 <= start <= filled:
        raise ValueError(
            f"a chunk of 1..{chunk} tokens starting at most at {filled} "
            f"(the positions the slot holds: no gap), got {n} tokens at {start}"
        )
    if start + n > max_len:
        raise ValueError(f"{n} tokens at {start} exceed the {max_len} positions")


def packed_rows(masks: dict[int, torch.Tensor], slots: int, words: int) -> torch.Tensor:
    """``[slots, words]`` int32: the packed grammar row of each slot in ``masks``, every token
    allowed in the others."""
    out = torch.full((slots, words), -1, dtype=torch.int32)
    for s, row in masks.items():
        out[s] = row
    return out


def default_prefill_buckets(chunk: int) -> list[int]:
    """Powers of 2 from 16 up to ``chunk`` (and ``chunk`` itself)."""
    out, b = [], 16
    while b < chunk:
        out.append(b)
        b *= 2
    return out + [chunk]


def variants_of(variants: Sequence[bool], prompt_lp: bool) -> list[tuple[bool, bool]]:
    """The prefill graphs ``(sampled, prompt log-probabilities)`` of the ``variants`` asked
    for: with ``prompt_lp`` and both greedy and sampled, also the prompt log-probability one."""
    out = [(v, False) for v in variants]
    return out + [(True, True)] if prompt_lp and set(variants) == {False, True} else out


def read_logprobs(out, tokens: Sequence[int], rows: Sequence[int] | None = None):
    """The :class:`TokenLogprob` of ``tokens`` from a step's packed log-probabilities (a
    device tensor of :func:`~.sampling.token_logprobs`), at ``rows`` (None: the first
    ``len(tokens)``); one transfer."""
    from .sampling import unpack_logprobs

    lp, top_lp, top_ids = unpack_logprobs(out.cpu())
    rows = list(rows) if rows is not None else list(range(len(tokens)))
    lp, top_lp, top_ids = lp[rows].tolist(), top_lp[rows].tolist(), top_ids[rows].tolist()
    return [TokenLogprob(t, lp[i], tuple(zip(top_ids[i], top_lp[i]))) for i, t in enumerate(tokens)]


def seq_split(model, mode: str, max_len: int):
    """The :class:`~.kv_split.SeqSplit` of ``model`` for ``--kv-split mode`` (None: the cache
    is split by heads), attached to its attention modules."""
    from ..parallel.state import state_of
    from . import kv_split

    state = state_of(model)
    tp = 1 if state is None else state.mesh.tp_size
    if state is None or kv_split.resolve(mode, model.config, tp) == "heads":
        return None
    split = kv_split.make_split(model, state.mesh, max_len)
    kv_split.attach(model, split)
    return split
