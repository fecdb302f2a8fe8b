"""Host exchanges: small byte payloads shared by the ranks of a group through the job's
key-value store (:mod:`.store`), never through a device collective. Usable while a device
graph is pending (e.g. to compare graphs before running them) and on every backend.

Every rank of a group calls the same functions with the same ``key`` sequence. Calls are
numbered per (kind, key, group) and per rank (:func:`_round`; ranks may be threads of one
process), so a later exchange never reads an earlier one's keys; each kind deletes its keys
once every rank has read them. Waits poll (signal handlers run meanwhile) and fail within
seconds when a peer's heartbeat stops (:func:`.store.wait_keys`).
"""

from __future__ import annotations

import threading
import time

from .mesh import Group
from .store import job_store, wait_keys

__all__ = ["all_gather", "any_true", "broadcast"]

_rounds = threading.local()  # per rank: (kind, key, ranks, ...) -> the last round number


def _round(kind: str, key: str, group: Group, *extra: object) -> tuple[int, str]:
    """The next round number of this exchange on this rank, and the prefix of its keys."""
    counts = _rounds.__dict__.setdefault("counts", {})
    ident = (kind, key, group.ranks, *extra)
    n = counts[ident] = counts.get(ident, -1) + 1
    tail = "".join(f"/{e}" for e in extra)
    return n, f"ntp/{kind}/{key}/{'-'.join(map(str, group.ranks))}{tail}/{n}"


def _pending(kind: str, key: str, group: Group) -> list:
    """This rank's list of rounds of (kind, key, group) whose keys are not deleted yet."""
    return _rounds.__dict__.setdefault("pending", {}).setdefault((kind, key, group.ranks), [])


def all_gather(key: str, payload: bytes, group: Group, timeout_s: float = 600.0) -> list[bytes]:
    """Every group rank's ``payload``, in group order."""
    if group.size == 1:
        return [payload]
    store = job_store()
    _, prefix = _round("gather", key, group)
    store.set(f"{prefix}/{group.ranks[group.rank]}", payload)
    keys = [f"{prefix}/{r}" for r in group.ranks]
    wait_keys(store, keys, timeout_s, f"host exchange {key!r}", group.ranks)
    return [bytes(store.get(k)) for k in keys]


def any_true(key: str, flag: bool, group: Group, timeout_s: float = 600.0) -> bool:
    """True on every rank of ``group`` when any rank passed ``flag``. O(1) store requests per
    rank: each adds ``1 + size * flag`` to one counter; the arrival that brings the count of
    arrivals to ``size`` (``total % size == 0``) publishes the answer, the others wait for it.
    Two rounds later its keys are deleted (every rank has read the answer by then)."""
    if group.size == 1:
        return flag
    store = job_store()
    n, prefix = _round("any", key, group)
    total = store.add(f"{prefix}/n", 1 + group.size * int(bool(flag)))
    if total % group.size == 0:  # the last arrival: total = size * (1 + flags)
        store.set(f"{prefix}/any", b"1" if total > group.size else b"0")
        store.delete_key(f"{prefix}/n")
    wait_keys(store, [f"{prefix}/any"], timeout_s, f"host any_true {key!r}", group.ranks)
    answer = bytes(store.get(f"{prefix}/any")) == b"1"
    done = _pending("any", key, group)
    done.append(prefix)
    if len(done) > 2:  # every rank got past the round before last: its answer is read
        old = done.pop(0)
        if group.rank == 0:
            store.delete_key(f"{old}/any")
    return answer


def broadcast(
    key: str, payload: bytes | None, group: Group, src: int = 0, timeout_s: float | None = None
) -> bytes:
    """Group rank ``src``'s ``payload`` on every rank of ``group``. The others pass
    ``payload=None`` and wait up to ``timeout_s`` (None: forever, e.g. a server's followers
    while it is idle). A wait that times out raises TimeoutError and does not consume the
    round: calling again waits for the same one.

    Each receiver acknowledges a round after reading it; ``src`` deletes a round's keys once
    every receiver has, so a long-running loop keeps the store small."""
    if payload is None and group.rank == src:
        raise ValueError("host broadcast: the source rank must pass a payload")
    if group.size == 1:
        assert payload is not None  # the only rank is the source
        return payload
    store = job_store()
    counts = _rounds.__dict__.setdefault("counts", {})
    ident = ("bcast", key, group.ranks, src)
    n, prefix = _round("bcast", key, group, src)
    if group.rank == src:
        pending = _pending("bcast", key, group)
        for old in list(pending):  # rounds every receiver has acknowledged
            if store.add(f"{old}/acks", 0) >= group.size - 1:
                store.delete_key(old)
                store.delete_key(f"{old}/acks")
                pending.remove(old)
        assert payload is not None
        store.set(prefix, payload)
        pending.append(prefix)
        return payload
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = 0.0005
    while not store.check([prefix]):  # short sleeps while busy, at most 20 ms while idle
        if deadline is not None and time.monotonic() >= deadline:
            counts[ident] = n - 1  # not consumed: the next call waits for the same round
            raise TimeoutError(f"host broadcast {key!r}: nothing from rank {src} in {timeout_s}s")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    out = bytes(store.get(prefix))
    store.add(f"{prefix}/acks", 1)
    return out
