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
  never shapes: graphs = prefill buckets x {greedy, sampled} + decode buckets x the fixed
  :data:`~.slot_records.DECODE_VARIANTS` (greedy; + log-probabilities; + penalties, bias and
  grammar rows; sampled; + top_p when asked for: a step runs the cheapest that covers what
  its active rows use) (+ one prefill per bucket with prompt log-probabilities when asked
  for), whatever the arrival pattern; :meth:`~SlotGenerator.warmup` captures them all.
- Sampling per row: temperature, top_k (<= :data:`~.sampling.MAX_TOP_K`), top_p, min_p,
  presence / frequency / repetition penalties, logit bias, seed, all data of the slot's rows
  (:mod:`.sampling`); the token counts the penalties read advance in the decode graph.
  Gumbel-max noise is drawn on the host from each slot's own generator (the draws
  transformers makes for that request alone), so a seeded request reproduces its tokens
  whatever runs beside it; the next step's rows are drawn on a worker thread while the device
  runs this one (:class:`~.sampling.NoiseRows`).
- Log-probabilities: a step with a row in :attr:`SlotGenerator.logprob_slots` also returns
  the model's log-probability of each row's token and its :data:`~.sampling.MAX_LOGPROBS`
  most likely tokens (read back for those slots only); a prefill chunk with
  ``prompt_logprobs`` runs the prefill graph variant that returns them for every prompt
  position too.
