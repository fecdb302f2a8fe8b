"""Sharded generation with static shapes, replayed on XLA devices.

- Prompts are left-padded to a length bucket and the batch is padded to a batch bucket, so a
  request maps to one of a few graph shapes; the KV cache is a static cache whose length does
  not depend on the number of new tokens (rounded up to :data:`CACHE_ROUND`).
- The attention mask is built in the graph (transformers' own mask code reads the padding mask
  on the host); a sequence that ended (EOS) stays in the batch emitting padding: no shape
  changes when one stops.
- On an XLA device prefill and decode are :class:`~neuron_tp.infer.replay.ReplayedStep` s: the
  model's Python runs once per graph shape, then each token is one call of the cached
  executable (graphs: one prefill per (batch, length) bucket, one decode per batch bucket).
  Positions, the cache and the end flags advance inside the graph; the host uploads nothing
  per token but sampling noise.
- Greedy or sampling (Gumbel-max with noise drawn on the host from a seeded generator: the
  same draws ``torch.multinomial`` makes, identical on every tp rank, uploaded as data).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import StaticCache

from ..errors import UserError
from .model_step import (
    attention_mask_for,
    cache_kwargs,
    check_cache,
    no_aux_outputs,
    pick_bucket,
)
from .replay import StepGraphs, StepGraphsOwner
from .sampling import GREEDY, Sampling, choose, host_generator, host_noise

CACHE_ROUND = 128  # the cache holds max(buckets) + new tokens rounded up to this
EOS_SLOTS = 8  # EOS ids per call, padded with -1: any EOS list runs the same graphs


def cache_length(buckets: Sequence[int], max_new_tokens: int) -> int:
    return max(buckets) + -(-max_new_tokens // CACHE_ROUND) * CACHE_ROUND


def cache_too_long(buckets: Sequence[int], max_new_tokens: int, limit: int) -> str:
    """What to pass instead when the KV cache of ``buckets`` + ``max_new_tokens`` exceeds the
    model's ``max_position_embeddings`` ``limit``."""
    total, new = cache_length(buckets, max_new_tokens), cache_length([0], max_new_tokens)
    fixes = []
    if limit - max(buckets) >= CACHE_ROUND:
        fixes.append(f"--max-new-tokens {(limit - max(buckets)) // CACHE_ROUND * CACHE_ROUND}")
    if limit - new >= 1:
        fixes.append(f"--buckets with the largest at most {limit - new}")
    how = (
        " or ".join(fixes)
        if fixes
        else f"a model with more positions (the cache grows in steps of {CACHE_ROUND})"
    )
    return (
        f"the KV cache of {total} positions (largest bucket {max(buckets)} + --max-new-tokens "
        f"{max_new_tokens} rounded up to {CACHE_ROUND}) exceeds the model's "
        f"max_position_embeddings={limit}: pass {how}"
    )


