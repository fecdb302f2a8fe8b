"""The serving engine: continuous (iteration-level) batching over the slots of a
:class:`~.slot_generator.SlotGenerator`, on every tp rank.

Every iteration the engine prefills prompt chunks of newly admitted requests (at most
``prefill_budget`` tokens: a long prompt is spread over several iterations, so it never stalls
the running requests for more than one budget) and then decodes one token for every running
request. A request takes a free slot as soon as there is one and leaves it the moment it ends
(EOS, a stop string, its ``max_tokens``, its client gone): nobody waits for a batch to finish.

Rank 0 owns the request queue and decides the schedule; at tp > 1 it sends the other ranks a
*lease* (:func:`neuron_tp.parallel.host.broadcast`): the requests admitted and cancelled
now, and how many iterations to run before the next message. Everything else (which chunk to
prefill, when a request ends) follows from the lease and the generated tokens, which every rank
has: the ranks run the same schedule with one host message per ``lease_steps`` iterations.

A failure while generating fails the requests of that step (their clients get an error),
never the engine: the slots are freed and serving goes on.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from ..parallel import host
from .lora_slots import AdapterRef, Adapters, AdapterUse, BankSlots
from .prefix_cache import PrefixCache, PrefixStats
from .sampling import Sampling, check_vocab
from .schedule import Admission, Event, Failed, Lease, Output, Request, Shutdown, decode, encode
from .slot_generator import SlotGenerator
from .slot_rows import Row, SlotRows
from .text import Detokenizer

_SHUTDOWN = object()
_KEY = "serve"


class NotReady(RuntimeError):
    """The engine has no model yet (loading, warming up) or is shutting down."""


class QueueFull(RuntimeError):
    """More requests wait than the engine's ``max_queue``: try again later (HTTP 429)."""


