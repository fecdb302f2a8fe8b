"""The job's key-value store: a new, empty one for every torchrun attempt.

torchrun's c10d rendezvous keeps ONE store for the whole job (hosted by the leading agent,
shared across restarts), and a worker's default store is a plain client of it. Whatever a dead
attempt wrote there (gloo's addresses, store-based barrier counters, this package's host
exchanges) is still there when the next attempt starts, and the new attempt reads it before
overwriting it: a restart then fails in gloo's connect or waits forever on a stale counter.

So under torchrun every attempt gets a store of its own, whatever the run id: without
``--rdzv_id`` torchrun's run id is the string ``"none"``, and that job restarts into the same
kept store as any other. Global rank 0 starts a TCPStore on a
free port (an empty key space), writes a random nonce into it, and publishes ``address port
nonce`` in torchrun's store. The other ranks read that record, connect, and accept the store
only when its nonce matches the record's. A record left by a dead attempt names a server that
died with that attempt's rank 0 (connection refused: read the record again), or, if the new
rank 0 got the same port, a store holding another nonce (read again): nothing of an earlier
attempt can be accepted, on one node or many, whatever each node's restart count says
(torchrun counts restarts per agent: a node whose workers did not fail keeps its count).

Every wait here is bounded by :func:`startup_timeout` (``NEURON_TP_STARTUP_TIMEOUT`` seconds,
default 300): a restart that cannot work fails with the reason instead of hanging.

The process group that :func:`neuron_tp.init_mesh` creates (gloo) is built on this store; the
host exchanges of :mod:`neuron_tp.parallel.comm` use it whoever created the group (the xla
backend's own store is torch-xla's, prefixed by the agent's restart count).
"""

from __future__ import annotations

import atexit
import datetime
import os
import socket
import threading
import time
import uuid

_lock = threading.Lock()
_state: dict[str, object] = {}  # "store": this attempt's store, "boot": torchrun's (kept open)
RECORD = "ntp/attempt-store/{run}/{world}"
NONCE = "ntp/attempt-nonce"
JOB = "ntp/job/{run}/{world}"  # set once by the first attempt's rank 0: the job's identity
ATTEMPT_JOB = "ntp/job"  # the same identity, copied into each attempt's store


def env_seconds(name: str, default: float) -> float:
    """A positive number of seconds from the environment variable ``name`` (``default``
    when unset); ValueError naming it otherwise."""
    raw = os.environ.get(name, str(default))
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise ValueError(f"{name}={raw!r}: give a positive number of seconds")
    return value


def startup_timeout() -> float:
    """Seconds any start-up wait may take (``NEURON_TP_STARTUP_TIMEOUT``, default 300)."""
    return env_seconds("NEURON_TP_STARTUP_TIMEOUT", 300)