def attention_mask_4d(pad_mask: torch.Tensor, cache_pos: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, queries, cache]`` boolean mask built in the graph from device tensors:
    causal over cache positions, padding excluded, every query sees itself (padding rows
    would otherwise be empty and produce NaN keys/values in later layers)."""
    kv = torch.arange(pad_mask.shape[-1], device=pad_mask.device)
    q = cache_pos[:, None]
    allowed = (kv[None, :] <= q) & pad_mask.bool()[:, None, :]  # [batch, q, cache]
    return (allowed | (kv[None, :] == q))[:, None]


class Generator(StepGraphsOwner):
    """Generation with one model on its device. Graphs are captured once per shape and
    reused by later calls: the model's weights must not change while the Generator is used.

    ``buckets``: prompt lengths; ``max_new_tokens``: the most a call may ask for (it sets
    the cache length); ``batch_buckets``: batch sizes (None: each call's own batch size);
    ``replay=False``: re-trace the model every token (torch-xla's plain lazy mode)."""

    def __init__(
        self,
        model,
        buckets: Sequence[int],
        max_new_tokens: int,
        *,
        batch_buckets: Sequence[int] | None = None,
        pad_id: int = 0,
        replay: bool = True,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive lengths, got {list(buckets)}")
        self.model, self.pad_id = model, pad_id
        self.buckets = sorted(buckets)
        self.batch_buckets = sorted(batch_buckets) if batch_buckets else None
        self.max_new_tokens = max_new_tokens
        self.total = cache_length(self.buckets, max_new_tokens)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and self.total > limit:
            raise UserError(cache_too_long(self.buckets, max_new_tokens, limit))
        self.device = next(model.parameters()).device
        check_cache(
            model.config,
            self.total,
            f"(largest bucket + max new tokens rounded up to {CACHE_ROUND}); use "
            "smaller --buckets / --max-new-tokens",
        )
        self._graphs = StepGraphs(self.device, replay)
        self._caches: dict[int, _CacheSlots] = {}  # batch -> the cache object the traces use

    def check(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, eos_ids: Sequence[int] = ()
    ) -> None:
        """ValueError naming what is wrong with a request (before any device work)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if not 1 <= max_new_tokens <= self.max_new_tokens:
            raise ValueError(
                f"max_new_tokens must be in 1..{self.max_new_tokens}, got {max_new_tokens}"
            )
        pick_bucket(max(len(p) for p in prompts), self.buckets)
        if len(eos_ids) > EOS_SLOTS:
            raise ValueError(f"at most {EOS_SLOTS} EOS ids, got {len(eos_ids)}")
        if self.batch_buckets:
            pick_bucket(len(prompts), self.batch_buckets, "batch")

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        eos_ids: Sequence[int] = (),
    ) -> list[list[int]]:
        """New token ids per prompt: ``max_new_tokens`` each, or up to and including the
        first EOS id."""
        out: list[list[int]] = [[] for _ in prompts]
        for column in self.stream(prompts, max_new_tokens, sampling, eos_ids):
            for seq, t in zip(out, column):
                if t is not None:
                    seq.append(t)
        return out

    def stream(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        eos_ids: Sequence[int] = (),
        stopped: Sequence[bool] | None = None,
    ) -> Iterator[list[int | None]]:
        """Yield, per step, each sequence's new token; None once it has ended (after its EOS,
        or from the step after the caller set ``stopped[i]``, e.g. on a stop string). Ends
        when every sequence has ended or after ``max_new_tokens`` steps."""
        self.check(prompts, max_new_tokens, eos_ids)
        n = len(prompts)
        batch = pick_bucket(n, self.batch_buckets, "batch") if self.batch_buckets else n
        bucket = pick_bucket(max(len(p) for p in prompts), self.buckets)
        rows = list(prompts) + [[self.pad_id]] * (batch - n)  # filler rows, never reported
        gen = host_generator(sampling)
        state = _start(self, rows, bucket, sampling, eos_ids)
        eos, ended = set(eos_ids), [False] * n
        vocab = self.model.config.vocab_size
        for step in range(max_new_tokens):
            noise = None
            if sampling.do_sample:  # [n, vocab] per step, as transformers draws them
                draw = host_noise(gen, n, vocab)
                noise = torch.cat([draw, torch.ones(batch - n, vocab)]).to(self.device)
            tokens = self._run(state, batch, bucket if step == 0 else None, sampling, noise)
            column: list[int | None] = []
            for i, t in enumerate(tokens[:n]):
                ended[i] = ended[i] or (stopped is not None and bool(stopped[i]))
                column.append(None if ended[i] else t)
                ended[i] = ended[i] or t in eos
            yield column
            if all(ended):
                return

    # -- graphs ------------------------------------------------------------------------------
    def _run(self, state: _CallState, batch: int, bucket: int | None, sampling, noise):
        """One step (the prefill when ``bucket`` is given): each row's new token."""
        prefill = bucket is not None
        key = (batch, bucket, sampling.top_k, noise is not None)
        outputs = self._graphs.run(
            key, lambda: self._step_fn(batch, prefill, *key[2:]), state.args(noise)
        )
        state.ids, state.pos, state.cache_pos, state.done, *state.cache = outputs
        return state.ids.cpu()[:, 0].tolist()  # one transfer, no slicing graph

    def _step_fn(self, batch: int, prefill: bool, top_k: int, sampled: bool):
        model, pad = self.model, self.pad_id

        def step(ids, pos, cache_pos, mask, done, eos, temperature, *rest):  # noqa: PLR0917
            noise, cache_values = (rest[0], rest[1:]) if sampled else (None, rest)
            slots = self._cache_slots(batch)
            cache = slots.fresh() if prefill else slots.install(cache_values)
            out = model(
                input_ids=ids,
                attention_mask=attention_mask_for(model, attention_mask_4d(mask, cache_pos)),
                position_ids=pos,
                cache_position=cache_pos,
                **cache_kwargs(model, cache),
                use_cache=True,
                logits_to_keep=1,
                **no_aux_outputs(model.config),
            )
            tok = choose(out.logits[:, -1], top_k, temperature, noise)
            tok = torch.where(done, torch.full_like(tok, pad), tok)
            done = done | (tok[:, None] == eos[None, :]).any(-1)
            # The next step's inputs, computed here: nothing is uploaded per token.
            return [tok[:, None], pos[:, -1:] + 1, cache_pos[-1:] + 1, done, *slots.values()]

        return step

    def _cache_slots(self, batch: int) -> _CacheSlots:
        if batch not in self._caches:
            self._caches[batch] = _CacheSlots(self.model.config, self.total)
        return self._caches[batch]


class _CacheSlots:
    """A transformers StaticCache whose tensors come in and go out as plain tensors (graph
    arguments and results), in a fixed order."""

    def __init__(self, config, total: int):
        self.config, self.total = config, total
        self.cache: StaticCache | None = None

    def fresh(self):
        from transformers import StaticCache

        self.cache = StaticCache(config=self.config, max_cache_len=self.total)
        return self.cache

    def values(self) -> list[torch.Tensor]:
        if self.cache is None:
            raise RuntimeError("decode traced before any prefill of this batch size")
        kinds = ("keys", "values", "cumulative_length")
        return [getattr(layer, k) for layer in self.cache.layers for k in kinds]

    def install(self, values):
        if self.cache is None:
            raise RuntimeError("decode traced before any prefill of this batch size")
        it = iter(values)
        for layer in self.cache.layers:
            layer.keys, layer.values, layer.cumulative_length = next(it), next(it), next(it)
        return self.cache


@dataclass
class _CallState:
    """The device tensors a call's next step reads, in the step function's argument order
    (:meth:`args`); each step's outputs replace ``ids`` to ``done`` and the cache."""

    ids: torch.Tensor
    pos: torch.Tensor
    cache_pos: torch.Tensor
    mask: torch.Tensor
    done: torch.Tensor
    eos: torch.Tensor
    temperature: torch.Tensor
    cache: list[torch.Tensor] = field(default_factory=list)  # none before the prefill

    def args(self, noise: torch.Tensor | None) -> list[torch.Tensor]:
        fixed = [self.ids, self.pos, self.cache_pos, self.mask, self.done, self.eos]
        return [*fixed, self.temperature, *([noise] if noise is not None else []), *self.cache]


def _start(g: Generator, rows, bucket: int, sampling: Sampling, eos_ids) -> _CallState:
    """The device tensors of a call's first step."""
    batch, dev = len(rows), g.device
    ids = torch.full((batch, bucket), g.pad_id, dtype=torch.long)
    mask = torch.ones((batch, g.total), dtype=torch.long)
    for i, p in enumerate(rows):
        ids[i, bucket - len(p) :] = torch.tensor(list(p))
        mask[i, : bucket - len(p)] = 0
    pos = (mask[:, :bucket].cumsum(-1) - 1).clamp(min=0)
    eos = torch.tensor(list(eos_ids) + [-1] * (EOS_SLOTS - len(eos_ids)), dtype=torch.long)
    temperature = torch.tensor([float(sampling.temperature)])  # not 0-d: 0-d is a constant
    return _CallState(
        ids=ids.to(dev),
        pos=pos.to(dev),
        cache_pos=torch.arange(bucket).to(dev),
        mask=mask.to(dev),
        done=torch.zeros(batch, dtype=torch.bool).to(dev),
        eos=eos.to(dev),
        temperature=temperature.to(dev),
    )


def generate(
    model,
    prompts: list[list[int]],
    max_new_tokens: int,
    buckets: list[int],
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    pad_id: int = 0,
    eos_ids: Sequence[int] = (),
    replay: bool = True,
) -> list[list[int]]:
    """New token ids for each prompt (``max_new_tokens`` each, or through the first EOS).

    ``model``: a transformers causal LM (sharded by ``neuron_tp.hf`` or not) on its device;
    every tp rank calls this with the same prompts and seed and gets the same tokens."""
    g = Generator(model, buckets, max_new_tokens, pad_id=pad_id, replay=replay)
    sampling = Sampling(do_sample, temperature, top_k, seed)
    return g.generate(prompts, max_new_tokens, sampling, eos_ids)
