"""How the next token is chosen, for the static generator, the slot generator and the server's
request parsing alike: the :class:`Sampling` parameters and their ranges, the host noise and the
on-device pick.

Sampling is Gumbel-max: ``argmax(softmax(logits / T) / noise)`` over the top k with
``noise ~ Exp(1)`` is a draw from that distribution. The noise is drawn on the host from a
generator seeded per request (the same draws ``torch.multinomial`` makes, identical on every tp
rank) and uploaded as data, so a seeded request reproduces its tokens.

The slot generator's rows take every parameter as data (:func:`adjust_rows`,
:func:`filter_rows`, in this order): ``logit_bias`` is added, then vLLM's
``repetition_penalty`` (a logit of a token seen in the prompt or the output so far divided by
it when positive, multiplied when not), then OpenAI's penalties
(``logit -= frequency * count + presence * (count > 0)`` over the tokens generated so far):
greedy rows take the argmax of the adjusted logits. Sampled rows divide by the temperature,
keep the top ``k``, then the smallest set of most likely tokens whose probability reaches
``top_p``, then the tokens at least ``min_p`` times as likely as the most likely one, and draw
from what is left (renormalised). Log-probabilities (:func:`token_logprobs`) are the model's
own, ``log_softmax`` of the raw logits, before any of these adjustments (what vLLM reports).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import torch

MAX_SEED = 2**63 - 1
MAX_TOP_K = 128  # the largest per-row top_k of choose_rows (a fixed-size topk in the graph)
MAX_LOGPROBS = 20  # the most top log-probabilities a row reports (a fixed-size topk)
ROW_PARAMS = ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: greedy, or sampled at ``temperature`` from the top ``k``
    (0: all), ``top_p`` and ``min_p`` with a seeded host generator; the penalties and
    ``logit_bias`` (``((token, bias), ...)``) change greedy and sampled rows alike (see the
    module doc)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    seed: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no filter), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in 0..1, got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        object.__setattr__(self, "logit_bias", bias)

    @property
    def adjusts(self) -> bool:
        """Whether a penalty or a logit bias changes the logits (also for greedy rows)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
            or self.logit_bias
        )

    @property
    def filters(self) -> bool:
        """Whether ``top_p`` or ``min_p`` restricts a sampled row."""
        return self.do_sample and (self.top_p < 1 or self.min_p > 0)

    def row_params(self) -> list[float]:
        """The :data:`ROW_PARAMS` values, in order (one row of the generator's state)."""
        return [float(getattr(self, n)) for n in ROW_PARAMS]


GREEDY = Sampling()


class TokenLogprob(NamedTuple):
    """A token and the model's log-probability of it, with the most likely tokens at its
    position (``((token, logprob), ...)``, most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


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


def check_vocab(sampling: Sampling, vocab: int) -> None:
    """ValueError unless every ``logit_bias`` token is an id of a ``vocab``-token model."""
    for t, _ in sampling.logit_bias:
        if not 0 <= t < vocab:
            raise ValueError(f"logit_bias: {t} is not a token id of this model (0..{vocab - 1})")


def bias_row(sampling: Sampling, vocab: int) -> torch.Tensor:
    """``[vocab]`` float: the request's ``logit_bias`` as a dense row."""
    row = torch.zeros(vocab)
    for t, b in sampling.logit_bias:
        row[t] = b
    return row


def seen_row(prompt: Sequence[int], vocab: int) -> torch.Tensor:
    """``[vocab]`` float: 1 at every token of ``prompt`` (the repetition penalty's prompt
    tokens)."""
    row = torch.zeros(vocab)
    if prompt:
        row[torch.tensor(list(prompt), dtype=torch.long)] = 1.0
    return row


def host_generator(sampling: Sampling) -> torch.Generator:
    """The request's own noise generator (not the global RNG: threads share it)."""
    return torch.Generator().manual_seed(sampling.seed)