- Per token the host uploads nothing for greedy steps (positions and last tokens advance in
  the decode graph), the noise rows for sampled ones, the packed grammar rows (``vocab / 32``
  int32 words per slot, unpacked in the graph) when a row has one, the active flags after a
  change; it reads
  back one small tensor of tokens (and the log-probabilities, when a slot asks for them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import UserError
from .model_step import check_cache, pick_bucket
from .replay import StepGraphs, StepGraphsOwner
from .sampling import (
    NoiseRows,
    Sampling,
    TokenLogprob,
    allowed_words,
    bias_row,
    check_per_row,
    host_generator,
    host_noise,
    seen_row,
)
from .slot_records import (
    DECODE_VARIANTS,
    ChunkMeta,
    DecodeVariant,
    SlotState,
    check_chunk,
    decode_variant,
    default_prefill_buckets,
    packed_rows,
    read_logprobs,
    seq_split,
    variants_of,
)
from .slot_steps import bank_bound, decode_step, prefill_step

if TYPE_CHECKING:
    from ..hf.lora_bank import LoraBank

__all__ = ["ChunkMeta", "SlotGenerator", "SlotState", "default_prefill_buckets"]


class SlotGenerator(StepGraphsOwner):
    """Continuous-batching generation with one model on its device (see the module doc).

    ``max_len``: positions per slot (prompt + new tokens must fit); ``chunk``: the most prompt
    tokens one :meth:`prefill` call takes; ``prefill_buckets``: chunk lengths graphs exist for;
    ``decode_buckets``: slot counts decode graphs exist for (bucket ``b`` runs slots ``[0, b)``);
    ``replay=False``: re-trace every step (torch-xla's plain lazy mode); ``kv_split``:
    ``heads`` (each rank caches its kv heads, replicated when tp exceeds them), ``sequence``
    (the ranks sharing a kv head each cache 1/r of the positions, :mod:`.kv_split`) or
    ``auto`` (sequence when kv heads are replicated); ``prompt_logprobs``: :meth:`warmup`
    also captures the prefill graphs that return every prompt position's log-probabilities
    (one more per prefill bucket); ``top_p``: it also captures the sampled decode graphs that
    apply top_p (a bisection over the vocabulary per row: sampled steps without a top_p row run
    the graph without it; one more per decode bucket). The model's weights must not change while
    the SlotGenerator is used."""

    logprobs_supported = True  # decode steps return the log-probabilities of their tokens
    grammar_supported = True  # decode steps add the rows of masks to the logits

    def __init__(
        self,
        model,
        slots: int,
        max_len: int,
        *,
        chunk: int = 256,
        prefill_buckets: Sequence[int] | None = None,
        decode_buckets: Sequence[int] | None = None,
        pad_id: int = 0,
        replay: bool = True,
        kv_split: str = "heads",
        prompt_logprobs: bool = False,
        top_p: bool = False,
        lora: LoraBank | None = None,
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

        self.split = seq_split(model, kv_split, max_len)

        self.model, self.slots, self.max_len, self.chunk = model, slots, max_len, chunk
        self.prompt_logprob_graphs, self.top_p_graphs = prompt_logprobs, top_p
        self.pad_id, self.vocab = pad_id, model.config.get_text_config(decoder=True).vocab_size
        self.device = dev = next(model.parameters()).device
        self._graphs = StepGraphs(dev, replay)
        self._kv = allocate(model, slots, max_len, dev, split=self.split)
        neutral = Sampling().row_params()
        self._state = SlotState(
            tokens=torch.zeros(slots, dtype=torch.long).to(dev),
            pos=torch.zeros(slots, dtype=torch.long).to(dev),
            temperature=torch.ones(slots).to(dev),
            top_k=torch.zeros(slots, dtype=torch.long).to(dev),
            sample=torch.zeros(slots, dtype=torch.bool).to(dev),
            params=torch.tensor([neutral] * slots).to(dev),
            counts=torch.zeros(slots, self.vocab).to(dev),
            seen=torch.zeros(slots, self.vocab).to(dev),
            bias=torch.zeros(slots, self.vocab).to(dev),
            adapter=torch.full((slots,), -1, dtype=torch.long).to(dev),
        )
        self.lora = lora  # the resident LoRA adapters' weights (None: the base model only)
        # the prefill's seen and bias rows when zero: two tensors (a capture maps one tensor
        # fed as two arguments to one graph input)
        self._zero_rows = [torch.zeros(1, self.vocab).to(dev) for _ in range(2)]
        self.words = allowed_words(self.vocab)  # int32 words of a packed grammar row
        self._every_token = [
            torch.full((n, self.words), -1, dtype=torch.int32).to(dev) for n in (1, slots)
        ]  # the packed rows of a prefill and of a decode step without a grammar
        self._lp_out: torch.Tensor | None = None  # the last step's packed logprobs
        self.logprob_slots: set[int] = set()  # slots whose log-probabilities are read back
        self.logprobs: dict[int, TokenLogprob] = {}  # theirs, of the last step
        self.prompt_logprobs: list[TokenLogprob] = []  # of the last prompt_logprobs chunk
        self._active_dev = torch.zeros(slots, dtype=torch.bool).to(dev)
        self._active_dirty = False
        self.in_use: set[int] = set()  # acquired slots (prefilling or decoding)
        self.active: set[int] = set()  # slots that decode
        self._filled: dict[int, int] = {}  # prompt positions written so far, per acquired slot
        self._host_pos: dict[int, int] = {}  # next cache index of each active slot
        self._gens: dict[int, torch.Generator] = {}  # sampled active slots
        self._noise_rows = NoiseRows(slots, self.vocab)
        self._nucleus: set[int] = set()  # of them, those with top_p < 1
        self._adjusting: set[int] = set()  # slots with a penalty or a logit bias
        self.masks: dict[int, torch.Tensor] = {}  # packed grammar rows of the next token

    # -- requests --------------------------------------------------------------------------
    def check(
        self,
        prompt_len: int,
        max_new_tokens: int,
        sampling: Sampling,
        *,
        asked_as: str = "max_new_tokens",
        limit_as: str = "max_len",
    ) -> None:
        """ValueError naming the limit a request exceeds (before any device work); the
        messages call the new tokens ``asked_as`` and the slot's length ``limit_as`` (the
        caller's terms)."""
        if prompt_len < 1:
            raise ValueError("the prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"{asked_as} must be >= 1, got {max_new_tokens}")
        if prompt_len + max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt of {prompt_len} tokens + {asked_as} {max_new_tokens} exceeds "
                f"the {self.max_len} positions of a slot ({limit_as})"
            )
        check_per_row(sampling)

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
        self._nucleus.discard(slot)
        self.logprob_slots.discard(slot)
        self.masks.pop(slot, None)
        self._adjusting.discard(slot)

    def prefill(
        self,
        slot: int,
        tokens: Sequence[int],
        start: int,
        sampling: Sampling | None = None,
        *,
        prompt: Sequence[int] | None = None,
        prompt_logprobs: bool = False,
        next_token: int = 0,
        allowed: torch.Tensor | None = None,
        adapter: int = -1,
    ) -> int | None:
        """Write one chunk of ``slot``'s prompt at positions ``start..start+len-1``. With
        ``sampling`` (the LAST chunk): choose and return the first new token; the slot then
        decodes from ``start+len`` (``prompt``: the whole prompt, which its repetition
        penalty reads). Without: more chunks follow; returns None. ``prompt_logprobs``: set
        :attr:`prompt_logprobs` to the log-probabilities of the prompt tokens at
        ``start+1..start+len`` (``next_token``: the one after the chunk; a last chunk gives
        one fewer). ``allowed``: the tokens the first new token may be, packed
        (``[allowed_words(vocab)]`` int32, :meth:`~.grammar.Guide.bits`: a grammar's, with
        :attr:`masks` the rows of the next ones). ``adapter``: the slot of
        :attr:`lora` holding the request's LoRA adapter (-1: the base model)."""
        n = len(tokens)
        self._check_chunk(slot, n, start)
        if sampling is not None:
            check_per_row(sampling)
        bucket = pick_bucket(n, self.prefill_buckets)
        final = sampling is not None
        s = sampling or Sampling()
        sampled = final and s.do_sample
        meta = ChunkMeta(slot, start, n, final, s.top_k, sampled, next_token, adapter)
        ids = torch.full((1, bucket), self.pad_id, dtype=torch.long)
        ids[0, :n] = torch.tensor(list(tokens), dtype=torch.long)
        dev = self.device
        floats = torch.tensor([[float(s.temperature), *s.row_params()]])
        args = [ids.to(dev), meta.tensor().to(dev), floats.to(dev)]
        if final and s.repetition_penalty != 1 and prompt is None:
            raise ValueError("a repetition penalty needs the whole prompt (prefill's prompt=)")
        args.append(self._row(0, s.repetition_penalty != 1, lambda: seen_row(prompt, self.vocab)))
        args.append(self._row(1, bool(s.logit_bias), lambda: bias_row(s, self.vocab)))
        words = self._every_token[0] if allowed is None else allowed[None].to(dev)
        args.append(words)
        if final and s.adjusts:
            self._adjusting.add(slot)
        if sampled:
            gen = host_generator(s)
            self._gens[slot] = gen
            if s.top_p < 1:
                self._nucleus.add(slot)
            args.append(host_noise(gen, 1, self.vocab).to(dev))
        tok = self._run_prefill(bucket, sampled, prompt_logprobs, args)
        self._filled[slot] = start + n
        if prompt_logprobs:
            targets = [*tokens[1:], next_token][: n - 1 if final else n]
            self.prompt_logprobs = read_logprobs(self._prompt_lp, targets)
        if not final:
            return None
        self.active.add(slot)
        self._active_dirty = True
        self._host_pos[slot] = start + n
        token = int(tok.cpu()[0])
        self.logprobs = {}
        if slot in self.logprob_slots:
            self.logprobs[slot] = read_logprobs(self._lp_out, [token])[0]
        return token

    def _row(self, which: int, needed: bool, make) -> torch.Tensor:
        """``make()`` ([vocab] on the host) as a ``[1, vocab]`` device row; unless ``needed``
        zeros kept on the device (the seen row's, ``which`` 0, or the bias row's, 1)."""
        return make()[None].to(self.device) if needed else self._zero_rows[which]

    def _check_chunk(self, slot: int, n: int, start: int) -> None:
        if slot not in self.in_use or slot in self.active:
            raise ValueError(f"slot {slot} must be acquired and not decoding to be prefilled")
        check_chunk(n, start, filled=self._filled[slot], chunk=self.chunk, max_len=self.max_len)

    def mark_filled(self, slot: int, tokens: Sequence[int]) -> None:
        """``slot`` (acquired, nothing prefilled) holds its prompt's first ``tokens`` already
        (their KV copied into its rows by :meth:`run_on_cache`): its next chunk starts after."""
        n = len(tokens)
        busy = slot not in self.in_use or slot in self.active or self._filled[slot]
        if busy or n >= self.max_len:
            raise ValueError(f"slot {slot} must be acquired and empty, and {n} < {self.max_len}")
        self._filled[slot] = n

    def cache_parts(self) -> list[SlotGenerator]:
        """The generators whose slot caches hold a request's KV (:meth:`run_on_cache` on each):
        this one (a speculative generator adds its draft's)."""
        return [self]

    def run_on_cache(self, key: tuple, build, args: Sequence[torch.Tensor], *, writes: bool):
        """Run the step ``build()`` (captured once under ``key`` and replayed, like the model's)
        on ``args`` and then the KV cache tensors (``[k0, v0, ...]``, each ``[slots, local kv
        heads, max_len + 1, head dim]``); its results, without the new cache (its last ones
        when it ``writes``)."""
        out = self._run(key, build, list(args))
        if not writes:
            return out
        n = len(self._kv)
        self._kv = out[len(out) - n :]
        return out[: len(out) - n]

    def decode(self) -> dict[int, list[int]]:
        """One step of every active slot: ``{slot: its new tokens}`` (one here; several
        from a speculative generator's step)."""
        if not self.active:
            return {}
        bucket = self._decode_bucket()
        sampled = any(s in self._gens for s in self.active)
        noise = self._noise_rows.take(self._gens, bucket).to(self.device) if sampled else None
        nucleus = sampled and any(s in self._nucleus for s in self.active)
        adjust = any(s in self._adjusting or s in self.masks for s in self.active)
        logprobs = any(s in self.logprob_slots for s in self.active)
        variant = decode_variant(DecodeVariant(sampled, nucleus, adjust, logprobs))
        words = self._every_token[1]  # the grammar rows, packed, as data of the graph
        if self.masks and variant.adjust:
            words = packed_rows(self.masks, self.slots, self.words).to(self.device)
        self._run_decode(bucket, self._active(), noise, variant, words)
        if sampled:  # the next step's noise, drawn while the device runs this one
            self._noise_rows.prefetch(self._gens)
        for s in self.active:
            self._host_pos[s] += 1
        toks = self._state.tokens.cpu().tolist()  # one transfer
        self.logprobs = {}
        wanted = sorted(self.active & self.logprob_slots)
        if wanted:
            read = read_logprobs(self._lp_out, [toks[s] for s in wanted], wanted)
            self.logprobs = dict(zip(wanted, read))
        return {s: [toks[s]] for s in sorted(self.active)}

    def _decode_bucket(self) -> int:
        """The decode bucket of the active slots; ValueError when one has no position left."""
        full = [s for s in self.active if self._host_pos[s] >= self.max_len]
        if full:
            raise ValueError(f"slots {full} have no position left (max_len {self.max_len})")
        return pick_bucket(max(self.active) + 1, self.decode_buckets, "batch")

    def warmup(self) -> None:
        """Capture every graph (each prefill and decode bucket, greedy and sampled) with steps
        that change nothing a request can see (all positions scratch, every row inactive)."""
        self.warmup_prefill()
        dev, none = self.device, torch.zeros(self.slots, dtype=torch.bool).to(self.device)
        for bucket in self.decode_buckets:
            for v in DECODE_VARIANTS:
                if v.nucleus and not self.top_p_graphs:
                    continue
                noise = torch.ones(bucket, self.vocab).to(dev) if v.sampled else None
                self._run_decode(bucket, none, noise, v, self._every_token[1])
        self._active_dirty = True

    def warmup_prefill(self, variants: Sequence[bool] = (False, True)) -> None:
        """Capture the prefill graph of every bucket, greedy and/or sampled (``variants``;
        with both and ``prompt_logprobs``, also the one with prompt log-probabilities), with
        chunks that write only the scratch position."""
        dev = self.device
        for bucket in self.prefill_buckets:
            for sampled, prompt_lp in variants_of(variants, self.prompt_logprob_graphs):
                ids = torch.full((1, bucket), self.pad_id, dtype=torch.long).to(dev)
                meta = ChunkMeta(0, 0, 0, False, 0, sampled)  # no token written
                floats = torch.tensor([[1.0, *Sampling().row_params()]]).to(dev)
                args = [ids, meta.tensor().to(dev), floats, *self._zero_rows]
                args.append(self._every_token[0])
                args += [torch.ones(1, self.vocab).to(dev)] if sampled else []
                self._run_prefill(bucket, sampled, prompt_lp, args)

    @property
    def kv_split(self) -> str:
        """``sequence`` when this rank caches 1/r of each slot's positions, else ``heads``."""
        return "heads" if self.split is None else "sequence"

    @property
    def kv_bytes(self) -> int:
        """Bytes of this rank's KV cache tensors."""
        return sum(t.numel() * t.element_size() for t in self._kv)

    @property
    def kv(self) -> list[torch.Tensor]:
        """The cache tensors ``[k0, v0, k1, v1, ...]`` (every step takes and returns them)."""
        return self._kv

    @kv.setter
    def kv(self, tensors: list[torch.Tensor]) -> None:
        self._kv = list(tensors)

    # -- device side ------------------------------------------------------------------------
    def _active(self) -> torch.Tensor:
        if self._active_dirty:  # uploaded only after a change (prefill, release)
            mask = torch.tensor([s in self.active for s in range(self.slots)])
            self._active_dev, self._active_dirty = mask.to(self.device), False
        return self._active_dev

    def _run_prefill(self, bucket: int, sampled: bool, prompt_lp: bool, args: list[torch.Tensor]):
        """Run a prefill graph on ``args`` (ids, meta, floats, seen row, bias row[, noise]);
        the new state, cache and log-probabilities are kept, the chosen token returned. The
        prompt log-probability variant is the sampled graph (greedy rows are data there)."""
        if prompt_lp and not sampled:
            args = [*args, torch.ones(1, self.vocab).to(self.device)]
            sampled = True
        key = ("prefill", bucket, sampled, prompt_lp) if prompt_lp else ("prefill", bucket, sampled)
        build = lambda: prefill_step(self, bucket, sampled, prompt_lp)  # noqa: E731
        out = self._run_model(key, build, [*args, *self._state])
        n, m = len(SlotState._fields), 3 if prompt_lp else 2
        self._lp_out = out[1]
        if prompt_lp:
            self._prompt_lp = out[2]
        self._state, self._kv = SlotState(*out[m : m + n]), out[m + n :]
        return out[0]

    def _run_decode(
        self,
        bucket: int,
        active: torch.Tensor,
        noise: torch.Tensor | None,
        variant: DecodeVariant,
        words: torch.Tensor,
    ):
        """Run the decode graph ``variant`` (sampled: on ``noise``; adjusting: with the packed
        grammar rows ``words``): every active row of ``[0, bucket)`` advances one token."""
        key = ("decode", bucket, *variant)
        args = [active, *self._state, *([noise] if variant.sampled else [])]
        args += [words] if variant.adjust else []
        out = self._run_model(key, lambda: decode_step(self, bucket, variant), args)
        self._state = self._state._replace(tokens=out[0], pos=out[1])
        n = 2
        if variant.adjust:
            self._state, n = self._state._replace(counts=out[2]), 3
        self._lp_out = out[n] if variant.logprobs else None
        self._kv = out[n + variant.logprobs :]

    def _run_model(self, key: tuple, build, args: list[torch.Tensor]) -> list[torch.Tensor]:
        """A step that runs the model: the LoRA bank's tensors are its first arguments (data:
        loading an adapter changes them, never the graph)."""
        if self.lora is None:
            return self._run(key, build, args)
        return self._run(key, lambda: bank_bound(self.lora, build()), [*self.lora.tensors, *args])

    def adapters(self, index: torch.Tensor):
        """In a step: the model's LoRA layers add each row's adapter (``index``: its bank
        slot per row, -1 none) while the context is open."""
        return contextlib.nullcontext() if self.lora is None else self.lora.select(index)

    def _run(self, key: tuple, build, args: list[torch.Tensor]) -> list[torch.Tensor]:
        # This device's earlier steps finish first: a capture waits for every device
        # (xm.wait_device_ops), which deadlocks on XLA CPU devices sharing a process
        # when another device's step waits in a collective for one of ours.
        with torch.no_grad():  # the cache is updated in place: no autograd history
            return self._graphs.run(key, build, [*args, *self._kv], self._state.tokens.cpu)

    def cache_mask(self, qpos: torch.Tensor) -> torch.Tensor:
        """The attention mask of queries at cache indices ``qpos`` over this rank's cache."""
        from .model_step import attention_mask_for
        from .slot_cache import visible

        seen = visible(qpos, self.max_len + 1) if self.split is None else self.split.visible(qpos)
        return attention_mask_for(self.model, seen)

    def with_split_attention(self, step):
        """``step`` run with the sequence-split attention switched on (when the cache is)."""
        if self.split is None:
            return step
        from .kv_split import tracing

        def run(*args):
            with tracing(self.model):
                return step(*args)

        return run
