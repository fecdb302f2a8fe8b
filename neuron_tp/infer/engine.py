"""The serving engine: requests batched into a :class:`~.generate.Generator`, on every tp rank.

Rank 0 owns the request queue. Its worker thread takes the oldest request, waits a few
milliseconds for concurrent ones with the same sampling parameters (up to the largest batch
bucket), broadcasts the batch to the other tp ranks (:func:`neuron_tp.parallel.comm.host_broadcast`)
and runs it; the other ranks run the same batch in :meth:`Engine.follow`. Everything that
ends a sequence early (EOS, a stop string, the request's own ``max_tokens`` below the batch's)
is decided from the batch and the generated tokens alone, which every rank has: all ranks run
the same detokenizers and set the same ``stopped`` flags, with nothing exchanged per token.

Requests with an explicit sampling seed run alone, so a seed reproduces a completion
whatever else the server is doing (a batch draws its noise per row).
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from ..parallel import comm
from .generate import Generator, Sampling
from .text import Detokenizer

Event = dict  # {"type": "delta", "text"} | {"type": "done", "finish_reason", usage} | "error"
_SHUTDOWN = object()
_KEY = "serve"


class NotReady(RuntimeError):
    """The engine has no model yet (loading, warming up) or is shutting down."""


class QueueFull(RuntimeError):
    """``max_queue`` requests already wait: the request is refused (retry later)."""


@dataclass
class Request:
    """One sequence to generate; ``sink`` receives its events (called on the worker thread)."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    stop: list[str]
    seeded: bool
    sink: Callable[[Event], None]
    cancelled: bool = False  # the client went away: its row runs on, its output is dropped
    created: float = field(default_factory=time.monotonic)

    def cancel(self) -> None:
        self.cancelled = True

    def batch_key(self) -> tuple:
        """Requests with equal keys may share a batch (seeded ones never do)."""
        s = self.sampling
        if self.seeded:
            return ("seeded", id(self))
        return (s.do_sample, s.temperature, s.top_k) if s.do_sample else (False,)