def host_noise(gen: torch.Generator, rows: int, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` Exp(1) noise: the draws ``torch.multinomial`` makes for ``rows``
    sequences."""
    return torch.empty((rows, vocab)).exponential_(generator=gen)


class NoiseRows:
    """The ``[rows, vocab]`` noise of the decode steps' sampled rows, each row drawn from its
    slot's own generator (ones for the other rows): :meth:`prefetch` draws the next step's rows
    on a worker thread while the device runs this step, :meth:`take` returns them (drawing
    here the rows of slots whose generator is new since), so every generator gives the same
    draws in the same order as without the thread."""

    def __init__(self, rows: int, vocab: int):
        self.rows, self.vocab = rows, vocab
        self._pool: ThreadPoolExecutor | None = None
        self._next: Future | None = None

    def _draw(self, gens: Mapping[int, torch.Generator]):
        noise = torch.ones(self.rows, self.vocab)
        for s, gen in gens.items():
            noise[s] = host_noise(gen, 1, self.vocab)[0]
        return noise, gens

    def prefetch(self, gens: Mapping[int, torch.Generator]) -> None:
        """Start drawing the next step's rows of ``gens`` (``{slot: generator}``)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="noise")
        self._next = self._pool.submit(self._draw, dict(gens))

    def take(self, gens: Mapping[int, torch.Generator], bucket: int) -> torch.Tensor:
        """``[bucket, vocab]``: the rows of ``gens`` for this step."""
        if self._next is None:
            return self._draw(gens)[0][:bucket]
        noise, drawn = self._next.result()
        self._next = None
        for s in drawn.keys() - gens.keys():
            noise[s] = 1.0
        for s, gen in gens.items():
            if drawn.get(s) is not gen:
                noise[s] = host_noise(gen, 1, self.vocab)[0]
        return noise[:bucket]


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


def adjust_rows(logits, params, counts, seen, bias) -> torch.Tensor:
    """The logits of each row after its ``logit_bias``, repetition penalty and OpenAI's
    presence / frequency penalties (see the module doc), fp32: ``params`` [B, P] (columns
    :data:`ROW_PARAMS`), ``counts`` [B, V] (tokens generated so far), ``seen`` [B, V] (1: in
    the prompt), ``bias`` [B, V]. With the neutral values it returns the logits unchanged."""
    presence, frequency, repetition = params[:, 2:3], params[:, 3:4], params[:, 4:5]
    logits = logits.float() + bias
    anywhere = (seen > 0) | (counts > 0)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(anywhere, penalized, logits)
    return logits - frequency * counts - presence * (counts > 0).float()


def filter_rows(logits, temperature, top_k, params, nucleus: bool = True) -> torch.Tensor:
    """What a sampled row draws from, up to its normalisation: :func:`row_probs`
    (temperature, top k) restricted to its ``top_p`` nucleus (the most likely tokens until
    their mass reaches ``top_p``; 1: all) and to the tokens with at least ``min_p`` times the
    largest probability. ``params`` [B, P] (columns :data:`ROW_PARAMS`); ``nucleus`` False:
    no row has a top_p below 1 (the sort it needs is left out)."""
    probs = row_probs(logits, temperature, top_k)
    top_p, min_p = params[:, 0:1], params[:, 1:2]
    keep = probs >= min_p * probs.max(-1, keepdim=True).values
    if nucleus:
        keep = keep & ((probs > nucleus_floor(probs, top_p)) | (top_p >= 1))
    return probs * keep


NUCLEUS_STEPS = 32  # bisection steps of nucleus_floor


def nucleus_floor(probs, top_p) -> torch.Tensor:
    """``[B, 1]``: a probability below which no token of a row's top_p nucleus lies and above
    which only its tokens do (to the bisection's resolution, ``max p / 2**32``): the nucleus is
    the tokens whose more likely tokens weigh less than ``top_p``, i.e. ``p > floor``. Found by
    bisection on the mass of the tokens above a threshold, without sorting the vocabulary."""
    low = torch.zeros_like(probs[:, :1])  # the mass above it is >= top_p
    high = probs.max(-1, keepdim=True).values  # the mass above it is 0 < top_p
    for _ in range(NUCLEUS_STEPS):
        mid = (low + high) / 2
        above = (probs * (probs > mid)).sum(-1, keepdim=True)
        reached = above >= top_p
        low, high = torch.where(reached, mid, low), torch.where(reached, high, mid)
    return low


def choose_adjusted(logits, state_rows, sample, noise, nucleus: bool = True) -> torch.Tensor:
    """The token of each row: the argmax of its adjusted logits (:func:`adjust_rows`), or for
    a ``sample`` row a draw from :func:`filter_rows` of them with ``noise`` (None: every row
    greedy; ``nucleus`` False: no row's top_p below 1). ``state_rows``: ``(temperature,
    top_k, params, counts, seen, bias)``."""
    temperature, top_k, params, counts, seen, bias = state_rows
    adjusted = adjust_rows(logits, params, counts, seen, bias)
    greedy = adjusted.argmax(-1)
    if noise is None:
        return greedy
    drawn = (filter_rows(adjusted, temperature, top_k, params, nucleus) / noise).argmax(-1)
    return torch.where(sample, drawn, greedy)


WORD_BITS = 32  # tokens per int32 word of a packed grammar row (bit j of word w: token 32 w + j)


def allowed_words(vocab: int) -> int:
    """The int32 words of a packed ``[vocab]`` row of allowed tokens."""
    return -(-vocab // WORD_BITS)


def unpack_allowed(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., vocab]`` float: 0 where ``words`` (``[..., allowed_words(vocab)]`` int32, bit
    ``j`` of word ``w`` for token ``32 w + j``) has the token's bit set, ``-inf`` elsewhere:
    the additive row of a grammar, unpacked where it is used (on the device)."""
    # bit j is the sign bit after a left shift by 31 - j (a right shift then ``& 1`` comes
    # out wrong from torch-xla 2.9 on XLA CPU devices)
    shifts = WORD_BITS - 1 - torch.arange(WORD_BITS, dtype=torch.int32, device=words.device)
    bits = (words.to(torch.int32)[..., None] << shifts) < 0
    bits = bits.reshape(*words.shape[:-1], words.shape[-1] * WORD_BITS)[..., :vocab]
    zero = torch.zeros((), device=words.device)
    return torch.where(bits, zero, torch.full_like(zero, float("-inf")))


def token_logprobs(logits, chosen, k: int = MAX_LOGPROBS):
    """The model's own log-probabilities (``log_softmax`` of the raw logits, fp32) of
    ``chosen`` [...] and of the ``k`` most likely tokens, packed in ONE fp32 tensor (one
    transfer to the host): ``[..., 1 + 2k]`` = the chosen token's, the top k's, the top k's
    ids (exact in fp32 below 2**24 tokens). :func:`unpack_logprobs` reads it."""
    lp = logits.float().log_softmax(-1)
    top = lp.topk(min(k, lp.shape[-1]), -1)
    chosen_lp = lp.gather(-1, chosen[..., None])
    return torch.cat([chosen_lp, top.values, top.indices.float()], -1)


def unpack_logprobs(packed: torch.Tensor):
    """``(logprob [...], top logprobs [..., k], top ids [..., k])`` of a
    :func:`token_logprobs` tensor."""
    k = (packed.shape[-1] - 1) // 2
    return packed[..., 0], packed[..., 1 : 1 + k], packed[..., 1 + k :].long()
