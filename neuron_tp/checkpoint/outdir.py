"""The output directory of a training job, checked before training starts.

- writable (every rank creates, writes, fsyncs and removes a probe file);
- held by one job at a time: a lock file with pid, host and start time, kept fresh by a
  heartbeat and released at exit. A lock whose holder is gone (a dead pid on this host, a
  reused pid, a rebooted host, an earlier attempt of the same torchrun job, e.g. an elastic
  restart that put rank 0 on another node, or no heartbeat for ``stale_after`` seconds) is
  taken over with a warning; a live one makes the second job fail naming the holder;
- the run's planned checkpoints do not collide or interleave with later existing ones.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
import warnings

from .format import CheckpointError, step_dirs, step_name

LOCK_NAME = "neuron-tp.lock"
_held: set[str] = set()  # tokens of the locks this process holds


def check_writable(directory: str, tag: str = "") -> None:
    """Create ``directory`` if needed and write a file into it; ValueError saying why not."""
    try:
        os.makedirs(directory, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        above = directory
        while above and not os.path.lexists(above):
            above = os.path.dirname(above)
        raise CheckpointError(
            f"{above or directory} is a file, not a directory: cannot create "
            f"{directory}; choose another --output-dir"
        ) from None
    except OSError as e:
        raise CheckpointError(
            f"cannot create {directory}: {e.strerror or e} "
            f"({e.filename or directory}); choose a writable --output-dir"
        ) from None
    probe = os.path.join(directory, f".write-test-{socket.gethostname()}-{os.getpid()}{tag}")
    try:
        with open(probe, "wb") as fh:
            fh.write(b"neuron_tp write test\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"cannot write into {directory}: {e.strerror or e}; choose a writable --output-dir"
        ) from None


def _proc_start(pid: int) -> str | None:
    """Start time of process ``pid`` (clock ticks since boot; None when unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return None


def _run_id() -> str | None:
    """This torchrun job's identity, the same for every restart of one job: the attempt
    store's (:func:`neuron_tp.parallel.store.job_id`, which also tells apart two jobs run
    without ``--rdzv_id``), else an explicit ``--rdzv_id``; None outside torchrun."""
    from ..parallel.store import job_id

    rid = job_id() or os.environ.get("TORCHELASTIC_RUN_ID", "")
    return rid if rid not in ("", "none") else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutputLock:
    """Exclusive use of an output directory by one job (taken by rank 0)."""

    def __init__(self, directory: str, stale_after: float = 900.0, heartbeat: float = 60.0):
        self.path = os.path.join(directory, LOCK_NAME)
        self.stale_after, self.heartbeat = stale_after, heartbeat
        self.token: str | None = None
        self._stop = threading.Event()

    def _record(self) -> dict:
        pid = os.getpid()
        return {
            "pid": pid,
            "host": socket.gethostname(),
            "boot_id": _boot_id(),
            "proc_start": _proc_start(pid),
            "token": self.token,
            "run_id": _run_id(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
            "argv": sys.argv[:8],
        }

    def _read_holder(self) -> dict | None:
        for _ in range(20):  # a lock being written by its creator: wait for the content
            try:
                with open(self.path) as fh:
                    return json.load(fh)
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                time.sleep(0.05)
        return {}

    def _why_stale(self, h: dict) -> str | None:
        """Why the lock described by ``h`` has no live holder (None: it may be alive)."""
        if _run_id() and h.get("run_id") == _run_id() and h.get("token") not in _held:
            return f"an earlier attempt of this job (torchrun run id {_run_id()})"
        if h.get("host") == socket.gethostname() and "pid" in h:
            pid = int(h["pid"])
            if h.get("boot_id") and _boot_id() and h["boot_id"] != _boot_id():
                return "this host rebooted since"
            if pid == os.getpid() and h.get("token") not in _held:
                return f"pid {pid} is this process now"
            if not _pid_alive(pid):
                return f"pid {pid} is not running"
            if h.get("proc_start") and _proc_start(pid) not in (None, h["proc_start"]):
                return f"pid {pid} is now another process"
            return None
        try:
            age = time.time() - os.path.getmtime(self.path)
        except OSError:
            return None
        if age > self.stale_after:
            return f"no heartbeat for {age:.0f} s"
        return None

    def acquire(self) -> str | None:
        """Take the lock; returns a warning when a stale lock was taken over. Raises
        :class:`CheckpointError` naming the holder when another job holds it."""
        self.token = uuid.uuid4().hex
        note = None
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read_holder()
                if holder is None:
                    continue  # released meanwhile
                why = self._why_stale(holder)
                if why is None:
                    raise CheckpointError(self._held_message(holder)) from None
                stale = f"{self.path}.stale-{self.token}"
                try:
                    os.replace(self.path, stale)  # one taker wins; the others retry
                    os.remove(stale)
                except FileNotFoundError:
                    continue
                note = (
                    f"took over the stale lock {self.path} of pid {holder.get('pid')} on "
                    f"{holder.get('host')} (since {holder.get('started')}): {why}"
                )
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(self._record(), fh)
                fh.flush()
                os.fsync(fh.fileno())
            _held.add(self.token)
            threading.Thread(target=self._beat, daemon=True).start()
            if note:
                warnings.warn(note, RuntimeWarning, stacklevel=2)
            return note
        raise CheckpointError(
            f"could not take the lock {self.path} (it keeps changing): is "
            "another job starting in the same --output-dir?"
        )

    def _held_message(self, h: dict) -> str:
        if not h:
            return (
                f"{self.path} exists but is unreadable: another job may be using this "
                f"--output-dir; if none is, delete {self.path}"
            )
        return (
            f"--output-dir {os.path.dirname(self.path)} is in use by another job: "
            f"{self.path} is held by pid {h.get('pid')} on host {h.get('host')} since "
            f"{h.get('started')} (command: {' '.join(map(str, h.get('argv') or []))}). "
            f"Use another --output-dir, or wait for that job; if it is no longer running, "
            f"delete {self.path}"
        )

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        """Remove the lock if this object still holds it (idempotent)."""
        self._stop.set()
        if self.token not in _held:
            return
        _held.discard(self.token)
        holder = self._read_holder()
        if holder and holder.get("token") == self.token:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def check_resume_plan(
    root: str, resumed: str | None, start: int, steps: int, save_every: int
) -> None:
    """Refuse a run whose checkpoints would collide or interleave with later ones in
    ``root``: it resumes at step ``start`` (from ``resumed``) and saves every ``save_every``
    steps (0: only at the end) up to ``steps``."""
    if start >= steps:
        return  # nothing to train: nothing is saved
    later = [s for s in step_dirs(root) if s > start]
    if not later:
        return
    planned = {s for s in range(start + 1, steps + 1) if save_every and s % save_every == 0}
    clash = sorted((planned | {steps}) & set(later))
    names = ", ".join(step_name(s) for s in later)
    src = f"resuming from {resumed} (step {start})" if resumed else "starting at step 0"
    collide = (
        f" This run (--steps {steps} --save-every {save_every}) would write "
        f"{', '.join(step_name(s) for s in clash)} again, and checkpoints are never "
        "overwritten."
        if clash
        else ""
    )
    raise CheckpointError(
        f"{src}, but {root} already holds later checkpoints: {names}.{collide} The run's "
        "checkpoints would mix with those (--keep-last and --resume auto go by step number). "
        "Continue from the newest with --resume auto, branch off into a new --output-dir "
        "(--resume accepts a checkpoint anywhere), or move the later step directories away."
    )
