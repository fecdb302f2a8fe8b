"""From traced steps to one rank's memory and the job's step time.

A layout is traced at two depths (1 and 2 decoder layers) and two micro-batch sizes (``b0`` and
``2 b0``); everything a step does is linear in the number of layers and in the micro-batch
(per-layer work, per-sequence activations), so the job's figures are the bilinear extension
of those four traces to its real depth and micro-batch. Time model (every input stated):

* compute: the traced matrix-product FLOPs (recompute included) at ``efficiency`` x the
  core's peak (BF16, or FP32 for fp32 jobs);
* communication: per collective, the bytes a ring sends from this rank over the link it
  crosses: NeuronLink when the group stays in one node, else EFA (a node's EFA is shared by
  every group that leaves it), plus a fixed latency per collective; not overlapped;
* optimizer: the model state read and written once at the core's HBM bandwidth;
* step = grad_accum x (micro-batch compute + communication) + gradient reduction + optimizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Instance
from .state import StateBytes
from .trace import Comm, Trace


@dataclass(frozen=True)
class Memory:
    """Bytes one NeuronCore holds during a step, by part."""

    params: int
    grads: int
    optimizer: int  # AdamW moments (sharded over dp with ZeRO-1)
    masters: int  # fp32 master weights (bf16 jobs)
    activations: int  # saved for backward by one micro-batch (+ one layer's recompute)
    micro_buffer: int  # the largest collective buffer of forward + backward
    step_buffer: int  # the largest of the gradient reduction and optimizer step
    reference: int = 0  # DPO's reference (:func:`reference_bytes`), held the whole step

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer + self.masters

    @property
    def comm_buffer(self) -> int:
        """The buffer of the phase that peaks (see :attr:`total`)."""
        return self.step_buffer if self.step_peak else self.micro_buffer

    @property
    def step_peak(self) -> bool:
        return self.step_buffer > self.activations + self.micro_buffer

    @property
    def total(self) -> int:
        """The peak: the model state (and DPO's reference) plus the larger of
        forward/backward (activations and a collective buffer) and the gradient reduction /
        optimizer step (activations freed)."""
        peak = max(self.activations + self.micro_buffer, self.step_buffer)
        return self.state + self.reference + peak


@dataclass(frozen=True)
class Timing:
    """Seconds of one optimizer step, by part."""

    compute: float
    tp_comm: float  # collectives of forward + backward, all micro-batches
    step_comm: float  # gradient reduction (tp, dp) and the ZeRO-1 parameter gather
    optimizer: float
    pp_comm: float = 0.0  # stage-boundary sends (activations forward, gradients backward)
    cp_comm: float = 0.0  # K/V (and their gradients) around the context-parallel ring
    bubble: float = 0.0  # the pipeline's idle slots: (pp - 1) / v micro-batch slots

    @property
    def step(self) -> float:
        return (
            self.compute
            + self.tp_comm
            + self.step_comm
            + self.optimizer
            + self.pp_comm
            + self.cp_comm
            + self.bubble
        )


def _bilinear(f11: float, f21: float, f12: float, f22: float, layers: int, k: float) -> float:
    """f at (``layers``, micro-batch step ``k``) from f at (1|2 layers) x (k = 1|2)."""
    dl, dk = layers - 1, k - 1
    return f11 + dl * (f21 - f11) + dk * (f12 - f11) + dl * dk * (f22 - f21 - f12 + f11)


def extend(traces: dict[tuple[int, int], Trace], layers: int, k: float, attr) -> float:
    """``attr(trace)`` extended from the traces at (1|2 layers, 1|2 x b0) to ``layers`` deep
    and ``k`` x b0 sequences per micro-batch."""
    f11, f21, f12, f22 = (attr(traces[key]) for key in ((1, 1), (2, 1), (1, 2), (2, 2)))
    return _bilinear(f11, f21, f12, f22, layers, k)


REFERENCE_FLOATS = 2  # --reference precompute: (chosen, rejected) log-probabilities, fp32


def reference_kind(objective: str, reference: str) -> str:
    """The reference ``neuron-tp train`` uses (``job.train.preference.reference_kind`` for a
    job without LoRA, which the planner plans): none, adapters, copy or precompute."""
    if objective != "dpo":
        return "none"
    return "precompute" if reference == "auto" else reference


def reference_bytes(kind: str, params: int, pairs_per_rank: int) -> int:
    """Bytes of DPO's reference on one rank: adapters 0 (the policy with its adapters off);
    copy one more set of this rank's sharded weights (``params``: their bytes in the model's
    dtype); precompute two fp32 per pair of this rank's data."""
    if kind == "copy":
        return params
    if kind == "precompute":
        return REFERENCE_FLOATS * 4 * pairs_per_rank
    return 0


