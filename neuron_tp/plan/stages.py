"""One layout's memory and step time when its ranks are pipeline stages and context-parallel
ring members: the traced step (one rank, ``s / cp`` tokens, 1 and 2 decoder layers) split into
a per-layer part and the rest (embedding, final norm, LM head and loss), composed per stage
with the closed-form terms of :mod:`.pipeline`. At pp = cp = 1 this is exactly
:func:`.predict.memory` / :func:`.predict.timing` of the whole model.

Which stage holds what: the decoder layers ``layers / pp`` each, parameter bytes per stage from
the sharded meta model (:func:`.state.stage_state_bytes`: the embedding on the first stage,
final norm + LM head on the last); the activations of the non-layer rest (the logits and loss,
and the embedding's saved token ids) on the last stage, once; the rest's tp collectives on both
end stages (the embedding's and the head's are not told apart: an upper bound); the LM head's
FLOPs on the last stage. The gradient reduction is the traced one (traced at dp =
:data:`TRACED_DP`) at ``layers / pp`` deep with its data-parallel groups resized to the
``dp x cp`` ranks holding a stage (a ring's bytes scale with ``(n-1)/n``; ZeRO-1's padding to a
multiple of dp aside), the embedding and head included on every stage (an upper bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .pipeline import (
    blockwise_dots,
    blockwise_tiles,
    boundary_bytes,
    bubble_slots,
    causal_fraction,
    in_flight,
    kv_ring_bytes,
    ring_passes,
)
from .predict import Memory, Timing, comm_seconds, extend, micro_buffer, step_buffer
from .state import StateBytes
from .trace import Comm

ATTENTION_BLOCK = 512  # neuron-tp train's --attention-block default
TRACED_DP = 2  # data-parallel size of the traced mesh (every job's dp groups resized from it)


@dataclass(frozen=True)
class Shape:
    """What the closed-form terms need of the model and the layout."""

    layers: int
    hidden: int
    heads_local: int  # query heads per tp rank
    kv_local: int  # key/value heads per tp rank (replicated ones count once)
    head_dim: int
    dtype_bytes: int
    seq_len: int  # the whole sequence (cp ranks hold seq_len / cp each)


def _split(traces, k: float, attr) -> tuple[float, float]:
    """(per decoder layer, the rest) of ``attr`` at ``k`` x b0 sequences."""
    one, two = extend(traces, 1, k, attr), extend(traces, 2, k, attr)
    return two - one, 2 * one - two


def resize_groups(comms: tuple[Comm, ...], tp: int, replicas: int) -> tuple[Comm, ...]:
    """The traced data-parallel collectives (groups of ranks ``tp`` apart) over ``replicas``
    ranks ``tp`` apart instead (ring bytes scaled by ``(n-1)/n``; gone at 1)."""
    out = []
    for c in comms:
        g = c.group
        if len(g) < 2 or g[1] - g[0] != tp or len(g) == replicas:
            out.append(c)
            continue
        if replicas > 1:
            scale = ((replicas - 1) / replicas) / ((len(g) - 1) / len(g))
            group = tuple(g[0] + i * tp for i in range(replicas))
            out.append(replace(c, ring_bytes=c.ring_bytes * scale, group=group))
    return tuple(out)


def stage_memories(
    lay, traces, no_recompute, states: list[StateBytes], shape: Shape, k: float
) -> list[Memory]:
    """Each pipeline stage's peak :class:`Memory` (``no_recompute``: the same layout's traces
    without recompute, for the working set of one recomputed layer; None without recompute)."""
    pp, m = lay.pp, lay.grad_accum
    per_layer, rest = _split(traces, k, lambda t: t.saved_bytes)
    work = 0.0
    if no_recompute is not None:
        work = max(0.0, _split(no_recompute, k, lambda t: t.saved_bytes)[0] - per_layer)
    if lay.attention == "blockwise":
        keys = shape.seq_len // lay.cp
        work += blockwise_tiles(lay.micro_batch, shape.heads_local, ATTENTION_BLOCK, keys)
    n = shape.layers // pp
    out = []
    for stage, state in enumerate(states):
        held = in_flight(stage, pp, m, lay.pp_schedule, lay.virtual_stages) * per_layer * n
        held += rest if stage == pp - 1 else 0.0
        if pp == 1:
            buf = max(step_buffer(traces, shape.layers), state.grads if lay.zero1 else 0)
        else:
            buf = state.grads if lay.zero1 else step_buffer(traces, n)
        out.append(
            Memory(
                state.params,
                state.grads,
                state.optimizer,
                state.masters,
                int(held + work),
                micro_buffer(traces, k),
                int(buf),
            )
        )
    return out


def _link(job, span: int) -> float:
    """Bytes/s one rank sends to the rank ``span`` ranks away: NeuronLink inside a node, else
    its share of the node's EFA (every rank of the node sends at once)."""
    if span < job.per_node:
        return job.instance.link_bandwidth_per_core
    return job.instance.network_bandwidth / job.per_node


