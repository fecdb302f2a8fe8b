"""Every rank learns whether any rank failed, which ones, and why: the one exchange behind
"raise on every rank if any rank failed".

A failure on one rank must not leave the others waiting in a collective the failing rank never
reaches: each phase catches its exception, then every rank calls :func:`gather_failures`, and
every rank raises when the answer is not empty. Its two users word the error for their phase:
:func:`neuron_tp.parallel.agreement.check_agreement` (startup checks: the failing rank re-raises
its own error) and :func:`neuron_tp.checkpoint.agree.agree` (a save or load phase: one
``CheckpointError`` naming the phase on every rank).
"""

from __future__ import annotations

import torch

from . import comm, host
from .mesh import Group

__all__ = ["MESSAGE_BYTES", "describe", "gather_failures", "has_store"]

MESSAGE_BYTES = 1000  # of each failed rank's message carried to the others


def describe(error: BaseException) -> str:
    """One line for an exception: our own errors as they are, others with their type."""
    text = str(error)
    return text if isinstance(error, ValueError) else f"{type(error).__name__}: {text}"


def has_store(group: Group) -> bool:
    """True when ``group``'s ranks can exchange through the job's host key-value store."""
    import torch.distributed as dist

    return not group.virtual and dist.is_available() and dist.is_initialized()


def _rows(rank: int, world: int, text: str | None) -> torch.Tensor:
    """``[world * MESSAGE_BYTES]`` floats, zero but for this rank's row: flag, length, bytes."""
    buf = torch.zeros(world * MESSAGE_BYTES)
    if text is not None:
        data = text.encode("utf-8")[: MESSAGE_BYTES - 2]
        row = buf[rank * MESSAGE_BYTES : (rank + 1) * MESSAGE_BYTES]
        row[0], row[1] = 1.0, float(len(data))
        row[2 : 2 + len(data)] = torch.tensor(list(data), dtype=torch.float32)
    return buf


def gather_failures(
    group: Group, message: str | None, device: torch.device | None = None
) -> dict[int, str]:
    """``{group rank: message}`` of every rank of ``group`` that passed a ``message`` (its
    failure, one line); ``{}`` when none did. Collective over ``group``.

    Exchanged through the job's host-side store: ranks that reach this point far apart (one
    writing files or loading weights while the others wait) trip no device collective timeout
    and compile no graph. A group without a store (a trace-only mesh) uses one all-reduce of a
    ``[size * MESSAGE_BYTES]`` float tensor on ``device`` (each rank's message in its own row)."""
    failed: dict[int, str] = {} if message is None else {group.rank: message}
    if group.size == 1:
        return failed
    if has_store(group):
        sent = b"" if message is None else b"!" + message.encode("utf-8")[:MESSAGE_BYTES]
        for r, t in enumerate(host.all_gather("failures", sent, group)):
            if t and r not in failed:
                failed[r] = t[1:].decode("utf-8", "replace")
        return failed
    if device is None:
        raise ValueError("gather_failures: a group without a host store needs a device")
    rows = comm.all_reduce(_rows(group.rank, group.size, message).to(device), group).cpu()
    rows = rows.view(group.size, MESSAGE_BYTES)
    for r in range(group.size):
        if rows[r, 0] > 0 and r not in failed:
            n = int(rows[r, 1])
            failed[r] = bytes(int(v) for v in rows[r, 2 : 2 + n]).decode("utf-8", "replace")
    return failed
