"""The stage exchange of one tick: activations to the next stage and activation gradients to
the previous one, in ONE step every rank of the pipeline group takes part in, with static
shapes (an idle direction sends a zero buffer and its received buffer is ignored).

Stages form a ring over the pp group (stage ``s`` sends forward to ``(s + 1) % p`` and backward
to ``(s - 1) % p``): the interleaved schedule's last stage feeds the first stage's next chunk;
1F1B's wrap-around pair carries zeros.

Methods: ``permute``, XLA's collective-permute (each rank receives one buffer per direction:
what Neuron runs); ``gather``, the same data by one all-gather over the pp group of both
directions' buffers, each rank keeping its neighbours' slots (chosen with the device-side rank,
one graph for every rank): XLA:CPU devices cannot execute torch-xla 2.9's collective-permute
(it carries no channel id: the device threads never meet), so that runtime uses ``gather``,
``p - 1`` times the bytes received; ``p2p`` on gloo/NCCL process groups: batched
isend/irecv of exactly the slots in use (both sides know the schedule).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from ..backend import xla as _xla
from ..parallel import comm
from ..parallel.mesh import Group

METHODS = ("permute", "gather", "p2p")
_barriers: dict[tuple[int, ...], threading.Barrier] = {}
_barriers_lock = threading.Lock()


def default_method(group: Group, device: torch.device) -> str:
    """``p2p`` off XLA, ``gather`` on XLA:CPU devices, ``permute`` on Neuron (and traces)."""
    if device.type != "xla":
        return "p2p"
    return "gather" if not group.virtual and _xla.cpu_runtime() else "permute"


@dataclass
class Sent:
    """What this rank sends in a tick (None: nothing in that direction)."""

    forward: torch.Tensor | None = None
    backward: torch.Tensor | None = None


class Exchange:
    """The tick exchange over ``group`` (the pp axis) of ``[*shape]`` buffers of ``dtype``."""

    def __init__(
        self,
        group: Group,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        method: str | None = None,
    ):
        self.group, self.shape, self.dtype, self.device = group, tuple(shape), dtype, device
        self.method = method or default_method(group, device)
        if self.method not in METHODS:
            raise ValueError(f"exchange method must be one of {METHODS}, got {self.method!r}")
        self.zeros = torch.zeros(self.shape, dtype=dtype, device=device)
        self.received: tuple = ()
        p, r = group.size, group.rank
        self.next, self.prev = group.ranks[(r + 1) % p], group.ranks[(r - 1) % p]

    def meet(self) -> None:
        """On XLA:CPU devices (threads of one process): wait for this device's work, then for
        the other stages' threads, before a graph with a pp collective. XLA:CPU aborts a
        collective whose peers arrive more than 10 s apart, and stages compile different
        graphs before it. Elsewhere nothing (Neuron ranks wait in the collective)."""
        if self.device.type != "xla" or self.group.virtual or not _xla.cpu_runtime():
            return
        _xla.wait_own_device()
        with _barriers_lock:
            barrier = _barriers.setdefault(self.group.ranks, threading.Barrier(self.group.size))
        barrier.wait(timeout=900)

    @property
    def bytes_per_tick(self) -> int:
        """Bytes one rank receives in one exchange (both directions)."""
        one = self.zeros.numel() * self.zeros.element_size()
        return 2 * one * ((self.group.size - 1) if self.method == "gather" else 1)

    def __call__(
        self, sent: Sent, expect_forward: bool, expect_backward: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(activation from the previous stage, gradient from the next one); None where the
        neighbour sent nothing this tick (``expect_*``, known from the schedule)."""
        if self.method == "p2p":
            return self._p2p(sent, expect_forward, expect_backward)
        fwd = self.zeros if sent.forward is None else sent.forward.detach()
        bwd = self.zeros if sent.backward is None else sent.backward.detach()
        if self.method == "permute":
            got_f, got_b = self._permute(fwd, bwd)
        else:
            got_f, got_b = self._gather(fwd, bwd)
        self.received = (got_f, got_b)  # both outputs live until the cut: one graph
        return (got_f if expect_forward else None), (got_b if expect_backward else None)

    def _pairs(self, step: int) -> list[list[int]]:
        p = self.group.size
        return [[g[s], g[(s + step) % p]] for g in self.group.all_groups for s in range(p)]

    def _permute(self, fwd: torch.Tensor, bwd: torch.Tensor):
        xm = _xla.xm()
        forward = xm.collective_permute(fwd, self._pairs(1))
        return forward, xm.collective_permute(bwd, self._pairs(-1))

    def _gather(self, fwd: torch.Tensor, bwd: torch.Tensor):
        p = self.group.size
        both = torch.stack([fwd.to(self.dtype), bwd.to(self.dtype)]).unsqueeze(0)
        every = comm.all_gather(both, self.group, 0)  # [p, 2, *shape]
        rank = self.group.rank_tensor(fwd.device).view(1)
        prev, nxt = torch.remainder(rank + (p - 1), p), torch.remainder(rank + 1, p)
        got_f = every.index_select(0, prev)[0, 0]
        got_b = every.index_select(0, nxt)[0, 1]
        return got_f, got_b

    def _p2p(self, sent: Sent, expect_forward: bool, expect_backward: bool):
        import torch.distributed as dist

        pg = self.group.process_group
        ops, got_f, got_b = [], None, None
        if sent.forward is not None:
            ops.append(dist.P2POp(dist.isend, _wire(sent.forward), self.next, pg, tag=1))
        if sent.backward is not None:
            ops.append(dist.P2POp(dist.isend, _wire(sent.backward), self.prev, pg, tag=2))
        if expect_forward:
            got_f = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, got_f, self.prev, pg, tag=1))
        if expect_backward:
            got_b = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, got_b, self.next, pg, tag=2))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return got_f, got_b


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous()
