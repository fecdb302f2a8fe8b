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

A Python signal handler runs only when the main thread runs Python: a rank blocked inside a
collective whose peer is gone (a dead attempt's, when torchrun restarts the job) would never
see the signal, and torchrun's SIGTERM would leave it behind. So a rank process also watches
the signal from a thread of its own (:func:`signal.set_wakeup_fd`: the C-level handler writes
the signal number to a pipe whatever the main thread is doing): when the loop has not reached
an agreed stop at a step boundary within ``NEURON_TP_STOP_GRACE`` seconds of the signal
(default 10), the process exits ``128 + signal`` at once, without a checkpoint (the newest
complete one stays the one to resume from). Once the ranks agreed to stop, or the loop is over,
the save runs to its end.

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
_WAKE_STOP = 0  # the byte that ends the watchdog thread (no signal has number 0)


def stop_grace() -> float:
    """Seconds a signalled rank may take to reach an agreed stop (``NEURON_TP_STOP_GRACE``,
    default 10) before it exits without a checkpoint."""
    from ..parallel.store import env_seconds

    return env_seconds("NEURON_TP_STOP_GRACE", 10)


class StopSignal:
    """The process's record of a stop request (SIGTERM / SIGINT), shared by its rank threads."""

    def __init__(self) -> None:
        self.signum: int | None = None  # the first signal received
        self._event = threading.Event()
        self._settled = threading.Event()  # the loop agreed to stop, or is over
        self._wake: tuple[int, int] | None = None  # the watchdog's pipe (read, write)

    @property
    def requested(self) -> bool:
        """True once a signal arrived (or :meth:`request` was called)."""
        return self._event.is_set()

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Record a stop request (what the handler does; callable from any thread)."""
        if self.signum is None:
            self.signum = signum
        self._event.set()

    def settle(self) -> None:
        """The loop reached an agreed stop (or its end): from here the process ends on its
        own, and the watchdog lets the save finish."""
        self._settled.set()

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

    def install(self, watchdog: bool = False) -> dict:
        """Handle SIGTERM and SIGINT with :meth:`request` (on the main thread only; elsewhere
        nothing is installed); returns the previous handlers for :meth:`restore`.
        ``watchdog``: also bound the time to an agreed stop (see the module doc), in a
        process whose main thread runs a rank's loop."""
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict = {s: signal.signal(s, self._handle) for s in SIGNALS}
        if watchdog:
            grace = stop_grace()
            read, write = os.pipe()
            os.set_blocking(write, False)
            previous["wakeup_fd"] = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            self._wake = (read, write)
            threading.Thread(target=self._watch, args=(read, grace), daemon=True).start()
        return previous

    def restore(self, previous: dict) -> None:
        """Put back the handlers :meth:`install` replaced (and end its watchdog)."""
        if "wakeup_fd" in previous:
            signal.set_wakeup_fd(previous.pop("wakeup_fd"))
        if self._wake is not None:
            os.write(self._wake[1], bytes([_WAKE_STOP]))
            os.close(self._wake[1])
            self._wake = None
        for s, handler in previous.items():
            signal.signal(s, handler)

    def _watch(self, fd: int, grace: float) -> None:
        """The watchdog thread: after a signal, exit the process unless the loop settles
        within ``grace`` seconds (its main thread may be blocked in a collective that can
        never finish, where no Python handler runs)."""
        try:
            while True:
                data = os.read(fd, 64)
                if not data or _WAKE_STOP in data:
                    return
                if self._settled.wait(grace):
                    continue  # the save runs to its end; read on until restore
                name = signal.Signals(data[0]).name
                msg = (
                    f"neuron-tp train [pid {os.getpid()}]: {name}: no agreed stop at a step "
                    f"boundary within {grace:g} s (NEURON_TP_STOP_GRACE): this rank is blocked "
                    "(in a collective whose peer is gone?); exiting without a checkpoint, the "
                    "newest complete one stays\n"
                )
                os.write(2, msg.encode())
                os._exit(128 + data[0])
        finally:
            os.close(fd)

    @contextmanager
    def installed(self, watchdog: bool = False):
        """Handlers (and with ``watchdog`` the watchdog) installed for the block."""
        previous = self.install(watchdog)
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
        agreed = stop.requested
    else:
        agreed = host.any_true("preempt", stop.requested, world)
    if agreed:
        stop.settle()
    return agreed
