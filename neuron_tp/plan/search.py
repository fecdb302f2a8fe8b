"""Predict every layout ``neuron-tp train`` can run for a job (:mod:`.layouts` enumerates
them), and rank them.

Levers: tp (groups stay inside a node) and mode (1d, 1d + sequence parallel, 2d for tp = q^2,
3d for tp = q^3), dp = world / tp, micro-batch (a multiple of the batch split of 2d/3d) and the
gradient accumulation that makes the global batch, activation recompute (none, selective,
full), ZeRO-1 (always on for bf16: it keeps the fp32 masters). Each layout is traced
(:mod:`.trace`), its memory and time predicted (:mod:`.predict`); layouts that fit come first,
fastest first.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from ..parallel.layout import grid_side
from . import trace_store
from .layouts import Job, Layout, enumerate_layouts
from .moe import dense_standin, flops_per_token, moe_shape, param_counts, summary, tp_refusal
from .predict import Memory, Timing, reference_bytes, reference_kind
from .stages import TRACED_DP, model_shape, stage_memories, stage_timing
from .state import StateBytes, stage_state_bytes
from .trace import Spec

TIGHT = 0.05  # headroom below which a fit is "tight"


@dataclass
class Candidate:
    """A layout and its prediction (or why it cannot run)."""

    layout: Layout
    memory: Memory | None = None
    timing: Timing | None = None
    seq_per_s: float = 0.0
    mfu: float = 0.0  # model FLOPs (no recompute) / peak of every core
    fits: bool = False
    why: str = ""  # why it does not fit or cannot run
    headroom: float = 0.0  # fraction of the usable memory left free
    stage: int = 0  # the pipeline stage whose memory is the peak (``memory``)

    @property
    def tight(self) -> bool:
        """Fits with less than :data:`TIGHT` of the usable memory to spare: ranked after
        the comfortable fits (the prediction's own error could eat the margin)."""
        return self.fits and self.headroom < TIGHT


@dataclass
class Plan:
    """Every candidate, ranked; the recommendation (or the verdict when nothing fits)."""

    job: Job
    candidates: list[Candidate]
    verdict: str
    seconds: float
    traces: int
    notes: list[str] = field(default_factory=list)
    model: str = ""  # the --model the job trains (the command lines carry it)
    summary: list[str] = field(default_factory=list)  # parameter counts; MoE: routing cost
    params: tuple[int, int] = (0, 0)  # total, active per token

    @property
    def recommended(self) -> Candidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].fits else None


def _spec_key(lay: Layout) -> tuple:
    """What a layout's traces depend on: tp and mode, SP, recompute, ZeRO-1, the tokens one
    rank holds (seq / cp: a key suffix, seq_len passed at tracing) and the attention. pp and
    the data-parallel size are composed afterwards (:mod:`.stages`)."""
    return (
        lay.tp,
        lay.tp_mode,
        lay.sequence_parallel,
        lay.activation_checkpointing,
        lay.zero1,
        lay.cp,
        lay.attention,
    )


def _b0(lay: Layout) -> int:
    """Sequences per micro-batch step: 2d splits the batch over q ranks, 3d over q^2."""
    q = grid_side(lay.tp, lay.tp_mode)
    return {"1d": 1, "2d": q, "3d": q * q}[lay.tp_mode]


