"""Bound every check in time: a rank stuck in a collective is reported, never left hanging.

Each rank (a process under torchrun, a thread with ``--xla-cpu-devices``) tells the one
:class:`Watchdog` of its process what it is doing (:meth:`Watchdog.doing`: which check, which
collective on which group in which dtype). When a check runs longer than the timeout, the
watchdog prints what every stuck rank of this process was doing and ends the process with
status 1 (``os._exit``: a thread blocked in a collective cannot be interrupted).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator

HINT = (
    "a rank never arrived in this collective (it failed, hangs, or runs different code), "
    "or the link is down: look for an earlier error on another rank; on Neuron check "
    "`neuron-top`/`neuron-ls` and, across nodes, the EFA setup (FI_PROVIDER=efa)"
)


class Watchdog:
    """One per process; :meth:`check` and :meth:`doing` are called by every rank."""

    def __init__(self, timeout_s: float, poll_s: float = 0.1):
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._lock = threading.Lock()
        self._started: dict[int, tuple[float, int, str]] = {}  # thread -> (start, rank, check)
        self._what: dict[int, str] = {}
        self._stage: dict[int, tuple[float, float]] = {}  # thread -> (start, limit) of doing()
        self._thread: threading.Thread | None = None

    @contextlib.contextmanager
    def check(self, name: str, rank: int) -> Iterator[None]:
        """Run one check of rank ``rank`` under the timeout."""
        me = threading.get_ident()
        with self._lock:
            self._started[me] = (time.monotonic(), rank, name)
            self._what[me] = "its own computation (no collective)"
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, daemon=True)
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                self._started.pop(me, None)
                self._what.pop(me, None)

    @contextlib.contextmanager
    def doing(self, what: str, limit_s: float | None = None) -> Iterator[None]:
        """Say what this rank does now (e.g. ``all_reduce on the tp group [0, 1], bf16``);
        ``limit_s``: a shorter bound for this step alone (see ``Context.stage_limit``)."""
        me = threading.get_ident()
        with self._lock:
            before = self._what.get(me)
            self._what[me] = what
            if limit_s is not None:
                self._stage[me] = (time.monotonic(), limit_s)
        try:
            yield
        finally:
            with self._lock:
                self._stage.pop(me, None)
                if me in self._started:
                    self._what[me] = before or ""

    def _bound(self, thread: int, start: float, now: float) -> float:
        """The bound (seconds) ``thread`` has exceeded, 0.0 when none."""
        if now - start > self.timeout_s:
            return self.timeout_s
        stage = self._stage.get(thread)
        return stage[1] if stage and now - stage[0] > stage[1] else 0.0

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            now = time.monotonic()
            with self._lock:
                stuck = [
                    (rank, name, self._what.get(t, ""), self._bound(t, start, now))
                    for t, (start, rank, name) in self._started.items()
                    if self._bound(t, start, now)
                ]
            if stuck:
                # One write per report, so the reports of ranks in other processes sharing
                # the stream interleave by whole lines, never inside one.
                lines = [
                    f"FAIL {name:<12} TIMEOUT after {bound:g} s on rank {rank}: "
                    f"{what} did not return"
                    for rank, name, what, bound in sorted(stuck)
                ]
                lines.append(f"     what to try: {HINT}; raise --timeout if the check is only slow")
                lines.append("selftest: FAIL (timeout)")
                sys.stdout.flush()
                sys.stderr.flush()
                os.write(2, ("\n".join(lines) + "\n").encode())
                os._exit(1)
