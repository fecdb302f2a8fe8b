"""The planner's terms for pipeline parallelism, context parallelism and the attention core that
a traced step of one rank does not show by itself (each a closed formula, tested against a hand
calculation; docs/plan.md lists which are checked against an executed trace).

Pipeline (``pp`` stages, ``m`` micro-batches per step, ``v`` virtual stages per rank):

* bubble: the idle share of a step, ``(pp-1)/(m+pp-1)`` for 1F1B and ``(pp-1)/(v*m+pp-1)``
  interleaved, i.e. ``(pp-1)/v`` micro-batch slots of the slowest stage;
* in flight: the micro-batches whose activations a stage holds at its peak: 1F1B ``min(m,
  pp - stage)`` (the first stage warms up with ``pp`` forwards); interleaved (Megatron's warm-up
  of ``2 (pp - stage - 1) + (v - 1) pp`` chunk forwards, then one more) in units of a whole
  stage: ``(2 (pp - stage - 1) + (v - 1) pp + 1) / v``, at most ``m``;
* stage boundary: a micro-batch's hidden states ``b x s x h`` cross each boundary forward and
  their gradient backward; with sequence parallelism each tp rank sends its ``1/tp`` slice, with
  context parallelism its ``1/cp`` of the sequence.

Context parallelism (``cp`` ranks share a sequence): activations are those of ``s / cp`` tokens;
per layer, keys and values of each chunk travel ``cp - 1`` hops forward, and backward once more
together with their gradients (3 passes; 4 with full recompute).

Attention: sdpa on XLA saves the ``[b, heads/tp, s, s]`` probabilities (the trace counts them);
blockwise attention saves ``O(s)`` per head (the trace counts it too) and holds one query
block's ``[block, s]`` fp32 tiles while it runs (score, probability, and its gradient in
backward: :func:`blockwise_tiles`), skipping the key blocks above the causal diagonal.
"""

from __future__ import annotations

import math

SCHEDULES = ("1f1b", "interleaved")


def bubble_fraction(pp: int, m: int, v: int = 1) -> float:
    """The idle share of a pipelined step of ``m`` micro-batches."""
    return (pp - 1) / (v * m + pp - 1)


def bubble_slots(pp: int, v: int = 1) -> float:
    """Micro-batch slots of the slowest stage a step waits for beyond its ``m``:
    step = (m + bubble_slots) x slot."""
    return (pp - 1) / v


def in_flight(stage: int, pp: int, m: int, schedule: str = "1f1b", v: int = 1) -> float:
    """Micro-batches (of a whole stage's layers) whose activations ``stage`` holds at once."""
    if pp == 1:
        return 1.0
    if schedule == "1f1b":
        return float(min(m, pp - stage))
    chunks = 2 * (pp - stage - 1) + (v - 1) * pp + 1
    return min(m * v, chunks) / v


def boundary_bytes(
    b: int, s: int, hidden: int, dtype_bytes: int, *, tp: int, sp: bool, cp: int = 1
) -> int:
    """Bytes one rank sends across a stage boundary per micro-batch, one direction."""
    return b * s * hidden * dtype_bytes // (tp if sp else 1) // cp


def kv_ring_bytes(
    b: int, s: int, kv_heads_local: int, head_dim: int, dtype_bytes: int, *, cp: int
) -> int:
    """Bytes one rank sends around the cp ring in ONE pass of one layer: its K and V chunks
    forwarded ``cp - 1`` hops."""
    return (cp - 1) * 2 * b * (s // cp) * kv_heads_local * head_dim * dtype_bytes


def ring_passes(recompute: str) -> int:
    """Passes of K/V around the ring per layer and micro-batch: forward, backward's K/V and
    their gradients, and the recomputed forward under full recompute."""
    return 3 + (recompute == "full")


def sdpa_score_bytes(b: int, heads_local: int, s: int, dtype_bytes: int) -> int:
    """The ``[b, heads/tp, s, s]`` probabilities one layer's sdpa (math path) saves."""
    return b * heads_local * s * s * dtype_bytes


def blockwise_tiles(b: int, heads_local: int, block: int, s_keys: int) -> int:
    """Bytes of blockwise attention's live tiles: one query block's fp32 scores,
    probabilities and their gradient against ``s_keys`` keys."""
    return 3 * b * heads_local * min(block, s_keys) * s_keys * 4


def causal_fraction(s: int, block: int) -> float:
    """Share of the ``s x s`` score tiles blockwise attention visits under a causal mask (the
    blocks on and below the diagonal)."""
    n = math.ceil(s / block)
    return (n + 1) / (2 * n)


def blockwise_dots(recompute: str) -> int:
    """``2 b h s_q s_k d``-FLOP matrix products per score tile: forward ``QK^T`` and ``PV``,
    backward the recomputed ``QK^T`` and ``dV, dP, dQ, dK``; full recompute runs the forward
    twice."""
    return 2 + 5 + 2 * (recompute == "full")


def pipeline_refusal(layers: int, pp: int, m: int, schedule: str, v: int) -> str:
    """Why ``pp`` stages (``v`` chunks each) cannot run this job, or ""."""
    if schedule == "1f1b" and v != 1:
        return "--virtual-stages > 1 needs --pp-schedule interleaved"
    if schedule == "interleaved" and v < 2:
        return "--pp-schedule interleaved needs --virtual-stages >= 2 (1: --pp-schedule 1f1b)"
    if layers % (pp * v):
        return (
            f"pp={pp} x virtual stages {v} does not divide the {layers} layers; valid pp: "
            f"{[d for d in range(1, layers + 1) if layers % (d * v) == 0]}"
        )
    if pp > 1 and m < pp:
        return (
            f"{m} micro-batches per step < pp={pp} stages (the pipeline never fills): "
            f"--grad-accum >= {pp}"
        )
    return ""