def comm_seconds(comms: tuple[Comm, ...], instance: Instance, ranks_per_node: int) -> float:
    """Seconds for ``comms`` one after another (ring algorithm, no overlap)."""
    total = 0.0
    for c in comms:
        nodes: dict[int, int] = {}
        for r in c.group:
            nodes[r // ranks_per_node] = nodes.get(r // ranks_per_node, 0) + 1
        seconds = c.ring_bytes / instance.link_bandwidth_per_core
        if len(nodes) > 1:  # the ring leaves the node once per group that spans it
            here = nodes[c.group[0] // ranks_per_node]
            groups_leaving = ranks_per_node / here
            seconds = max(seconds, groups_leaving * c.ring_bytes / instance.network_bandwidth)
        total += seconds + instance.collective_latency
    return total


def comm_split(traces, layers: int, k: float, instance: Instance, ranks_per_node: int):
    """Seconds of one micro-batch's collectives and of the once-per-step ones."""
    micro = extend(traces, layers, k, lambda t: comm_seconds(t.micro, instance, ranks_per_node))
    step = extend(traces, layers, 1, lambda t: comm_seconds(t.step, instance, ranks_per_node))
    return micro, step


def _positional(a: tuple[Comm, ...], b: tuple[Comm, ...], t: float) -> list[float]:
    """Buffer sizes of ``a`` moved ``t`` steps towards ``b`` (matched by position), or the
    larger of the two lists' sizes when their collectives do not pair up."""
    if len(a) == len(b):
        return [x.buffer_bytes + t * (y.buffer_bytes - x.buffer_bytes) for x, y in zip(a, b)]
    return [c.buffer_bytes for c in a + b]


def micro_buffer(traces: dict[tuple[int, int], Trace], k: float) -> int:
    """Bytes of the largest collective buffer of forward + backward at ``k`` x b0 (per-layer
    buffers: the one-layer traces hold them all)."""
    return int(max(_positional(traces[(1, 1)].micro, traces[(1, 2)].micro, k - 1), default=0))


def step_buffer(traces: dict[tuple[int, int], Trace], layers: int) -> int:
    """Bytes of the largest collective buffer of the gradient reduction and optimizer step at
    ``layers`` deep (ZeRO-1 reduce-scatters and gathers the whole model in one buffer)."""
    one, two = traces[(1, 1)].step, traces[(2, 1)].step
    return int(max(_positional(one, two, layers - 1), default=0))


def memory(
    state: StateBytes, traces, layers: int, k: float, no_recompute=None, zero1: bool = False
) -> Memory:
    """One rank's memory at ``layers`` deep, ``k`` x b0 sequences per micro-batch. With
    recompute, ``no_recompute`` (the same layout's traces without it) adds what one layer
    recomputes in backward (held while that layer's backward runs). ZeRO-1 flattens every
    gradient into one buffer (its reduce-scatter's input) at any dp, also at dp = 1 where no
    collective shows it."""
    saved = extend(traces, layers, k, lambda t: t.saved_bytes)
    if no_recompute is not None:
        one_layer = extend(no_recompute, 2, k, lambda t: t.saved_bytes) - extend(
            no_recompute, 1, k, lambda t: t.saved_bytes
        )
        kept = extend(traces, 2, k, lambda t: t.saved_bytes) - extend(
            traces, 1, k, lambda t: t.saved_bytes
        )
        saved += max(0.0, one_layer - kept)
    return Memory(
        state.params,
        state.grads,
        state.optimizer,
        state.masters,
        int(saved),
        micro_buffer(traces, k),
        max(step_buffer(traces, layers), state.grads if zero1 else 0),
    )


def timing(
    traces,
    state: StateBytes,
    layers: int,
    k: float,
    *,
    grad_accum: int,
    instance: Instance,
    ranks_per_node: int,
    bf16: bool,
    efficiency: float,
) -> tuple[Timing, float]:
    """The step's :class:`Timing` and the FLOPs of one rank's step (recompute included)."""
    peak = instance.peak_flops_per_core if bf16 else instance.peak_fp32_flops_per_core
    flops = grad_accum * extend(traces, layers, k, lambda t: t.flops)
    micro, step = comm_split(traces, layers, k, instance, ranks_per_node)
    optimizer = 2 * state.total / instance.hbm_bandwidth_per_core
    return Timing(flops / (peak * efficiency), grad_accum * micro, step, optimizer), flops