def _attention_flops(lay, shape: Shape) -> float:
    """Blockwise attention's score-tile FLOPs per layer and micro-batch not in the trace:
    the trace runs one ``s/cp`` tile; the job visits ``s/cp`` queries against all ``s`` keys
    (every hop of the ring), only the tiles on and below the causal diagonal."""
    if lay.attention != "blockwise":
        return 0.0
    local, s = shape.seq_len // lay.cp, shape.seq_len
    coef = blockwise_dots(lay.activation_checkpointing) * 2 * lay.micro_batch
    coef *= shape.heads_local * shape.head_dim
    return coef * local * (s * causal_fraction(s, ATTENTION_BLOCK) - local)


def stage_timing(lay, traces, states: list[StateBytes], shape: Shape, job, k: float):
    """(:class:`Timing` of the step, set by its slowest stage; one rank's matrix-product
    FLOPs per step averaged over the stages)."""
    inst, pp, m, v = job.instance, lay.pp, lay.grad_accum, lay.virtual_stages
    peak = inst.peak_flops_per_core if job.bf16 else inst.peak_fp32_flops_per_core
    rate = peak * job.efficiency
    flops_l, flops_rest = _split(traces, k, lambda t: t.flops)
    flops_l += _attention_flops(lay, shape)
    comm_l, comm_rest = _split(traces, k, lambda t: comm_seconds(t.micro, inst, job.per_node))
    n = shape.layers // pp
    span = lay.dp * lay.cp * lay.tp  # ranks between a stage's rank and the next stage's
    hop = boundary_bytes(
        lay.micro_batch,
        shape.seq_len,
        shape.hidden,
        shape.dtype_bytes,
        tp=lay.tp,
        sp=lay.sequence_parallel,
        cp=lay.cp,
    )
    edge = 0.0 if pp == 1 else 2 * v * (hop / _link(job, span) + inst.collective_latency)
    ring = 0.0
    if lay.cp > 1:
        sent = kv_ring_bytes(
            lay.micro_batch,
            shape.seq_len,
            shape.kv_local,
            shape.head_dim,
            shape.dtype_bytes,
            cp=lay.cp,
        )
        passes = ring_passes(lay.activation_checkpointing)
        ring = n * passes * (sent / _link(job, lay.tp) + (lay.cp - 1) * inst.collective_latency)
    slots = []
    for stage in range(pp):
        last, end = stage == pp - 1, stage in (0, pp - 1)
        compute = (flops_l * n + (flops_rest if last else 0.0)) / rate
        slots.append((compute, comm_l * n + (comm_rest if end else 0.0)))
    compute, tp_comm = max(slots, key=sum)
    slot = compute + tp_comm + edge + ring
    grads = tuple(
        resize_groups(t.step, lay.tp, lay.dp * lay.cp) for t in (traces[(1, 1)], traces[(2, 1)])
    )
    one, two = (comm_seconds(g, inst, job.per_node) for g in grads)
    step_comm = one + (n - 1) * (two - one)
    optimizer = 2 * max(s.total for s in states) / inst.hbm_bandwidth_per_core
    timing = Timing(
        m * compute,
        m * tp_comm,
        step_comm,
        optimizer,
        pp_comm=m * edge,
        cp_comm=m * ring,
        bubble=bubble_slots(pp, v) * slot,
    )
    return timing, m * (flops_l * shape.layers + flops_rest) / pp


def model_shape(config, lay, seq_len: int, bf16: bool) -> Shape:
    """The :class:`Shape` of ``config`` (a transformers config) under ``lay``."""
    from ..hf.attention import model_heads

    heads = model_heads(config)
    assert heads is not None, "a model the planner traces has attention heads"
    return Shape(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads_local=max(1, heads.q // lay.tp),
        kv_local=math.ceil(heads.kv / lay.tp),
        head_dim=heads.dim,
        dtype_bytes=2 if bf16 else 4,
        seq_len=seq_len,
    )
