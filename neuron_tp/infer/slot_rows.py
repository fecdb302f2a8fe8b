"""The requests in the slots of a :class:`~.slot_generator.SlotGenerator`, as every tp rank runs
them (the serving :class:`~.engine.Engine` decides what is admitted and cancelled; this runs it).

A lease places its admitted requests in free slots and frees its cancelled ones, then runs
iterations: prompt chunks of the rows still prefilling (oldest first, at most the prefill budget
per iteration), then one decoded token for every running row. A row ends on EOS, one of its stop
token ids, a stop string or its ``max_tokens`` (0: right after its prompt); a failure while
generating ends only the rows of that step. Every rank holds
the same rows; only rank 0's have a client :class:`Request` to stream events to.

Rows with the same ``siblings`` key and prompt (the ``n`` / ``best_of`` choices of one prompt)
share its prefill: the oldest prefills it while the others wait; then each of them gets the
slot's KV copied (one captured graph, the slot ids as data) and prefills only the prompt's last
token, which draws its own first token. Rows asking for the prompt's log-probabilities prefill
themselves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .grammar import Grammars, Guide
from .lora_slots import BankSlots
from .prefix_cache import PrefixCache
from .sampling import Sampling, TokenLogprob
from .schedule import Admission, Delta, Done, Event, Failed, Lease, Output, Prompt, Request
from .slot_generator import SlotGenerator
from .text import Detokenizer


@dataclass
class Row:
    """A request in a slot, as every rank knows it."""

    slot: int
    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    detok: Detokenizer
    request: Request | None  # rank 0 only
    order: int = 0  # admission order (prefill goes oldest first)
    filled: int = 0  # prompt tokens prefilled so far
    count: int = 0  # tokens generated
    output: Output = Output()
    prompt_logprobs: list[TokenLogprob] | None = None  # gathered chunk by chunk
    guide: Guide | None = None  # the grammar state of a constrained row
    adapter: int = -1  # the LoRA bank slot of its adapter (-1: the base model)

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.prompt)


class SlotRows:
    """The rows of ``gen``'s slots (``by_slot``); ``stats`` (the engine's counters) gets steps,
    the largest batch, cancelled, dropped and failed requests; ``prefix``: this rank's prefix
    cache (an admission's plan is copied in before its first chunk, its blocks stored after
    their chunk); ``lora``: the adapters of ``gen``'s LoRA bank (an admission's is written
    into its slot before its first chunk)."""

    def __init__(
        self,
        gen: SlotGenerator,
        tokenizer,
        eos_ids: Sequence[int],
        prefill_budget: int | None,
        stats: dict,
        *,
        prefix: PrefixCache | None = None,
        lora: BankSlots | None = None,
    ):
        self.gen, self.tokenizer, self.eos_ids = gen, tokenizer, list(eos_ids)
        self.prefill_budget, self.stats, self.prefix = prefill_budget, stats, prefix
        self.lora = lora
        self.by_slot: dict[int, Row] = {}
        self.admitted = 0  # requests admitted so far (every rank)
        self.forked = 0  # rows whose prompt's KV was copied from a sibling's slot
        self._grammars: Grammars | None = None

    @property
    def grammars(self) -> Grammars:
        """The tokenizer's grammar view (built on first use)."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.gen.vocab, self.eos_ids)
        return self._grammars

    def run(self, lease: Lease, requests: list[Request] | None = None) -> None:
        """Run ``lease``; ``requests`` (rank 0) are its admitted requests, in order."""
        for slot in lease.cancel:
            self.end(slot)
            self.stats["cancelled"] += 1
        for i, admission in enumerate(lease.admit):
            slot = self.gen.acquire()
            if slot is None or slot in self.by_slot:
                raise RuntimeError(f"no free slot for an admitted request (slot {slot})")
            self.by_slot[slot] = Row(
                slot,
                list(admission.prompt),
                admission.max_tokens,
                admission.sampling,
                Detokenizer(self.tokenizer, list(admission.stop)),
                requests[i] if requests is not None else None,
                order=self.admitted,
                output=admission.output,
                prompt_logprobs=[] if admission.output.prompt_logprobs else None,
            )
            self.admitted += 1
            if admission.output.logprobs:
                self.gen.logprob_slots.add(slot)
            if admission.adapter is not None:
                self._adapter(self.by_slot[slot], admission)
            if slot in self.by_slot and admission.output.grammar is not None:
                self._guide(self.by_slot[slot], admission.output.grammar)
            if slot in self.by_slot and self.prefix is not None and admission.prefix is not None:
                self._load(self.by_slot[slot], admission)
        for _ in range(lease.steps):
            if not self.by_slot:
                return
            self.step()

    def step(self) -> None:
        """One iteration: prompt chunks within the budget, then one token per running row."""
        gen = self.gen
        self.stats["steps"] += 1
        self.stats["max_batch"] = max(self.stats["max_batch"], len(self.by_slot))
        budget, spent = self.prefill_budget or gen.chunk, 0
        for row in sorted(self.by_slot.values(), key=lambda r: r.order):  # oldest first
            if not row.prefilling:
                continue
            if row.filled == 0 and self._shares(row):
                lender = self._lender(row)
                if lender is None:
                    continue  # an older sibling prefills the prompt now
                if lender is not row:
                    self._fork(lender, row)
                    if row.slot not in self.by_slot:
                        continue
            size = min(len(row.prompt) - row.filled, gen.chunk)
            if spent and spent + size > budget:
                break  # the next iteration takes it: a decode step comes first
            spent += size
            self._prefill(row)
        running = [r for r in self.by_slot.values() if not r.prefilling]
        if not running:
            return
        try:
            tokens = gen.decode()
        except Exception as e:  # noqa: BLE001 - fails this step's rows, not the engine
            for r in running:
                self._fail(r, e)
            return
        for slot, new in tokens.items():  # one token, or several (speculative decoding)
            for t in new:
                row = self.by_slot.get(slot)
                if row is None or row.prefilling:
                    break  # the row ended: the rest of its tokens are dropped
                self._token(row, t, gen.logprobs.get(slot))

    def end(self, slot: int) -> None:
        """Free ``slot`` (nothing when it holds no row)."""
        if self.by_slot.pop(slot, None) is not None:
            self.gen.release(slot)
            if self.prefix is not None:
                self.prefix.end(slot)

    def warmup(self) -> None:
        """Capture the graph copying a slot's KV to a sibling's (slot 0 onto itself)."""
        self._copy_slot(0, 0)

    @staticmethod
    def _shares(row: Row) -> bool:
        return row.output.siblings is not None and row.prompt_logprobs is None

    def _lender(self, row: Row) -> Row | None:
        """The sibling whose slot holds ``row``'s prompt but its last token (``row`` itself:
        none, it prefills; None: wait, an older sibling prefills it)."""
        need, waits = len(row.prompt) - 1, False
        for other in self.by_slot.values():
            same = other.output.siblings == row.output.siblings and other.prompt == row.prompt
            if other is row or not same or not self._shares(other):
                continue
            if other.filled >= need:
                return other if need else row
            waits = waits or other.order < row.order
        return None if waits else row

    def _fork(self, lender: Row, row: Row) -> None:
        """Copy ``lender``'s slot cache into ``row``'s: its prompt but the last token."""
        n = len(row.prompt) - 1
        try:
            self._copy_slot(lender.slot, row.slot)
            self.gen.mark_filled(row.slot, row.prompt[:n])
        except Exception as e:  # noqa: BLE001 - fails this request only
            self._fail(row, e)
            return
        row.filled = n
        self.forked += 1

    def _copy_slot(self, src: int, dst: int) -> None:
        for part in self.gen.cache_parts():
            pair = torch.tensor([src, dst], dtype=torch.long).to(part.device)
            part.run_on_cache(("fork",), _copy_slot_step, [pair], writes=True)

    def adapter_slots(self) -> set[int]:
        """The bank slots the rows' adapters use."""
        return {r.adapter for r in self.by_slot.values() if r.adapter >= 0}

    def _adapter(self, row: Row, admission: Admission) -> None:
        """Write the row's adapter into its bank slot unless there already (a directory that
        cannot be read any more fails this request only)."""
        use = admission.adapter
        assert use is not None
        try:
            if self.lora is None:
                raise ValueError("this server has no LoRA bank (--enable-lora)")
            self.lora.ensure(use)
        except Exception as e:  # noqa: BLE001 - fails this request only
            self._fail(row, e)
            return
        row.adapter = use.slot

    def _guide(self, row: Row, grammar: str) -> None:
        """Give the row its grammar state (a grammar that does not compile fails it)."""
        try:
            row.guide = self.grammars.guide(grammar)
        except Exception as e:  # noqa: BLE001 - fails this request only
            self._fail(row, e)

    def _load(self, row: Row, admission: Admission) -> None:
        """Copy the row's cached prompt blocks into its slot (a failure fails this request)."""
        try:
            row.filled = self.prefix.admit(self.gen, row.slot, admission.prefix, row.prompt)
        except Exception as e:  # noqa: BLE001 - fails this request only
            self._fail(row, e)

    def _prefill(self, row: Row) -> None:
        """Prefill the row's next chunk (its first new token comes with the last chunk)."""
        gen, start = self.gen, row.filled
        chunk = row.prompt[start : start + gen.chunk]
        end = start + len(chunk)
        last = end == len(row.prompt)
        echo = row.prompt_logprobs is not None
        try:
            token = gen.prefill(
                row.slot,
                chunk,
                start,
                row.sampling if last else None,
                **({"prompt": row.prompt} if last and row.sampling.adjusts else {}),
                **(
                    {"prompt_logprobs": True, "next_token": row.prompt[end] if not last else 0}
                    if echo
                    else {}
                ),
                **({"allowed": row.guide.bits()} if last and row.guide is not None else {}),
                **({"adapter": row.adapter} if row.adapter >= 0 else {}),
            )
        except Exception as e:  # noqa: BLE001 - fails this request only
            self._fail(row, e)
            return
        row.filled += len(chunk)
        if row.prompt_logprobs is not None:
            row.prompt_logprobs.extend(gen.prompt_logprobs)
        if self.prefix is not None:
            try:
                self.prefix.prefilled(self.gen, row.slot, row.filled)
            except Exception as e:  # noqa: BLE001 - fails this request only
                self._fail(row, e)
                return
        if not last:
            return
        if row.prompt_logprobs is not None:
            self._emit(row, Prompt(tuple(row.prompt_logprobs)))
        if row.max_tokens == 0:
            self._finish(row, "length")
        else:
            self._token(row, token, gen.logprobs.get(row.slot))

    def _token(self, row: Row, t: int, logprob: TokenLogprob | None = None) -> None:
        """A new token of ``row`` (``logprob``: the model's, when the row asked for them):
        stream its text, end the row when it is done."""
        row.count += 1
        if row.request is not None:
            row.request.tokens.append(t)
        eos = t in self.eos_ids or t in row.output.stop_ids
        try:
            if row.guide is not None and not eos:
                row.guide.accept(t)
            text = "" if eos else row.detok.add(t)
        except Exception as e:  # noqa: BLE001 - e.g. a tokenizer that cannot decode the id
            self._fail(row, e)
            return
        if text or (logprob is not None and row.output.logprobs):
            self._emit(row, Delta(text, (logprob,) if logprob is not None else ()))
        complete = row.guide is not None and row.guide.done
        if eos or row.detok.stopped or complete:
            self._finish(row, "stop")
        elif row.count >= row.max_tokens:
            self._finish(row, "length")
        elif row.guide is not None:
            self.gen.masks[row.slot] = row.guide.bits()

    def _finish(self, row: Row, reason: str) -> None:
        rest = row.detok.finish()
        if rest:
            self._emit(row, Delta(rest))
        self._emit(row, Done(reason, prompt_tokens=len(row.prompt), completion_tokens=row.count))
        self.end(row.slot)

    def _fail(self, row: Row, error: Exception) -> None:
        message = f"generation failed: {type(error).__name__}: {error}"
        if row.request is not None:
            self.stats["failed"] += 1
        self._emit(row, Failed(message))
        self.end(row.slot)

    def _emit(self, row: Row, event: Event) -> None:
        """Give ``event`` to the row's client (rank 0), unless it went away (dropped)."""
        req = row.request
        if req is None:
            return
        if not req.cancelled:
            try:
                req.sink(event)
                return
            except Exception:  # noqa: BLE001 - a consumer that went away must not stop others
                req.cancel()
        self.stats["dropped"] += 1


def _copy_slot_step():
    """The step copying slot ``pair[0]``'s rows of every cache tensor to slot ``pair[1]``."""

    def step(pair, *kv):
        for c in kv:
            c.index_copy_(0, pair[1:2], c.index_select(0, pair[0:1]))
        return list(kv)

    return step