def _trace_all(config, job: Job, layouts: list[Layout]) -> dict[tuple, dict | str]:
    """The four traces (1|2 layers x b0|2 b0) of every distinct traced layout, also without
    recompute (the model FLOPs of the MFU)."""
    keys = {}
    for lay in layouts:
        keys[_spec_key(lay)] = lay
        keys[_spec_key(replace(lay, activation_checkpointing="none"))] = replace(
            lay, activation_checkpointing="none"
        )
    specs, owners = [], []
    for key, lay in keys.items():
        for layers in (1, 2):
            for k in (1, 2):
                specs.append(
                    Spec(
                        tp=lay.tp,
                        tp_mode=lay.tp_mode,
                        sequence_parallel=lay.sequence_parallel,
                        recompute=lay.activation_checkpointing,
                        micro_batch=k * _b0(lay),
                        seq_len=job.seq_len // lay.cp,
                        dp=min(TRACED_DP, job.world // lay.tp),
                        attn=lay.attention,
                        zero1=lay.zero1,
                        bf16=job.bf16,
                        layers=layers,
                    )
                )
                owners.append((key, (layers, k)))
    flat = trace_store.traces(config, specs)
    traced: dict[tuple, dict | str] = {}
    for (key, where), res in zip(owners, flat):
        if isinstance(res, str):
            traced[key] = res
        else:
            entry = traced.setdefault(key, {})
            if isinstance(entry, dict):  # not a key already refused (its reason kept)
                entry[where] = res
    return traced


def _why_not(mem: Memory, usable: int) -> str:
    parts = {
        "parameters": mem.params,
        "gradients": mem.grads,
        "optimizer": mem.optimizer + mem.masters,
        "activations": mem.activations,
        "comm buffer": mem.comm_buffer,
    }
    big = max(parts, key=parts.__getitem__)
    return (
        f"needs {mem.total / 2**30:.1f} GiB per core > {usable / 2**30:.1f} GiB usable "
        f"(largest: {big} {parts[big] / 2**30:.1f} GiB)"
    )


def _axes_text(lay: Layout) -> str:
    text = f"tp={lay.tp}"
    text += f" x pp={lay.pp}" if lay.pp > 1 else ""
    return text + (f" x cp={lay.cp}" if lay.cp > 1 else "")


def _verdict(job: Job, candidates: list[Candidate]) -> str:
    """What to do when nothing fits (more pipeline stages, or more nodes for ZeRO-1)."""
    if any(c.fits for c in candidates):
        return "fits"
    sized = [(c, c.memory) for c in candidates if c.memory is not None]
    if not sized:
        return "no layout can run: " + "; ".join(sorted({c.why for c in candidates}))[:500]
    best, mem = min(sized, key=lambda cm: cm[1].total)
    lay = best.layout
    rest = mem.total - mem.optimizer - mem.masters
    if rest > job.usable_bytes:
        return (
            f"does not fit on {job.world} ranks: even at {_axes_text(lay)} with ZeRO-1 and "
            f"{lay.activation_checkpointing} recompute, parameters + gradients + activations "
            f"need {rest / 2**30:.1f} GiB per core > {job.usable_bytes / 2**30:.1f} GiB "
            "usable: more pipeline stages (more nodes), or context parallelism for long "
            "sequences"
        )
    need = (mem.optimizer + mem.masters) * lay.dp * lay.cp / (job.usable_bytes - rest)
    nodes = math.ceil(need * lay.tp * lay.pp / job.per_node)
    return (
        f"does not fit on {job.nodes} node(s): the optimizer state needs ZeRO-1 over about "
        f"{math.ceil(need)} data-parallel ranks at {_axes_text(lay)} (about {nodes} x "
        f"{job.instance.name})"
    )


def make_plan(config, job: Job, **pins) -> Plan:
    """Rank every layout of ``config`` (a transformers config) for ``job``. ``pins`` fix
    options (:data:`PINS`): tp, tp_mode, sequence_parallel, activation_checkpointing,
    micro_batch, zero1, pp, pp_schedule, virtual_stages, cp, attention. A mixture of
    experts is traced as its dense stand-in (:mod:`.moe`: the static dense routing's
    parameters, FLOPs and collectives); its MFU counts the active parameters' FLOPs."""
    start = time.perf_counter()
    pins = {k: v for k, v in pins.items() if v is not None}
    layouts, notes = enumerate_layouts(job, pins, config)
    if not layouts:
        raise ValueError("no layout matches: " + ("; ".join(notes) or f"pins {pins}"))
    counts, lines = param_counts(config), summary(config, job.seq_len)
    moe = moe_shape(config) is not None
    useful = 1.0  # model FLOPs counted in the MFU over those traced
    if moe:
        useful = flops_per_token(config, job.seq_len) / flops_per_token(
            config, job.seq_len, dense=True
        )
        refused = {lay.tp: tp_refusal(config, lay.tp) for lay in layouts}
        config = dense_standin(config)
    else:
        refused = {}
    states = {lay: _states(config, job, lay) for lay in layouts if not refused.get(lay.tp)}
    heavy = {lay: max(st, key=lambda x: x.total) for lay, st in states.items() if _over(st, job)}
    runnable = [lay for lay in states if lay not in heavy]
    traced = _trace_all(config, job, runnable) if runnable else {}
    candidates = []
    for lay in layouts:
        cand = Candidate(lay)
        candidates.append(cand)
        if lay in heavy:  # the model state alone is over the budget: not traced
            st = heavy[lay]
            cand.memory = Memory(st.params, st.grads, st.optimizer, st.masters, 0, 0, 0)
            cand.why = _why_not(cand.memory, job.usable_bytes) + " (model state alone)"
            continue
        traces = refused.get(lay.tp) or traced[_spec_key(lay)]
        if isinstance(traces, str):
            cand.why = traces
            continue
        base = traced[_spec_key(replace(lay, activation_checkpointing="none"))]
        _predict(cand, job, config, traces=traces, base=base, states=states[lay], useful=useful)
    candidates.sort(
        key=lambda c: (
            not c.fits,
            c.tight,  # comfortable fits first
            c.memory is None,
            -round(c.seq_per_s, 6) if c.fits else 0,
            c.memory.total if c.memory else 0,  # then the smaller footprint
        )
    )
    verdict = _verdict(job, candidates)
    n_traces = 4 * len({_spec_key(c.layout) for c in candidates if not refused.get(c.layout.tp)})
    plan = Plan(job, candidates, verdict, time.perf_counter() - start, n_traces, notes)
    plan.summary, plan.params = lines, (counts.total, counts.active)
    return plan


_STATES: dict[tuple, list[StateBytes]] = {}


def _states(config, job: Job, lay: Layout) -> list[StateBytes]:
    """Each pipeline stage's model state under ``lay`` (cached per distinct sharding)."""
    key = (id(config), lay.tp, lay.tp_mode, lay.dp * lay.cp, lay.zero1, lay.pp, job.bf16)
    if key not in _STATES:
        _STATES[key] = stage_state_bytes(
            config,
            lay.tp,
            lay.tp_mode,
            lay.dp * lay.cp,
            bf16=job.bf16,
            zero1=lay.zero1,
            pp=lay.pp,
        )
    return _STATES[key]


def _over(states: list[StateBytes], job: Job) -> bool:
    return max(st.total for st in states) > job.usable_bytes


def _predict(cand: Candidate, job: Job, config, *, traces, base, states, useful: float) -> None:
    """Fill ``cand``'s memory (its worst stage), timing, throughput, MFU and fit."""
    lay = cand.layout
    k = job.rows * lay.micro_batch / _b0(lay)  # rows: a preference pair is two
    shape = model_shape(config, lay, job.seq_len, job.bf16)
    mems = stage_memories(lay, traces, None if base is traces else base, states, shape, k)
    kind = reference_kind(job.objective, job.reference)
    pairs = -(-(job.pairs or job.global_batch) // lay.dp)  # this rank's: its dp share
    mems = [
        replace(m, reference=reference_bytes(kind, st.params, pairs))
        for m, st in zip(mems, states, strict=True)
    ]
    cand.stage = max(range(len(mems)), key=lambda i: mems[i].total)
    cand.memory = mems[cand.stage]
    cand.timing, _ = stage_timing(lay, traces, states, shape, job, k)
    plain = replace(lay, activation_checkpointing="none")
    _, model_flops = stage_timing(plain, base, states, shape, job, k)
    peak = job.instance.peak_flops_per_core if job.bf16 else job.instance.peak_fp32_flops_per_core
    if kind in ("adapters", "copy"):  # a forward of the step's rows: a third of its FLOPs,
        # half its tp collectives (forward's)
        t = cand.timing
        extra = model_flops / 3 / (peak * job.efficiency)
        cand.timing = replace(t, compute=t.compute + extra, tp_comm=1.5 * t.tp_comm)
    cand.seq_per_s = job.global_batch / cand.timing.step
    cand.mfu = useful * model_flops / (peak * cand.timing.step)
    cand.fits = cand.memory.total <= job.usable_bytes
    cand.headroom = 1 - cand.memory.total / job.usable_bytes
    if not cand.fits:
        cand.why = _why_not(cand.memory, job.usable_bytes)
