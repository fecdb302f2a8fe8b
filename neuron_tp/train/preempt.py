"""Preemption: SIGTERM / SIGINT end a training run cleanly at a step every rank agrees on.

A pod that Kubernetes stops (node drain, spot reclaim) gets SIGTERM, then SIGKILL after the
grace period; torchrun forwards SIGTERM to its workers and SIGKILLs them 30 s later. On the
first signal :class:`StopSignal` only records it (a flag, read on the host). At every step
boundary the ranks decide together whether any of them was signalled
(:func:`neuron_tp.parallel.host.any_true`: a counter in the job's host key-value store, no
device collective and no device-to-host transfer, so no extra XLA sync); all of them then stop
after the same step, save the normal (atomic) checkpoint, release the output lock and the
command exits ``128 + signal`` (143 for SIGTERM). A second signal changes nothing: the save
goes on (a SIGKILL during it leaves the previous checkpoint as the newest complete one).

Signal handlers run on a process's main thread only. With torchrun each rank is a process
whose main thread runs the loop. With ``--xla-cpu-devices`` the ranks are threads of a child
process (``xmp.spawn``): the parent forwards the signal to it, and the child installs its
handlers on its main thread while it unpickles the :class:`StopSignal` it was passed; its rank
threads share that one flag.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignal:
    """The process's record of a stop request (SIGTERM / SIGINT), shared by its rank threads."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self._event = threading.Event()

    @property
    def requested(self) -> bool:
        """True once a signal arrived (or :meth:`request` was called)."""
        return self._event.is_set()

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Record a stop request (what the handler does; callable from any thread)."""
        if self.signum is None:
            self.signum = signum
        self._event.set()

    def exit_code(self) -> int:
        """``128 + signal`` (the shell's convention: 143 for SIGTERM, 130 for SIGINT)."""
        return 128 + int(self.signum or signal.SIGTERM)

    def _handle(self, signum: int, _frame) -> None:
        again = self.requested
        self.request(signum)
        for child in _children():  # --xla-cpu-devices: the ranks live in a child process
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass
        name = signal.Signals(signum).name
        if again:
            msg = f"{name} again: still finishing the step and saving (SIGKILL to abort)"
        else:
            msg = f"{name}: finishing this step, then saving a checkpoint and exiting"
        print(f"neuron-tp train [pid {os.getpid()}]: {msg}", file=sys.stderr, flush=True)

    def install(self) -> dict:
        """Handle SIGTERM and SIGINT with :meth:`request` (on the main thread only; elsewhere
        nothing is installed); returns the previous handlers for :meth:`restore`."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._handle) for s in SIGNALS}

    @staticmethod
    def restore(previous: dict) -> None:
        """Put back the handlers :meth:`install` replaced."""
        for s, handler in previous.items():
            signal.signal(s, handler)

    @contextmanager
    def installed(self):
        """Handlers installed for the duration of the block."""
        previous = self.install()
        try:
            yield self
        finally:
            self.restore(previous)

    def __reduce__(self):
        # Sent to the xmp.spawn child: a fresh StopSignal installed on the child's main
        # thread (unpickling runs there, before the rank threads start).
        return (_child_stop_signal, ())


def _child_stop_signal() -> StopSignal:
    """The StopSignal of an ``xmp.spawn`` child process, its handlers installed."""
    stop = StopSignal()
    stop.install()
    return stop


def _children() -> list[int]:
    """Pids of this process's multiprocessing children (the ``xmp.spawn`` worker)."""
    if "multiprocessing" not in sys.modules:
        return []
    import multiprocessing

    return [p.pid for p in multiprocessing.active_children() if p.pid]


def signal_name(stop: StopSignal | None) -> str:
    """The name of the signal ``stop`` recorded (``SIGTERM`` when another rank's was)."""
    signum = stop.signum if stop is not None else None
    return signal.Signals(signum or signal.SIGTERM).name


def stop_agreed(stop: StopSignal | None, mesh) -> bool:
    """At a step boundary: True on every rank when any rank was signalled.

    One host-store exchange per step (:func:`~neuron_tp.parallel.host.any_true`), no device
    collective; without a store (one rank, a trace-only mesh) this rank's own flag."""
    if stop is None:
        return False
    from ..parallel import host
    from ..parallel.failures import has_store

    world = mesh.group("world")
    if world.size == 1 or not has_store(world):
        return stop.requested
    return host.any_true("preempt", stop.requested, world)