class Engine:
    """Batched generation for a server, on every tp rank of ``group`` (None: one rank).

    Lifecycle: :meth:`attach` the generator, :meth:`warmup` (all ranks), then rank 0
    :meth:`start` s the worker and :meth:`submit` s requests while the other ranks
    :meth:`follow`; rank 0's :meth:`shutdown` ends every rank's loop."""

    def __init__(self, group=None, wait_s: float = 0.005, max_queue: int | None = None):
        self.group, self.wait_s = group, wait_s
        self.max_queue = max_queue  # the most requests that may wait (None: no bound)
        self._running = 0  # requests of the batch that runs
        self.rank = group.rank if group is not None else 0
        self.gen: Generator | None = None
        self.tokenizer = None
        self.eos_ids: list[int] = []
        self._queue: queue.Queue = queue.Queue()
        self._pending: deque[Request] = deque()
        self._worker: threading.Thread | None = None
        self._ready = threading.Event()
        self._closed = False
        self.error: str | None = None  # set when generation failed: the engine stopped
        self._lock = threading.Lock()  # submitting vs. failing: no request is left behind
        # rank 0: batches run, largest batch, events dropped for clients that went away
        self.stats = {"batches": 0, "max_batch": 0, "dropped": 0}

    # -- setup ---------------------------------------------------------------------------
    def attach(self, gen: Generator, tokenizer, eos_ids: Sequence[int]) -> None:
        """Give the engine its model (a generator on this rank's device)."""
        self.gen, self.tokenizer, self.eos_ids = gen, tokenizer, list(eos_ids)

    def warmup(self, every_shape: bool = False) -> None:
        """Capture the prefill and decode graphs of the smallest shapes (``every_shape``: of
        every batch and length bucket), greedy and sampled without top-k; every rank, in the
        same order. Shapes not captured here are captured by the first request needing them."""
        gen = self._model()
        batches = gen.batch_buckets or [1]
        shapes = (
            [(b, n) for b in batches for n in gen.buckets] if every_shape else [(batches[0], 1)]
        )
        for batch, length in shapes:
            prompts = [[gen.pad_id] * length] * batch
            for sampling in (Sampling(), Sampling(do_sample=True)):
                for _ in gen.stream(prompts, min(2, gen.max_new_tokens), sampling, ()):
                    pass

    def start(self) -> None:
        """Rank 0: start the worker; the engine is ready."""
        self._model()
        self._worker = threading.Thread(target=self._work, name="engine", daemon=True)
        self._worker.start()
        self._ready.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and not self._closed

    def _model(self) -> Generator:
        if self.gen is None:
            raise NotReady("the model is not loaded yet")
        return self.gen

    # -- requests (rank 0) ---------------------------------------------------------------
    @property
    def max_tokens_limit(self) -> int:
        return self._model().max_new_tokens

    def check(self, prompt: list[int], max_tokens: int, stop: Sequence[str]) -> None:
        """ValueError naming what is wrong with a request (nothing runs)."""
        gen = self._model()
        try:
            gen.check([prompt], max_tokens)
        except ValueError as e:
            raise ValueError(str(e).replace("max_new_tokens", "max_tokens")) from None
        Detokenizer(self.tokenizer, stop)  # validates the stop strings

    def submit(
        self,
        prompt: list[int],
        max_tokens: int,
        sampling: Sampling,
        stop: Sequence[str],
        sink: Callable[[Event], None],
        seeded: bool = False,
    ) -> Request:
        """Queue one request (ValueError when invalid, :class:`NotReady` before
        :meth:`start` or after :meth:`shutdown`, :class:`QueueFull` when ``max_queue``
        requests already wait); its events go to ``sink``."""
        self.check(prompt, max_tokens, stop)
        req = Request(list(prompt), max_tokens, sampling, list(stop), seeded, sink)
        with self._lock:
            if not self.ready:
                raise NotReady(self.error or ("shutting down" if self._closed else "loading"))
            if self.max_queue is not None and self.queue_depth() >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting")
            self._queue.put(req)
        return req

    def queue_depth(self) -> int:
        """Requests submitted and not yet running (rank 0)."""
        return self._queue.qsize() + len(self._pending)

    def slots_in_use(self) -> int:
        """Requests of the batch that runs (rank 0)."""
        return self._running

    def shutdown(self, timeout: float | None = None) -> None:
        """Rank 0: finish the queued requests, then end every rank's loop."""
        self._closed = True
        if self._worker is not None:
            self._queue.put(_SHUTDOWN)
            self._worker.join(timeout)
        elif self.group is not None and self.group.size > 1:
            self._broadcast({"op": "shutdown"})

    # -- the loops -------------------------------------------------------------------------
    def _work(self) -> None:
        batch: list[Request] = []
        try:
            while (batch := self._next_batch()) is not None:
                spec = _spec(batch, self.eos_ids)
                self.stats["batches"] += 1
                self.stats["max_batch"] = max(self.stats["max_batch"], len(batch))
                self._broadcast(spec)
                self._running = len(batch)
                self._run(spec, batch)
                self._running = 0
            self._broadcast({"op": "shutdown"})
        except Exception as e:  # noqa: BLE001 - the ranks may be out of step: stop serving
            with self._lock:
                self.error = f"generation failed: {type(e).__name__}: {e}"
                self._closed = True
            self._pending.extend(batch or ())
            while not self._queue.empty():
                item = self._queue.get()
                if item is not _SHUTDOWN:
                    self._pending.append(item)
            for r in self._pending:
                self._emit(r, {"type": "error", "message": self.error})

    def follow(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Ranks > 0: run rank 0's batches until its shutdown message (or, once
        ``should_stop()`` is true, until rank 0 has been silent for 30 s)."""
        silent = 0.0
        while True:
            try:
                spec = json.loads(comm.host_broadcast(_KEY, None, self.group, timeout_s=1.0))
            except TimeoutError:
                silent = silent + 1.0 if should_stop() else 0.0
                if silent >= 30:
                    return
                continue
            silent = 0.0
            if spec["op"] == "shutdown":
                return
            self._run(spec, None)

    def _broadcast(self, message: dict) -> None:
        if self.group is not None and self.group.size > 1:
            comm.host_broadcast(_KEY, json.dumps(message).encode(), self.group)

    def _next_batch(self) -> list[Request] | None:
        """The oldest request and queued ones batchable with it; None on shutdown."""
        if not self._pending:
            item = self._queue.get()
            if item is _SHUTDOWN:
                return None
            self._pending.append(item)
        limit = self.gen.batch_buckets[-1] if self.gen.batch_buckets else 1
        deadline = time.monotonic() + self.wait_s
        key = self._pending[0].batch_key()
        stop_seen = False
        while not stop_seen and sum(r.batch_key() == key for r in self._pending) < limit:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is _SHUTDOWN:
                stop_seen = True
            else:
                self._pending.append(item)
        if stop_seen:
            self._queue.put(_SHUTDOWN)  # after what is pending
        batch = [r for r in self._pending if r.batch_key() == key][:limit]
        self._pending = deque(r for r in self._pending if not any(r is b for b in batch))
        return batch

    def _emit(self, req: Request, event: Event) -> None:
        """Give ``event`` to its client, unless it went away (then the event is dropped)."""
        if not req.cancelled:
            try:
                req.sink(event)
                return
            except Exception:  # noqa: BLE001 - a consumer that went away must not stop others
                req.cancel()
        self.stats["dropped"] += 1

    def _run(self, spec: dict, requests: list[Request] | None) -> None:
        """Generate one batch; ``requests`` (rank 0) receive the events."""
        gen, n = self._model(), len(spec["prompts"])
        detok = [Detokenizer(self.tokenizer, s) for s in spec["stop"]]
        stopped, counts = [False] * n, [0] * n
        eos = set(spec["eos"])

        def finish(i: int, reason: str) -> None:
            stopped[i] = True
            if requests is not None:
                rest = detok[i].finish()
                if rest:
                    self._emit(requests[i], {"type": "delta", "text": rest})
                usage = {"prompt_tokens": len(spec["prompts"][i]), "completion_tokens": counts[i]}
                self._emit(requests[i], {"type": "done", "finish_reason": reason, **usage})

        sampling = Sampling(**spec["sampling"])
        for column in gen.stream(
            spec["prompts"], spec["max_new_tokens"], sampling, spec["eos"], stopped
        ):
            for i, t in enumerate(column):
                if t is None or stopped[i]:
                    continue
                counts[i] += 1
                text = "" if t in eos else detok[i].add(t)
                if text and requests is not None:
                    self._emit(requests[i], {"type": "delta", "text": text})
                if t in eos or detok[i].stopped:
                    finish(i, "stop")
                elif counts[i] >= spec["max_tokens"][i]:
                    finish(i, "length")
        for i in range(n):
            if not stopped[i]:
                finish(i, "length")


def _spec(batch: list[Request], eos_ids: list[int]) -> dict:
    """What every rank needs to run ``batch`` (JSON: sent to the other tp ranks)."""
    sampling = batch[0].sampling
    if sampling.do_sample and not batch[0].seeded:
        sampling = Sampling(True, sampling.temperature, sampling.top_k, random.getrandbits(31))
    return {
        "op": "batch",
        "prompts": [r.prompt for r in batch],
        "max_tokens": [r.max_tokens for r in batch],
        "max_new_tokens": max(r.max_tokens for r in batch),
        "sampling": asdict(sampling),
        "eos": eos_ids,
        "stop": [r.stop for r in batch],
    }
