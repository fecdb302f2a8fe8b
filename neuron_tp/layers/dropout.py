"""Dropout on a shard that equals dropout on the full tensor.

Every rank of the group draws the mask of the *full* tensor from the RNG they share (same seed,
same call order) and keeps its own chunk, so sequence-sharded dropout gives exactly the masks
the unsharded model would, the graph is the same on every rank (the chunk is picked with a
device-side rank index), and no per-rank RNG state has to be tracked or checkpointed. The cost
is drawing ``group.size`` times more random numbers than the shard needs, which is small next
to the block's matmuls.
"""

from __future__ import annotations

import torch

from ..parallel import comm
from ..parallel.mesh import Group


def sharded_dropout(
    x: torch.Tensor, p: float, group: Group | None, dim: int = 1, training: bool = True
) -> torch.Tensor:
    """Dropout of ``x``, this rank's chunk along ``dim`` of a full tensor split over ``group``
    (``None``: ``x`` is the full tensor, e.g. replicated over tp)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    if not training or p == 0.0:
        return x
    full_shape = list(x.shape)
    if group is not None:
        full_shape[dim] *= group.size
    keep = torch.rand(full_shape, device=x.device) >= p
    if group is not None:
        keep = comm.local_chunk(keep, group, dim)
    return x * keep.to(x.dtype) / (1.0 - p)