def under_torchrun() -> bool:
    """True in a worker started by torchrun: torchelastic always sets a run id (``"none"``
    when ``--rdzv_id`` is not given, which is a run id like any other here)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and (
        "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ
    )


def record_key(run: str, world: int) -> str:
    """Where rank 0 publishes this attempt's store in torchrun's: per run id and world size,
    so jobs of other sizes, or of another run id, on one rendezvous store never read it."""
    return RECORD.format(run=run, world=world)


def job_id() -> str | None:
    """This torchrun job's identity, the same on every rank and in every attempt (the run id
    and a nonce the job's first attempt left in torchrun's kept store); None before
    :func:`attempt_store` or outside torchrun. Unlike the run id it tells two jobs apart
    that both run without ``--rdzv_id``."""
    job = _state.get("job")
    return job if isinstance(job, str) else None


def _bootstrap_store(rank: int, world: int, timeout: datetime.timedelta):
    """torchrun's store: the initialised process group's, else a new client (env://)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    store, _, _ = next(dist.rendezvous("env://", rank=rank, world_size=world, timeout=timeout))
    return store


def _serve(boot, key: str, job_key: str, timeout: datetime.timedelta):
    """Rank 0: start this attempt's store and publish where it is (the job's identity,
    chosen by its first attempt, copied into it)."""
    import torch.distributed as dist

    addr = os.environ["MASTER_ADDR"]
    fresh = dist.TCPStore(addr, 0, None, True, timeout, wait_for_workers=False)
    if not boot.check([job_key]):
        boot.compare_set(job_key, "", uuid.uuid4().hex)  # kept by every later attempt
    fresh.set(ATTEMPT_JOB, bytes(boot.get(job_key)).decode())
    nonce = uuid.uuid4().hex
    fresh.set(NONCE, nonce)
    boot.set(key, f"{addr} {fresh.port} {nonce}")
    return fresh


def _listening(addr: str, port: int) -> None:
    """OSError unless something accepts connections at ``addr:port``."""
    with socket.create_connection((addr, port), timeout=2.0):
        pass


def _join(boot, key: str, run: str, timeout_s: float):
    """A rank other than 0: connect to the store whose record carries a matching nonce."""
    import torch.distributed as dist

    deadline = time.monotonic() + timeout_s
    tried, pause, why = None, 0.01, "no record yet"
    while time.monotonic() < deadline:
        record = bytes(boot.get(key)).decode() if boot.check([key]) else None
        if record is not None and record != tried:
            tried = record
            addr, port, nonce = record.split()
            probe = datetime.timedelta(seconds=min(5.0, max(0.1, deadline - time.monotonic())))
            try:
                _listening(addr, int(port))  # a dead server: refused at once, no client retries
                client = dist.TCPStore(addr, int(port), None, False, probe)
                if bytes(client.get(NONCE)).decode() == nonce:
                    client.set_timeout(datetime.timedelta(seconds=timeout_s))
                    return client
                why = f"{addr}:{port} holds another attempt's store"
            except (RuntimeError, OSError) as e:  # a dead attempt's server: read again
                why = f"{addr}:{port}: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
        time.sleep(pause)
        pause = min(pause * 2, 0.2)
    raise RuntimeError(
        f"torchrun job {run!r}: rank 0 did not publish this attempt's key-value store within "
        f"{timeout_s:g} s (last: {why}). Rank 0 failed or is stuck before init_mesh; look for "
        "its error above (raise NEURON_TP_STARTUP_TIMEOUT if its start-up is only slow)"
    )


def attempt_store(rank: int, world: int):
    """This torchrun attempt's own store (made once per process; see the module doc)."""
    with _lock:
        if "store" in _state:
            return _state["store"]
        timeout_s = startup_timeout()
        timeout = datetime.timedelta(seconds=timeout_s)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        boot = _bootstrap_store(rank, world, timeout)
        key, job_key = record_key(run, world), JOB.format(run=run, world=world)
        if rank == 0:
            fresh = _serve(boot, key, job_key, timeout)
        else:
            fresh = _join(boot, key, run, timeout_s)
        job = f"{run}:{bytes(fresh.get(ATTEMPT_JOB)).decode()}"
        _state.update(store=fresh, boot=boot, job=job)
        addr, port = bytes(boot.get(key)).decode().split()[:2]
        beat = threading.Thread(target=_beat, args=(addr, int(port), rank), daemon=True)
        beat.start()
        atexit.register(_stop_beat, beat)
        return fresh


HEARTBEAT = "ntp/alive/{rank}"
BEAT_S, SILENT_S = 1.0, 15.0  # a rank's heartbeat period; a peer silent this long is gone
_beat_stop = threading.Event()


def _beat(addr: str, port: int, rank: int) -> None:
    """This rank's heartbeat (a daemon thread with its own connection): a counter bumped every
    ``BEAT_S`` until :func:`_stop_beat`. Stops silently when the store goes away."""
    import torch.distributed as dist

    try:
        client = dist.TCPStore(addr, port, None, False, datetime.timedelta(seconds=5))
        while not _beat_stop.is_set():
            _listening(addr, port)  # a server gone (rank 0 exited): stop without a C++ warning
            client.add(HEARTBEAT.format(rank=rank), 1)
            _beat_stop.wait(BEAT_S)
    except Exception:  # noqa: BLE001  (the store's server is gone: nothing left to tell)
        return


def stop_heartbeat() -> None:
    """End this rank's heartbeat now (a rank leaving with an error: rank 0's store may go
    first, and a beat against it would print the store client's warning)."""
    _beat_stop.set()


def _stop_beat(beat: threading.Thread) -> None:
    """At interpreter exit: end the heartbeat thread before Python finalizes. A daemon thread
    still inside the store client's C++ code when the interpreter goes away is unwound through
    a noexcept frame, and the process aborts ("terminate called without an active exception")
    after the job itself succeeded."""
    _beat_stop.set()
    beat.join(timeout=10.0)


class Liveness:
    """A waiter's view of its peers' heartbeats: which of ``ranks`` stopped beating."""

    def __init__(self, store, ranks) -> None:
        self.store, self.ranks = store, list(ranks)
        self.seen: dict[int, tuple[int, float]] = {}  # rank -> (count, when it last changed)

    def gone(self) -> list[int]:
        """Ranks whose heartbeat, once seen, has not moved for ``SILENT_S`` seconds."""
        if "store" not in _state or self.store is not _state["store"]:
            return []  # no heartbeats (not under torchrun)
        now, out = time.monotonic(), []
        for r in self.ranks:
            key = HEARTBEAT.format(rank=r)
            if not self.store.check([key]):
                continue  # not started yet: the start-up timeout bounds that
            count = self.store.add(key, 0)
            last = self.seen.get(r)
            if last is None or last[0] != count:
                self.seen[r] = (count, now)
            elif now - last[1] > SILENT_S:
                out.append(r)
        return out


def wait_keys(store, keys: list[str], timeout_s: float, what: str, ranks) -> None:
    """Wait until every key of ``keys`` exists: up to ``timeout_s``, and no longer once a rank
    of ``ranks`` has stopped beating (its process died: torchrun restarts the job). Polls, so
    the main thread's signal handlers run meanwhile."""
    if store.check(keys):
        return
    deadline = time.monotonic() + timeout_s
    alive, pause, next_look = Liveness(store, ranks), 0.0005, time.monotonic() + BEAT_S
    while not store.check(keys):
        now = time.monotonic()
        if now >= deadline:
            missing = f"not every rank of {list(ranks)} arrived in {timeout_s:g} s"
            raise TimeoutError(f"{what}: {missing}")
        if now >= next_look:
            next_look = now + BEAT_S
            gone = alive.gone()
            if gone:
                raise RuntimeError(
                    f"{what}: rank {', '.join(map(str, gone))} stopped (no heartbeat for "
                    f"{SILENT_S:g} s): its process died or hangs; look for its error above"
                )
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def job_store():
    """The store host exchanges use: this attempt's own under torchrun, else the default
    process group's (an in-memory one for the threads of ``xmp.spawn``)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("host collectives need an initialised process group (init_mesh)")
    if "store" in _state:
        return _state["store"]
    if under_torchrun():
        return attempt_store(dist.get_rank(), dist.get_world_size())
    return dist.distributed_c10d._get_default_store()
