"""The layout ZeRO-1 gives a parameter over the dp group (:class:`Slot`: its flattened,
zero-padded chunk per rank) and the cut of a full tensor into this rank's chunk: what the
optimizer (:mod:`.zero1`) and its checkpoint states (:mod:`.zero1_state`) share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from ..parallel import comm
from ..parallel.mesh import Group


@dataclass
class Slot:
    """One parameter: its shard (what the inner optimizer steps) and its layout."""

    name: str
    param: nn.Parameter
    shard: torch.Tensor  # (chunk,) in master dtype
    chunk: int
    keeps_master: bool  # the shard is a persistent master (param dtype != master dtype)
    group: Group  # the ranks it is cut over: dp; under expert parallelism an expert's is edp
    norm_weight: torch.Tensor | float = 1.0  # per-element weight of the squared grad norm

    @property
    def numel(self) -> int:
        return self.param.numel()


def padded_blocks(tensors: list[torch.Tensor], chunks: list[int], dp: int) -> torch.Tensor:
    """The 1-D concatenation of the ``(dp, chunk_i)`` blocks of the zero-padded ``tensors``,
    block-row-major: rank ``r``'s piece (``r * C`` to ``(r + 1) * C``, ``C = sum chunks``)
    holds chunk ``r`` of every tensor."""
    blocks = []
    for t, chunk in zip(tensors, chunks):
        flat = t.reshape(-1)
        pad = dp * chunk - flat.numel()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        blocks.append(flat.view(dp, chunk))
    return torch.cat(blocks, 1).reshape(-1)


def chunk_of(full: torch.Tensor, chunk: int, group) -> torch.Tensor:
    """This rank's chunk of the flattened, padded ``full`` (no communication)."""
    return comm.local_chunk(padded_blocks([full], [chunk], group.size), group, 0)


class Sharded(Protocol):
    """What the checkpoint states read of a :class:`~.zero1.Zero1`."""

    group: Group
    inner: torch.optim.Optimizer
    slots: dict[str, Slot]

    def gather_params(self) -> None: ...
