"""How the next token is chosen, for the static generator, the slot generator and the server's
request parsing alike: the :class:`Sampling` parameters and their ranges, the host noise and the
on-device pick.

Sampling is Gumbel-max: ``argmax(softmax(logits / T) / noise)`` over the top k with
``noise ~ Exp(1)`` is a draw from that distribution. The noise is drawn on the host from a
generator seeded per request (the same draws ``torch.multinomial`` makes, identical on every tp
rank) and uploaded as data, so a seeded request reproduces its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_SEED = 2**63 - 1
MAX_TOP_K = 128  # the largest per-row top_k of choose_rows (a fixed-size topk in the graph)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy, or sampled at ``temperature`` from the top ``k``
    (0: all) with a seeded host generator."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no filter), got {self.top_k}")


GREEDY = Sampling()


def seed_in_range(seed: int) -> bool:
    """Whether ``seed`` is in ``0..MAX_SEED`` (``2**63 - 1``), the one seed range of every
    path. ``torch.Generator.manual_seed`` would take up to ``2**64 - 1``, but a request's seed
    is an OpenAI ``int64``, the engine draws unseeded requests' seeds with 63 random bits, and
    a seed beyond ``int64`` fits no integer tensor: ``0..2**63 - 1`` is valid everywhere a
    seed goes."""
    return 0 <= seed <= MAX_SEED


def check_per_row(sampling: Sampling) -> None:
    """ValueError unless ``sampling`` can run as one row of :func:`choose_rows`: ``top_k`` at
    most :data:`MAX_TOP_K` (when sampled) and the seed in range."""
    if sampling.do_sample and sampling.top_k > MAX_TOP_K:
        raise ValueError(f"top_k must be in 0..{MAX_TOP_K} (0 = no filter), got {sampling.top_k}")
    if not seed_in_range(sampling.seed):
        raise ValueError(f"seed must be in 0..2**63-1, got {sampling.seed}")


def host_generator(sampling: Sampling) -> torch.Generator:
    """The request's own noise generator (not the global RNG: threads share it)."""
    return torch.Generator().manual_seed(sampling.seed)


def host_noise(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` Exp(1) noise: the draws ``torch.multinomial`` makes for ``rows``
    sequences."""
    return torch.empty((rows, vocab)).exponential_(generator=gen)


def choose(logits: torch.Tensor, top_k: int, temperature, noise) -> torch.Tensor:
    """Greedy (``noise`` None) or ``argmax(softmax(logits / T) / noise)`` over the top k: a
    draw from that distribution when ``noise ~ Exp(1)``."""
    if noise is None:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return (logits.softmax(-1) / noise).argmax(-1)


def row_probs(logits, temperature, top_k) -> torch.Tensor:
    """``softmax(logits / T)`` of each row over its top ``k`` (0: all, at most
    :data:`MAX_TOP_K`): the distribution a sampled row of :func:`choose_rows` draws from;
    ``temperature`` [B], ``top_k`` [B] (data)."""
    logits = logits.float() / temperature[:, None]
    k = min(MAX_TOP_K, logits.shape[-1])
    top = logits.topk(k, -1).values
    kth = top.gather(-1, (top_k.clamp(1, k) - 1)[:, None])
    kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, float("-inf")))
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


def choose_rows(logits, temperature, top_k, sample, noise) -> torch.Tensor:
    """:func:`choose` with per-row parameters as data: ``temperature`` [B], ``top_k`` [B]
    (0: no filter, at most :data:`MAX_TOP_K`), ``sample`` [B] (False: greedy row); ``noise``
    None: every row greedy."""
    greedy = logits.argmax(-1)
    if noise is None:
        return greedy
    return torch.where(sample, (row_probs(logits, temperature, top_k) / noise).argmax(-1), greedy)
