"""A save or load phase failed on some rank: every rank raises one :class:`CheckpointError`
naming the phase, the failing rank and its message.

Each phase of a save or a load catches *any* exception, then every rank calls :func:`agree`.
The exchange is the package's one "did any rank fail" helper
(:func:`neuron_tp.parallel.failures.gather_failures`); the lowest failing rank is recorded as the
one that reports (:func:`neuron_tp.errors.set_reporter`).
"""

from __future__ import annotations

import torch

from ..errors import set_reporter
from ..parallel.failures import describe, gather_failures
from ..parallel.mesh import Mesh
from .format import CheckpointError


def agree(mesh: Mesh, device: torch.device, what: str, error: BaseException | None) -> None:
    """Return on every rank when no rank passed an ``error``; otherwise raise
    :class:`CheckpointError` ``"<what> failed on rank R: <message>"`` on every rank.

    The exchange is :func:`neuron_tp.parallel.failures.gather_failures` (the job's host store;
    one all-reduce on ``device`` on a trace-only mesh)."""
    world = mesh.group("world")
    mine = None if error is None else describe(error)
    failed = gather_failures(world, mine, device)
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