class Engine:
    """Continuous batching for a server, on every tp rank of ``group`` (None: one rank).

    Lifecycle: :meth:`attach` the generator, :meth:`warmup` (all ranks), then rank 0
    :meth:`start` s the worker and :meth:`submit` s requests while the other ranks
    :meth:`follow`; rank 0's :meth:`shutdown` ends every rank's loop.

    ``max_queue``: requests waiting for a slot beyond which :meth:`submit` raises
    :class:`QueueFull`; ``lease_steps``: iterations per schedule message at tp > 1 (a new
    request waits at most that many steps for its slot); ``prefill_budget``: prompt tokens
    prefilled per iteration (None: the generator's chunk)."""

    def __init__(
        self,
        group=None,
        max_queue: int = 256,
        lease_steps: int = 4,
        prefill_budget: int | None = None,
    ):
        self.group, self.max_queue = group, max_queue
        self.rank = group.rank if group is not None else 0
        multi = group is not None and group.size > 1
        self.lease_steps = lease_steps if multi else 1
        self.prefill_budget = prefill_budget
        self._gen: SlotGenerator | None = None
        self.tokenizer: Any = None
        self.eos_ids: list[int] = []
        self.max_new_tokens = 0
        self.sampling_defaults: dict = {}  # the model's generation_config values (server)
        self.tool_call_parser = "hermes"  # how the server finds tool calls (--tool-call-parser)
        self.adapters: Adapters | None = None  # rank 0: the LoRA adapters requests may name
        self._queue: queue.Queue = queue.Queue()
        self._waiting: deque[Request] = deque()  # rank 0: taken off the queue, no slot yet
        self.rows: SlotRows | None = None  # the requests in the slots (every rank)
        self._admitting: list[Request] = []  # rank 0: admitted by the lease being placed
        self._worker: threading.Thread | None = None
        self._ready = threading.Event()
        self._closed = False
        self._lock = threading.Lock()  # submitting vs. shutting down: no request left behind
        self.error: str | None = None  # set only when the engine itself cannot go on
        # iterations run, most requests running at once, slots freed for clients that went
        # away, events dropped for them (rank 0), requests failed by a generation error,
        # leases sent (rank 0)
        self.stats = dict.fromkeys(
            ("steps", "max_batch", "cancelled", "dropped", "failed", "leases"), 0
        )

    # -- setup ---------------------------------------------------------------------------
    def attach(
        self,
        gen: SlotGenerator,
        tokenizer,
        eos_ids: Sequence[int],
        max_new_tokens: int,
        prefix: PrefixCache | None = None,
        lora: BankSlots | None = None,
    ) -> None:
        """Give the engine its model (a slot generator on this rank's device), the most
        tokens a request may ask for, this rank's prefix cache (None: no caching) and the
        slots of its LoRA bank (None: the base model only)."""
        self.gen, self.tokenizer, self.eos_ids = gen, tokenizer, list(eos_ids)
        self.max_new_tokens = max_new_tokens
        self.rows = SlotRows(
            gen, tokenizer, eos_ids, self.prefill_budget, self.stats, prefix=prefix, lora=lora
        )

    def warmup(self, every_shape: bool = False) -> None:
        """Capture the graphs before serving (every rank, in the same order): all of them
        (``every_shape``), else the smallest prefill and decode, greedy; the others are
        captured by the first request that needs them."""
        gen = self._model()
        if every_shape:
            gen.warmup()
            self.rows.warmup()
            if self.rows.prefix is not None:
                self.rows.prefix.warmup(gen)
            return
        slot = gen.acquire()
        gen.prefill(slot, [gen.pad_id], 0, Sampling())
        gen.decode()
        gen.release(slot)

    def start(self, thread: bool = True) -> None:
        """Rank 0: the engine is ready; its loop runs on a worker thread (``thread=False``:
        on the calling thread, until :meth:`shutdown` from another one)."""
        self._model()
        self._ready.set()
        if not thread:
            self._work()
            return
        self._worker = threading.Thread(target=self._work, name="engine", daemon=True)
        self._worker.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._closed

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until :meth:`start` has made the engine ready (another thread may be about
        to call it); False after ``timeout`` seconds or once shut down."""
        return self._ready.wait(timeout) and not self._closed

    @property
    def gen(self) -> SlotGenerator | None:
        """The slot generator (None before :meth:`attach`); set, it replaces the rows' one."""
        return self._gen

    @gen.setter
    def gen(self, gen: SlotGenerator | None) -> None:
        self._gen = gen
        if self.rows is not None:
            self.rows.gen = gen

    @property
    def _rows(self) -> dict[int, Row]:
        """slot -> the request in it (none before :meth:`attach`)."""
        return self.rows.by_slot if self.rows is not None else {}

    def _model(self) -> SlotGenerator:
        if self.gen is None:
            raise NotReady("the model is not loaded yet")
        return self.gen

    # -- requests (rank 0) ---------------------------------------------------------------
    @property
    def max_tokens_limit(self) -> int:
        self._model()
        return self.max_new_tokens

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of ``prompt_len`` tokens may ask for: what is left of
        its slot, at most the server limit."""
        return min(self.max_new_tokens, self._model().max_len - prompt_len)

    def queue_depth(self) -> int:
        """Requests waiting for a slot."""
        return self._queue.qsize() + len(self._waiting)

    def speculation(self):
        """The :class:`~.speculative.SpeculationStats` of a speculative generator (None: no
        speculation, or no generator attached yet)."""
        from .speculative import VerifyingGenerator

        return self.gen.stats if isinstance(self.gen, VerifyingGenerator) else None

    def slots_in_use(self) -> int:
        """Requests holding a slot (prefilling or decoding)."""
        return len(self._rows)

    def prefix_stats(self) -> PrefixStats | None:
        """Rank 0's prefix-cache counters (None: no prefix caching)."""
        prefix = self.rows.prefix if self.rows is not None else None
        return prefix.stats() if prefix is not None else None

    def check(
        self,
        prompt: list[int],
        max_tokens: int,
        stop: Sequence[str],
        sampling: Sampling | None = None,
        output: Output | None = None,
    ) -> None:
        """ValueError naming what is wrong with a request (nothing runs); ``max_tokens`` 0:
        the prompt only (its log-probabilities)."""
        gen = self._model()
        if not prompt:
            raise ValueError("the prompt needs at least one token")
        if not 0 <= max_tokens <= self.max_new_tokens:
            raise ValueError(
                f"max_tokens must be in 0..{self.max_new_tokens} (server limit), got {max_tokens}"
            )
        sampling, output = sampling or Sampling(), output or Output()
        gen.check(
            len(prompt),
            max(max_tokens, 1),
            sampling,
            asked_as="max_tokens",
            limit_as="server limit",
        )
        check_vocab(sampling, gen.vocab)
        bad = [t for t in output.stop_ids if not 0 <= t < gen.vocab]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is not a token id (0..{gen.vocab - 1})")
        if output.logprobs and not gen.logprobs_supported:
            raise ValueError("logprobs are not supported with speculative decoding")
        if output.prompt_logprobs and not gen.prompt_logprob_graphs:
            raise ValueError("prompt log-probabilities (echo with logprobs) are not supported here")
        if output.grammar is not None:
            if not getattr(gen, "grammar_supported", False) or self.rows is None:
                raise ValueError("structured outputs are not supported with speculative decoding")
            self.rows.grammars.check(output.grammar)
        Detokenizer(self.tokenizer, stop)  # validates the stop strings

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
        *,
        sink: Callable[[Event], None],
        seeded: bool = False,
        output: Output | None = None,
        adapter: AdapterRef | None = None,
    ) -> Request:
        """Queue one request (ValueError when invalid, :class:`QueueFull` when ``max_queue``
        requests wait already, :class:`NotReady` before :meth:`start` or after
        :meth:`shutdown`); its events go to ``sink``; ``output``: log-probabilities and stop
        token ids; ``adapter``: the LoRA adapter it runs with (None: the base model)."""
        output = output or Output()
        self.check(prompt, max_tokens, stop, sampling, output)
        if adapter is not None and (self.rows is None or self.rows.lora is None):
            raise ValueError("this server serves no LoRA adapters (start it with --enable-lora)")
        req = Request(list(prompt), max_tokens, sampling, list(stop), seeded, sink, output=output)
        req.adapter = adapter
        with self._lock:
            if not self.ready:
                raise NotReady(self.error or ("shutting down" if self._closed else "loading"))
            if self.queue_depth() >= self.max_queue:
                raise QueueFull(
                    f"{self.queue_depth()} requests are waiting (--max-queue {self.max_queue})"
                )
            self._queue.put(req)
        return req

    def shutdown(self, timeout: float | None = None) -> None:
        """Rank 0: finish the queued and running requests, then end every rank's loop."""
        with self._lock:
            self._closed = True
        if self._worker is not None:
            self._queue.put(_SHUTDOWN)
            self._worker.join(timeout)
        elif self._ready.is_set():  # the loop runs on the thread that called start()
            self._queue.put(_SHUTDOWN)
        elif self.group is not None and self.group.size > 1:
            self._broadcast(Shutdown())

    # -- the loops -------------------------------------------------------------------------
    def _work(self) -> None:
        """Rank 0: plan a lease, send it, run it; until shutdown and nothing is left."""
        closing = False
        try:
            while True:
                closing = self._take_new(block=not self._rows and not self._waiting) or closing
                if closing and not self._rows and not self._waiting:
                    break
                lease, admitted = self._lease()
                if lease is None:
                    continue
                self._broadcast(lease)
                self.stats["leases"] += 1
                self._run(lease, admitted)
            self._broadcast(Shutdown())
        except Exception as e:  # noqa: BLE001 - a bug in the engine itself: stop serving
            with self._lock:
                self.error = f"the serving engine failed: {type(e).__name__}: {e}"
                self._closed = True
            self._fail_all(self.error)

    def _take_new(self, block: bool) -> bool:
        """Move submitted requests to the waiting list (blocking while idle); True once
        shutdown was asked."""
        closing = False
        while True:
            try:
                item = self._queue.get(timeout=0.05) if block else self._queue.get_nowait()
            except queue.Empty:
                if block and not closing:
                    continue
                return closing
            block = False
            if item is _SHUTDOWN:
                closing = True
            else:
                self._waiting.append(item)

    def _lease(self) -> tuple[Lease | None, list[Request]]:
        """The next lease (cancelled slots, admitted requests, iterations to run; None when
        there is nothing to do) and the admitted requests. A request whose adapter finds no
        bank slot (all held by running requests' adapters) waits, keeping its place."""
        gen = self._model()
        cancel = [s for s, r in self._rows.items() if r.request is not None and r.request.cancelled]
        free = gen.slots - len(self._rows) + len(cancel)
        busy = {r.adapter for s, r in self._rows.items() if r.adapter >= 0 and s not in cancel}
        admit, admissions, later = [], [], []
        while self._waiting and len(admit) < free:
            req = self._waiting.popleft()
            if req.cancelled:
                self.stats["dropped"] += 1
                continue
            use = self._place(req, busy)
            if req.adapter is not None and use is None:
                later.append(req)
                continue
            admit.append(req)
            admissions.append(self._admission(req, use))
        self._waiting.extendleft(reversed(later))
        if not (cancel or admit or self._rows):
            return None, []
        self._admitting = admit  # known to _fail_all until the lease has placed them
        return Lease(tuple(cancel), tuple(admissions), self.lease_steps), admit

    def _place(self, req: Request, busy: set[int]) -> AdapterUse | None:
        """The bank slot of ``req``'s adapter (added to ``busy``); None: no adapter, or no
        slot for it now."""
        lora = self.rows.lora if self.rows is not None else None
        if req.adapter is None or lora is None:
            return None
        slot = lora.place(req.adapter.uid, busy)
        if slot is None:
            return None
        busy.add(slot)
        return AdapterUse(req.adapter.uid, req.adapter.path, slot)

    def _admission(self, req: Request, adapter: AdapterUse | None = None) -> Admission:
        """``req``'s admission, with its adapter's bank slot and its prefix-cache plan when
        caching (blocks keyed by the adapter too)."""
        admission, prefix = Admission.of(req), self.rows.prefix
        admission = dataclasses.replace(admission, adapter=adapter)
        if prefix is None or req.output.prompt_logprobs:  # every prompt position is computed
            return admission
        salt = b"" if adapter is None else f"lora:{adapter.uid}".encode()
        return dataclasses.replace(admission, prefix=prefix.plan(req.prompt, salt))

    def run_all(self, requests: Sequence[Request]) -> None:
        """Offline generation (``neuron-tp generate``): run ``requests``, the same on every
        rank, through the slots ``slots`` at a time; every rank places the same admissions
        itself, so no schedule message is sent. Their events go to their sinks here."""
        gen, rows = self._model(), self.rows
        assert rows is not None  # attached
        for first in range(0, len(requests), gen.slots):
            batch = list(requests[first : first + gen.slots])
            lease = Lease((), tuple(Admission.of(r) for r in batch), steps=2**31)
            rows.run(lease, batch)

    def follow(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Ranks > 0: run rank 0's leases until its shutdown message (or, once
        ``should_stop()`` is true, until rank 0 has been silent for 30 s)."""
        silent = 0.0
        while True:
            try:
                message = decode(host.broadcast(_KEY, None, self.group, timeout_s=1.0))
            except TimeoutError:
                silent = silent + 1.0 if should_stop() else 0.0
                if silent >= 30:
                    return
                continue
            silent = 0.0
            if isinstance(message, Shutdown):
                return
            self._run(message)

    def _broadcast(self, message: Lease | Shutdown) -> None:
        if self.group is not None and self.group.size > 1:
            host.broadcast(_KEY, encode(message), self.group)

    # -- one lease, the same on every rank -----------------------------------------------------
    def _run(self, lease: Lease, requests: list[Request] | None = None) -> None:
        """Run ``lease`` (:meth:`SlotRows.run`); ``requests`` (rank 0): its admitted ones."""
        self._model()
        self.rows.run(lease, requests)
        self._admitting = []

    def _fail_all(self, message: str) -> None:
        """Rank 0, the engine stopping: every request still known gets ``message``."""
        pending = [r.request for r in self._rows.values() if r.request is not None]
        placed = {id(r.request) for r in self._rows.values()}
        pending += list(self._waiting) + [r for r in self._admitting if id(r) not in placed]
        while not self._queue.empty():
            item = self._queue.get()
            if item is not _SHUTDOWN:
                pending.append(item)
        for req in pending:
            if not req.cancelled:
                try:
                    req.sink(Failed(message))
                except Exception:  # noqa: BLE001
                    pass
