"""Enumerate the layouts ``neuron-tp train`` can run for a job, predict each, rank them.

Levers: tp (groups stay inside a node) and mode (1d, 1d + sequence parallel, 2d for tp = q^2,
3d for tp = q^3), dp = world / tp, micro-batch (a multiple of the batch split of 2d/3d) and the
gradient accumulation that makes the global batch, activation recompute (none, selective,
full), ZeRO-1 (always on for bf16: it keeps the fp32 masters). Each layout is traced
(:mod:`.trace`), its memory and time predicted (:mod:`.predict`); layouts that fit come first,
fastest first.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ..job.config import TrainConfig
from ..job.options import option_flags
from ..parallel.mesh import divisors, grid_side
from .hardware import Instance
from .moe import dense_standin, flops_per_token, moe_shape, param_counts, summary, tp_refusal
from .predict import Memory, Timing, memory, timing
from .state import StateBytes, state_bytes
from .trace import Spec, Trace, trace_in_subprocess

RECOMPUTE = ("none", "selective", "full")
MICRO_BATCH_STEPS = (1, 2, 4, 8, 16)
TIGHT = 0.05  # headroom below which a fit is "tight"


@dataclass(frozen=True)
class Job:
    """What to plan for: the cluster, the sequence length and the global batch (sequences
    per optimizer step), and the stated assumptions of the prediction."""

    instance: Instance
    nodes: int
    seq_len: int
    global_batch: int
    bf16: bool = True
    efficiency: float = 0.5  # achievable fraction of peak FLOP/s for matrix products
    memory_fraction: float = 0.9  # of a core's HBM left to the job (runtime, compiler scratch)
    ranks_per_node: int = 0  # 0: one rank per NeuronCore of the instance

    @property
    def per_node(self) -> int:
        return self.ranks_per_node or self.instance.cores

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    @property
    def usable_bytes(self) -> int:
        return int(self.instance.hbm_per_core * self.memory_fraction)


@dataclass(frozen=True)
class Layout:
    """One way to run the job: the ``neuron-tp train`` options it maps to."""

    tp: int
    tp_mode: str
    sequence_parallel: bool
    activation_checkpointing: str  # none | selective | full (neuron_tp.hf.recompute)
    micro_batch: int
    grad_accum: int
    zero1: bool
    dp: int

    def train_options(self) -> dict[str, object]:
        """The ``neuron-tp train`` options this layout sets, by their ``TrainConfig`` field
        (each a field of the layout of the same name; ``dp`` follows from the world size), in
        command-line order: THE mapping between layouts and training options (the planner's
        pins, ``--plan auto`` and the printed commands all use it)."""
        return {name: getattr(self, name) for name in TRAIN_OPTIONS}

    def train_args(self) -> list[str]:
        """The ``neuron-tp train`` command-line options of this layout."""
        flags, args = option_flags(TrainConfig), []
        for name, value in self.train_options().items():
            if isinstance(value, bool):
                args += [flags[name]] if value else []
            else:
                args += [flags[name], str(value)]
        return args


# the Layout fields that are ``neuron-tp train`` options, in the order of the printed commands
TRAIN_OPTIONS = (
    "tp",
    "tp_mode",
    "micro_batch",
    "grad_accum",
    "activation_checkpointing",
    "sequence_parallel",
    "zero1",
)
# the options ``make_plan`` may pin (grad_accum follows from the global batch)
PINS = tuple(name for name in TRAIN_OPTIONS if name != "grad_accum")


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


def _modes(tp: int, seq_len: int) -> list[tuple[str, bool, int]]:
    """(tp_mode, sequence_parallel, batch split) of every mode tp allows."""
    modes = [("1d", False, 1)]
    if tp > 1 and seq_len % tp == 0:
        modes.append(("1d", True, 1))
    q2, q3 = grid_side(tp, "2d"), grid_side(tp, "3d")
    if tp > 1 and q2 * q2 == tp:
        modes.append(("2d", False, q2))
    if tp > 1 and q3**3 == tp:
        modes.append(("3d", False, q3 * q3))
    return modes


def _layouts(job: Job, pins: dict) -> tuple[list[Layout], list[str]]:
    """Every layout of the job (respecting ``pins``: option -> value), and notes on what was
    left out."""
    notes = []
    tps = [t for t in divisors(job.world) if t <= job.per_node]
    if pins.get("tp"):
        if pins["tp"] not in divisors(job.world):
            raise ValueError(
                f"--tp {pins['tp']} does not divide the {job.world} ranks of {job.nodes} x "
                f"{job.instance.name}; valid: {divisors(job.world)}"
            )
        tps = [pins["tp"]]
    out = []
    for tp in tps:
        dp = job.world // tp
        if job.global_batch % dp:
            notes.append(f"tp={tp}: global batch {job.global_batch} is not a multiple of dp={dp}")
            continue
        for mode, sp, split in _modes(tp, job.seq_len):
            if pins.get("tp_mode") not in (None, mode):
                continue
            if pins.get("sequence_parallel") is not None and pins["sequence_parallel"] != sp:
                continue
            per_rank = job.global_batch // dp
            for m in MICRO_BATCH_STEPS:
                b = split * m
                if per_rank % b or pins.get("micro_batch") not in (None, b):
                    continue
                for rec in RECOMPUTE:
                    if pins.get("activation_checkpointing") not in (None, rec):
                        continue
                    for zero1 in (True,) if job.bf16 else (False, True):
                        if pins.get("zero1") not in (None, zero1) and not job.bf16:
                            continue
                        out.append(Layout(tp, mode, sp, rec, b, per_rank // b, zero1, dp))
    return out, notes


def _spec_key(lay: Layout) -> tuple:
    return (lay.tp, lay.tp_mode, lay.sequence_parallel, lay.activation_checkpointing, lay.zero1)


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
                        seq_len=job.seq_len,
                        dp=lay.dp,
                        zero1=lay.zero1,
                        bf16=job.bf16,
                        layers=layers,
                    )
                )
                owners.append((key, (layers, k)))
    workers = max(1, min(4, (os.cpu_count() or 1), len(specs)))
    chunks = [specs[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda c: trace_in_subprocess(config, c), chunks))
    flat: list[Trace | str] = [None] * len(specs)
    for i, res in enumerate(results):
        flat[i::workers] = res
    traced: dict[tuple, dict | str] = {}
    for (key, where), res in zip(owners, flat):
        if isinstance(res, str):
            traced[key] = res
        elif not isinstance(traced.get(key), str):
            traced.setdefault(key, {})[where] = res
    return traced


def _why_not(mem: Memory, usable: int) -> str:
    parts = {
        "parameters": mem.params,
        "gradients": mem.grads,
        "optimizer": mem.optimizer + mem.masters,
        "activations": mem.activations,
        "comm buffer": mem.comm_buffer,
    }
    big = max(parts, key=parts.get)
    return (
        f"needs {mem.total / 2**30:.1f} GiB per core > {usable / 2**30:.1f} GiB usable "
        f"(largest: {big} {parts[big] / 2**30:.1f} GiB)"
    )


def _verdict(config, job: Job, candidates: list[Candidate], states) -> str:
    """What to do when nothing fits (pipeline parallelism, or more nodes for ZeRO-1)."""
    if any(c.fits for c in candidates):
        return "fits"
    sized = [c for c in candidates if c.memory is not None]
    if not sized:
        return "no layout can run: " + "; ".join(sorted({c.why for c in candidates}))[:500]
    best = min(sized, key=lambda c: c.memory.total)
    mem = best.memory
    rest = mem.total - mem.optimizer - mem.masters
    if rest > job.usable_bytes:
        return (
            f"does not fit without pipeline parallelism (not in neuron_tp): even at tp="
            f"{best.layout.tp} with ZeRO-1 and full recompute, parameters + gradients + one "
            f"micro-batch need {rest / 2**30:.1f} GiB per core > {job.usable_bytes / 2**30:.1f}"
            " GiB usable, and more nodes do not shrink them"
        )
    need = (mem.optimizer + mem.masters) * best.layout.dp / (job.usable_bytes - rest)
    nodes = math.ceil(need * best.layout.tp / job.per_node)
    return (
        f"does not fit on {job.nodes} node(s): the optimizer state needs ZeRO-1 over about "
        f"{math.ceil(need)} data-parallel ranks at tp={best.layout.tp} (about {nodes} x "
        f"{job.instance.name}), or pipeline parallelism (not in neuron_tp)"
    )


def make_plan(config, job: Job, **pins) -> Plan:
    """Rank every layout of ``config`` (a transformers config) for ``job``. ``pins`` fix
    options (:data:`PINS`): tp, tp_mode, sequence_parallel, activation_checkpointing,
    micro_batch, zero1. A mixture of
    experts is traced as its dense stand-in (:mod:`.moe`: the static dense routing's
    parameters, FLOPs and collectives); its MFU counts the active parameters' FLOPs."""
    start = time.perf_counter()
    layouts, notes = _layouts(job, {k: v for k, v in pins.items() if v is not None})
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
    runnable = [lay for lay in layouts if not refused.get(lay.tp)]
    traced = _trace_all(config, job, runnable) if runnable else {}
    states: dict[tuple, StateBytes] = {}
    candidates = []
    for lay in layouts:
        cand = Candidate(lay)
        candidates.append(cand)
        traces = refused.get(lay.tp) or traced[_spec_key(lay)]
        if isinstance(traces, str):
            cand.why = traces
            continue
        skey = (lay.tp, lay.tp_mode, lay.dp, lay.zero1)
        if skey not in states:
            states[skey] = state_bytes(
                config,
                lay.tp,
                tp_mode=lay.tp_mode,
                dp=lay.dp,
                rank=0,
                bf16=job.bf16,
                zero1=lay.zero1,
            )
        state, k = states[skey], lay.micro_batch / _b0(lay)
        layers = config.num_hidden_layers
        base = traced[_spec_key(replace(lay, activation_checkpointing="none"))]
        cand.memory = memory(
            state, traces, layers, k, None if base is traces else base, zero1=lay.zero1
        )
        cand.timing, _ = timing(
            traces,
            state,
            layers,
            k,
            grad_accum=lay.grad_accum,
            instance=job.instance,
            ranks_per_node=job.per_node,
            bf16=job.bf16,
            efficiency=job.efficiency,
        )
        _, model_flops = timing(
            base,
            state,
            layers,
            k,
            grad_accum=lay.grad_accum,
            instance=job.instance,
            ranks_per_node=job.per_node,
            bf16=job.bf16,
            efficiency=1.0,
        )
        peak = (
            job.instance.peak_flops_per_core if job.bf16 else job.instance.peak_fp32_flops_per_core
        )
        cand.seq_per_s = job.global_batch / cand.timing.step
        cand.mfu = useful * model_flops / (peak * cand.timing.step)
        cand.fits = cand.memory.total <= job.usable_bytes
        cand.headroom = 1 - cand.memory.total / job.usable_bytes
        if not cand.fits:
            cand.why = _why_not(cand.memory, job.usable_bytes)
    candidates.sort(
        key=lambda c: (
            not c.fits,
            c.tight,  # comfortable fits first
            c.memory is None,
            -round(c.seq_per_s, 6) if c.fits else 0,
            c.memory.total if c.memory else 0,  # then the smaller footprint
        )
    )
    verdict = _verdict(config, job, candidates, states)
    n_traces = 4 * len({_spec_key(c.layout) for c in candidates if not refused.get(c.layout.tp)})
    plan = Plan(job, candidates, verdict, time.perf_counter() - start, n_traces, notes)
    plan.summary, plan.params = lines, (counts.total, counts.active)
    return plan
