"""Every rank learns whether any rank failed a phase, which one, and why.

A failure on one rank must not leave the others waiting in a collective the failing rank
never reaches: each phase of a save, a load or the startup checks catches *any* exception,
then every rank calls :func:`agree`, which raises on every rank when any rank failed.

:func:`neuron_tp.parallel.agreement.check_agreement` (``error=``) does the same for the startup
checks, but re-raises a failing rank's own exception where this wraps every rank's in one
:class:`CheckpointError` naming the phase, and it cannot run on a trace-only mesh (this falls
back to one all-reduce). Both record the lowest failing rank as the one that reports
(:func:`neuron_tp.errors.set_reporter`).
"""

from __future__ import annotations

import torch

from ..errors import set_reporter
from ..parallel import comm
from ..parallel.mesh import Mesh
from .format import CheckpointError

MESSAGE_BYTES = 512  # of each rank's message carried to the others


def describe(error: BaseException) -> str:
    """One line for an exception: our own errors as they are, others with their type."""
    text = str(error)
    return text if isinstance(error, ValueError) else f"{type(error).__name__}: {text}"


def _encode(rank: int, world: int, text: str | None) -> torch.Tensor:
    buf = torch.zeros(world * MESSAGE_BYTES)
    if text is not None:
        data = text.encode("utf-8")[: MESSAGE_BYTES - 2]
        row = buf[rank * MESSAGE_BYTES : (rank + 1) * MESSAGE_BYTES]
        row[0], row[1] = 1.0, float(len(data))
        row[2 : 2 + len(data)] = torch.tensor(list(data), dtype=torch.float32)
    return buf


def has_store(group) -> bool:
    """True when ``group``'s ranks can exchange through the job's host key-value store."""
    import torch.distributed as dist

    return not group.virtual and dist.is_available() and dist.is_initialized()


def agree(mesh: Mesh, device: torch.device, what: str, error: BaseException | None) -> None:
    """Return on every rank when no rank passed an ``error``; otherwise raise
    :class:`CheckpointError` ``"<what> failed on rank R: <message>"`` on every rank.

    Exchanged through the job's key-value store; without a process group (a trace-only mesh)
    one all-reduce of a ``[world * 512]`` float tensor (each rank's message in its own row)."""
    world = mesh.group("world")
    mine = None if error is None else describe(error)
    failed: dict[int, str] = {} if mine is None else {world.rank: mine}
    if world.size > 1 and has_store(world):
        # Through the job's host-side store: ranks that reach this point far apart (dp
        # replica 0 writing files while the others wait) trip no device collective timeout.
        sent = b"" if mine is None else b"!" + mine.encode()[:MESSAGE_BYTES]
        texts = comm.host_all_gather("checkpoint", sent, world)
        failed.update(
            {
                r: t[1:].decode("utf-8", "replace")
                for r, t in enumerate(texts)
                if t and r not in failed
            }
        )
    elif world.size > 1:
        rows = comm.all_reduce(_encode(world.rank, world.size, mine).to(device), world).cpu()
        rows = rows.view(world.size, MESSAGE_BYTES)
        for r in range(world.size):
            if rows[r, 0] > 0 and r not in failed:
                n = int(rows[r, 1])
                failed[r] = bytes(int(v) for v in rows[r, 2 : 2 + n]).decode("utf-8", "replace")
    if not failed:
        return
    first = world.rank if mine is not None else min(failed)
    if world.size > 1 and len(failed) == world.size:  # e.g. a path no rank can write
        exc = CheckpointError(f"{what} failed on every rank: {failed[first]}")
        raise set_reporter(exc, world.ranks[min(failed)]) from error
    others = sorted(world.ranks[r] for r in set(failed) - {first})
    also = (
        f" (also failed on rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))})"
        if others
        else ""
    )
    exc = CheckpointError(f"{what} failed on rank {world.ranks[first]}: {failed[first]}{also}")
    raise set_reporter(exc, world.ranks[min(failed)]) from error
