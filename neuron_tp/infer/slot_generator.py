"""Generation for continuous batching: ``slots`` rows of ONE static KV cache, each row its own
sequence with its own position, sampling parameters and host RNG.

- A request takes a free slot (:meth:`SlotGenerator.acquire`), is prefilled chunk by chunk
  (:meth:`~SlotGenerator.prefill`, at most ``chunk`` tokens per call, so a long prompt does not
  stall the others for longer than one chunk), then advances one token per
  :meth:`~SlotGenerator.decode` together with every other active slot, until the caller
  :meth:`~SlotGenerator.release` s it (EOS, stop, max tokens and cancellation are the caller's).
- Positions are cache indices: a slot's prompt sits at ``0..len-1``, the attention mask is built
  in the graph from each row's position (``kv <= pos``), so what a freed slot's previous request
  left in the cache is never visible to the next one. Chunk padding and inactive rows write at a
  scratch index (``max_len``) no live query sees.
- Slot index, start, chunk length, positions, active flags and sampling parameters are data,
  never shapes: graphs = prefill buckets x {greedy, sampled} + decode buckets x {greedy,
  sampled}, whatever the arrival pattern; :meth:`~SlotGenerator.warmup` captures them all.
- Sampling per row: temperature, top_k (<= :data:`~.static_generator.MAX_TOP_K`), seed; Gumbel-max
  noise drawn on the host from each slot's own generator (the draws transformers makes for that
  request alone), so a seeded request reproduces its tokens whatever runs beside it.
- Per token the host uploads nothing for greedy steps (positions and last tokens advance in
  the decode graph), the noise rows for sampled ones, the active flags after a change; it reads
  back one small tensor of tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import UserError
from .replay import ReplayedStep
from .static_generator import (
    MAX_TOP_K,
    Sampling,
    check_cache,
    choose_rows,
    no_aux_outputs,
    pick_bucket,
)

SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below this


def _check_sampling(sampling: Sampling) -> None:
    if sampling.do_sample and sampling.top_k > MAX_TOP_K:
        raise ValueError(f"top_k must be in 0..{MAX_TOP_K} (0 = no filter), got {sampling.top_k}")
    if not 0 <= sampling.seed < SEED_LIMIT:
        raise ValueError(f"seed must be in 0..2**64-1, got {sampling.seed}")


def default_prefill_buckets(chunk: int) -> list[int]:
    """Powers of 2 from 16 up to ``chunk`` (and ``chunk`` itself)."""
    out, b = [], 16
    while b < chunk:
        out.append(b)
        b *= 2
    return out + [chunk]


class SlotGenerator:
    """Continuous-batching generation with one model on its device (see the module doc).

    ``max_len``: positions per slot (prompt + new tokens must fit); ``chunk``: the most prompt
    tokens one :meth:`prefill` call takes; ``prefill_buckets``: chunk lengths graphs exist for;
    ``decode_buckets``: slot counts decode graphs exist for (bucket ``b`` runs slots ``[0, b)``);
    ``replay=False``: re-trace every step (torch-xla's plain lazy mode). The model's weights
    must not change while the SlotGenerator is used."""

    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        chunk: int = 256,
        prefill_buckets: Sequence[int] | None = None,
        decode_buckets: Sequence[int] | None = None,
        pad_id: int = 0,
        replay: bool = True,
    ):
        if slots < 1 or max_len < 2 or chunk < 1:
            raise UserError(
                f"slots >= 1, max_len >= 2 and chunk >= 1 needed, got slots={slots}, "
                f"max_len={max_len}, chunk={chunk}"
            )
        self.prefill_buckets = sorted(set(prefill_buckets or default_prefill_buckets(chunk)))
        if self.prefill_buckets[0] < 1 or self.prefill_buckets[-1] > chunk:
            raise UserError(
                f"prefill buckets must be in 1..chunk={chunk}, got {self.prefill_buckets}"
            )
        self.decode_buckets = sorted(set(decode_buckets or [slots]))
        if self.decode_buckets[0] < 1 or self.decode_buckets[-1] != slots:
            raise UserError(
                f"decode buckets must be in 1..slots with the largest = slots={slots}, got "
                f"{self.decode_buckets}"
            )
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and max_len > limit:
            raise UserError(
                f"max_len={max_len} exceeds the model's max_position_embeddings={limit}"
            )
        check_cache(model.config, max_len + 1, "(max_len + 1 scratch); use a smaller max_len")
        from .slot_cache import allocate

        self.model, self.slots, self.max_len, self.chunk = model, slots, max_len, chunk
        self.pad_id, self.vocab = pad_id, model.config.get_text_config(decoder=True).vocab_size
        self.device = next(model.parameters()).device
        self.replay = replay and self.device.type == "xla"
        self._kv = allocate(model, slots, max_len, self.device)
        dev = self.device
        self._tokens = torch.zeros(slots, dtype=torch.long).to(dev)  # last token per slot
        self._pos = torch.zeros(slots, dtype=torch.long).to(dev)  # its cache index
        self._temperature = torch.ones(slots).to(dev)
        self._top_k = torch.zeros(slots, dtype=torch.long).to(dev)
        self._sample = torch.zeros(slots, dtype=torch.bool).to(dev)
        self._active_dev = torch.zeros(slots, dtype=torch.bool).to(dev)
        self._active_dirty = False
        self.in_use: set[int] = set()  # acquired slots (prefilling or decoding)
        self.active: set[int] = set()  # slots that decode
        self._filled: dict[int, int] = {}  # prompt positions written so far, per acquired slot
        self._host_pos: dict[int, int] = {}  # next cache index of each active slot
        self._gens: dict[int, torch.Generator] = {}  # sampled active slots
        self._steps: dict[tuple, ReplayedStep] = {}

    @property
    def traces(self) -> int:
        """How many times the model's Python ran to capture a graph (replay mode)."""
        return sum(s.traces for s in self._steps.values())

    # -- requests --------------------------------------------------------------------------
    def check(self, prompt_len: int, max_new_tokens: int, sampling: Sampling) -> None:
        """ValueError naming the limit a request exceeds (before any device work)."""
        if prompt_len < 1:
            raise ValueError("the prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prompt_len + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens + max_new_tokens {max_new_tokens} exceeds "
                f"the {self.max_len} positions of a slot (max_len)"
            )
        _check_sampling(sampling)

    def acquire(self) -> int | None:
        """The lowest free slot, now in use (None: every slot is in use)."""
        for s in range(self.slots):
            if s not in self.in_use:
                self.in_use.add(s)
                self._filled[s] = 0
                return s
        return None

    def release(self, slot: int) -> None:
        """Free ``slot`` at once: it no longer decodes and may be acquired again."""
        self.in_use.discard(slot)
        if slot in self.active:
            self.active.discard(slot)
            self._active_dirty = True
        self._host_pos.pop(slot, None)
        self._filled.pop(slot, None)
        self._gens.pop(slot, None)

    def prefill(
        self, slot: int, tokens: Sequence[int], start: int, sampling: Sampling | None = None
    ) -> int | None:
        """Write one chunk of ``slot``'s prompt at positions ``start..start+len-1``. With
        ``sampling`` (the LAST chunk): choose and return the first new token; the slot then
        decodes from ``start+len``. Without: more chunks follow; returns None."""
        n = len(tokens)
        if slot not in self.in_use or slot in self.active:
            raise ValueError(f"slot {slot} must be acquired and not decoding to be prefilled")
        if not 1 <= n <= self.chunk or not 0 <= start <= self._filled[slot]:
            raise ValueError(
                f"a chunk of 1..{self.chunk} tokens starting at most at {self._filled[slot]} "
                f"(the positions slot {slot} holds: no gap), got {n} tokens at {start}"
            )
        if start + n > self.max_len:
            raise ValueError(f"{n} tokens at {start} exceed the {self.max_len} positions")
        if sampling is not None:
            _check_sampling(sampling)
        bucket = pick_bucket(n, self.prefill_buckets)
        final = sampling is not None
        sampled = final and sampling.do_sample
        s = sampling or Sampling()
        ids = torch.full((1, bucket), self.pad_id, dtype=torch.long)
        ids[0, :n] = torch.tensor(list(tokens), dtype=torch.long)
        meta = torch.tensor([slot, start, n, int(final), s.top_k, int(sampled)])
        args = [ids.to(self.device), meta.to(self.device)]
        args.append(torch.tensor([float(s.temperature)]).to(self.device))
        if sampled:
            gen = torch.Generator().manual_seed(s.seed)
            self._gens[slot] = gen
            args.append(self._draw(gen).to(self.device))
        out = self._run(("prefill", bucket, sampled), [*args, *self._state(), *self._kv])
        tok, self._tokens, self._pos, self._temperature, self._top_k, self._sample = out[:6]
        self._kv = out[6:]
        self._filled[slot] = start + n
        if not final:
            return None
        self.active.add(slot)
        self._active_dirty = True
        self._host_pos[slot] = start + n
        return int(tok.cpu()[0])

    def decode(self) -> dict[int, int]:
        """One step of every active slot: ``{slot: new token}``."""
        if not self.active:
            return {}
        full = [s for s in self.active if self._host_pos[s] >= self.max_len]
        if full:
            raise ValueError(f"slots {full} have no position left (max_len {self.max_len})")
        bucket = pick_bucket(max(self.active) + 1, self.decode_buckets, "batch")
        sampled = any(s in self._gens for s in self.active)
        args = [self._tokens, self._pos, self._active(), *self._state()[2:]]
        if sampled:
            noise = torch.ones(bucket, self.vocab)
            for s, gen in self._gens.items():
                noise[s] = self._draw(gen)[0]
            args.append(noise.to(self.device))
        out = self._run(("decode", bucket, sampled), [*args, *self._kv])
        self._tokens, self._pos, self._kv = out[0], out[1], out[2:]
        for s in self.active:
            self._host_pos[s] += 1
        toks = self._tokens.cpu().tolist()  # one transfer
        return {s: toks[s] for s in sorted(self.active)}

    def warmup(self) -> None:
        """Capture every graph (each prefill and decode bucket, greedy and sampled) with steps
        that change nothing a request can see (all positions scratch, every row inactive)."""
        dev, none = self.device, torch.zeros(self.slots, dtype=torch.bool).to(self.device)
        for bucket in self.prefill_buckets:
            for sampled in (False, True):
                ids = torch.full((1, bucket), self.pad_id, dtype=torch.long).to(dev)
                meta = torch.tensor([0, 0, 0, 0, 0, int(sampled)]).to(dev)  # no token written
                args = [ids, meta, torch.ones(1).to(dev)]
                args += [torch.ones(1, self.vocab).to(dev)] if sampled else []
                out = self._run(("prefill", bucket, sampled), [*args, *self._state(), *self._kv])
                self._tokens, self._pos, self._temperature, self._top_k, self._sample = out[1:6]
                self._kv = out[6:]
        for bucket in self.decode_buckets:
            for sampled in (False, True):
                args = [self._tokens, self._pos, none, *self._state()[2:]]
                args += [torch.ones(bucket, self.vocab).to(dev)] if sampled else []
                out = self._run(("decode", bucket, sampled), [*args, *self._kv])
                self._tokens, self._pos, self._kv = out[0], out[1], out[2:]
        self._active_dirty = True

    # -- device side ------------------------------------------------------------------------
    def _state(self) -> list[torch.Tensor]:
        return [self._tokens, self._pos, self._temperature, self._top_k, self._sample]

    def _active(self) -> torch.Tensor:
        if self._active_dirty:  # uploaded only after a change (prefill, release)
            mask = torch.tensor([s in self.active for s in range(self.slots)])
            self._active_dev, self._active_dirty = mask.to(self.device), False
        return self._active_dev

    def _draw(self, gen: torch.Generator) -> torch.Tensor:
        """One row of Exp(1) noise: the draws ``torch.multinomial`` makes for one sequence."""
        return torch.empty((1, self.vocab)).exponential_(generator=gen)

    def _run(self, key: tuple, args: list[torch.Tensor]) -> list[torch.Tensor]:
        kind, bucket, sampled = key
        make = self._prefill_fn if kind == "prefill" else self._decode_fn
        if self.replay:
            if key not in self._steps:
                # This device's earlier steps finish first: a capture waits for every device
                # (xm.wait_device_ops), which deadlocks on XLA CPU devices sharing a process
                # when another device's step waits in a collective for one of ours.
                self._tokens.cpu()
                self._steps[key] = ReplayedStep(make(bucket, sampled))
            outputs, _ = self._steps[key](*args)
            return outputs
        outputs = list(make(bucket, sampled)(*args))
        if self.device.type == "xla":
            from ..backend import xla as _xla

            _xla.xm().mark_step()
        return outputs

    def _prefill_fn(self, bucket: int, sampled: bool):
        from .slot_cache import SlotCache, visible

        model, scratch = self.model, self.max_len

        def step(ids, meta, temp, *rest):
            noise, rest = (rest[0], rest[1:]) if sampled else (None, rest)
            tokens, pos, temperature, top_k, sample, *kv = rest
            slot, start, n, final = meta[0:1], meta[1], meta[2], meta[3:4].bool()
            idx = torch.arange(bucket, device=ids.device)
            valid = idx < n
            qpos = torch.where(valid, start + idx, torch.full_like(idx, scratch))[None]
            cache = SlotCache(kv, slot, qpos, slot)
            out = model(
                input_ids=ids,
                attention_mask=visible(qpos, scratch + 1),
                position_ids=torch.where(valid, start + idx, torch.zeros_like(idx))[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=(meta[2:3] - 1).clamp(min=0),
                **no_aux_outputs(model.config),
            )
            tok = choose_rows(out.logits[:, -1], temp, meta[4:5], meta[5:6].bool(), noise)

            def put(state, value):  # state[slot] = value on the last chunk
                new = torch.where(final, value.to(state.dtype), state.index_select(0, slot))
                return state.index_put((slot,), new)

            return [
                tok,
                put(tokens, tok),
                put(pos, start + meta[2:3]),
                put(temperature, temp),
                put(top_k, meta[4:5]),
                put(sample, meta[5:6].bool()),
                *cache.tensors(),
            ]

        return step

    def _decode_fn(self, bucket: int, sampled: bool):
        from .slot_cache import SlotCache, visible

        model, scratch = self.model, self.max_len

        def step(tokens, pos, active, temperature, top_k, sample, *rest):
            noise, kv = (rest[0], rest[1:]) if sampled else (None, rest)
            a, last = active[:bucket], tokens[:bucket]
            qpos = torch.where(a, pos[:bucket], torch.full_like(pos[:bucket], scratch))[:, None]
            rows = torch.arange(bucket, device=tokens.device)
            cache = SlotCache(list(kv), rows, qpos, slice(0, bucket))
            out = model(
                input_ids=last[:, None],
                attention_mask=visible(qpos, scratch + 1),
                position_ids=torch.where(a, pos[:bucket], torch.zeros_like(pos[:bucket]))[:, None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **no_aux_outputs(model.config),
            )
            b = slice(0, bucket)
            tok = choose_rows(out.logits[:, -1], temperature[b], top_k[b], sample[b], noise)
            tok = torch.where(a, tok, last)
            new_pos = pos[:bucket] + a.long()
            return [
                torch.cat([tok, tokens[bucket:]]),
                torch.cat([new_pos, pos[bucket:]]),
                *cache.tensors(),
            ]

        return step
