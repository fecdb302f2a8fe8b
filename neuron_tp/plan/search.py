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
import time
from dataclasses import dataclass, field, replace

from ..job.config import TrainConfig
from ..job.layout_rules import BatchShape, refusals
from ..job.options import option_flags
from ..parallel.layout import ParallelLayout, divisors, grid_side
from . import trace_store
from .hardware import Instance
from .moe import dense_standin, flops_per_token, moe_shape, param_counts, summary, tp_refusal
from .pipeline import pipeline_refusal
from .predict import Memory, Timing
from .stages import TRACED_DP, model_shape, stage_memories, stage_timing
from .state import StateBytes, stage_state_bytes
from .trace import Spec

RECOMPUTE = ("none", "selective", "full")
CP_STEPS = (1, 2, 4, 8)  # context-parallel degrees searched (the ring inside a node)
CP_MIN_SEQ = 16384  # shorter sequences are planned without context parallelism
MAX_PP = 16  # pipeline degrees searched (unless pinned)
BLOCKWISE_MIN_SEQ = 8192  # shorter sequences are planned with sdpa (unless pinned)
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
    pp: int = 1
    pp_schedule: str = "1f1b"
    virtual_stages: int = 1
    cp: int = 1
    attention: str = "sdpa"

    def train_options(self) -> dict[str, object]:
        """The ``neuron-tp train`` options this layout sets, by their ``TrainConfig`` field
        (each a field of the layout of the same name; ``dp`` follows from the world size:
        world / (pp x cp x tp)), in
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
    "pp",
    "pp_schedule",
    "virtual_stages",
    "cp",
    "attention",
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


def _modes(tp: int, seq_len: int, pins: dict) -> list[tuple[str, bool, int]]:
    """(tp_mode, sequence_parallel, batch split) of every mode tp allows; a pinned mode
    whatever tp is (:func:`~neuron_tp.job.layout_rules.refusals` then says why not)."""
    if pins.get("tp_mode") and pins.get("sequence_parallel") is not None:
        mode = pins["tp_mode"]
        q = max(1, grid_side(tp, mode))
        return [(mode, pins["sequence_parallel"], {"1d": 1, "2d": q, "3d": q * q}[mode])]
    modes = [("1d", False, 1)]
    if tp > 1 and seq_len % tp == 0:
        modes.append(("1d", True, 1))
    q2, q3 = grid_side(tp, "2d"), grid_side(tp, "3d")
    if tp > 1 and q2 * q2 == tp:
        modes.append(("2d", False, q2))
    if tp > 1 and q3**3 == tp:
        modes.append(("3d", False, q3 * q3))
    return modes


def _axes(job: Job, layers: int, tp: int, pins: dict) -> list[tuple[int, int]]:
    """(cp, pp) pairs to try at ``tp``: cp (blockwise attention's ring, inside a node) only
    for sequences of :data:`CP_MIN_SEQ` and more; pp dividing the layers, at most
    :data:`MAX_PP`. Pinned values are tried whatever their size."""
    rest = job.world // tp
    cps = [1]
    if pins.get("cp"):
        cps = [pins["cp"]]
    elif job.seq_len >= CP_MIN_SEQ:
        cps = [c for c in CP_STEPS if rest % c == 0 and c * tp <= job.per_node]
    out = []
    for cp in cps:
        pinned = bool(pins.get("cp"))  # tried whatever it is: the layout rules say why not
        if not pinned and (rest % cp or job.seq_len % (2 * cp)):
            continue
        if pins.get("pp"):
            out.append((cp, pins["pp"]))
            continue
        pps = [p for p in divisors(layers) if p <= MAX_PP]
        out += [(cp, pp) for pp in pps if (rest // cp) % pp == 0]
    return out


def _schedules(pp: int, layers: int, pins: dict) -> list[tuple[str, int]]:
    """(pp_schedule, virtual_stages) to try: 1F1B, and interleaved with v = 2, 4 chunks."""
    out = [("1f1b", 1)]
    if pp > 1:
        out += [("interleaved", v) for v in (2, 4) if layers % (pp * v) == 0]
    if pins.get("virtual_stages"):
        v = pins["virtual_stages"]
        out = [("interleaved", v)] if v > 1 else [("1f1b", 1)]
    return [o for o in out if pins.get("pp_schedule") in (None, o[0])]


def _attentions(mode: str, cp: int, pins: dict, seq_len: int) -> list[str]:
    """sdpa, and blockwise in 1d from :data:`BLOCKWISE_MIN_SEQ` (or pinned); context
    parallelism needs blockwise."""
    long = seq_len >= BLOCKWISE_MIN_SEQ or pins.get("attention") == "blockwise"
    out = ["sdpa", "blockwise"] if mode == "1d" and long else ["sdpa"]
    out = ["blockwise"] if cp > 1 else out
    return [a for a in out if pins.get("attention") in (None, a)]


def _check_pins(job: Job, layers: int, pins: dict) -> None:
    """Refuse pinned values the planner cannot predict (before any tracing); what train
    refuses is left to :func:`~neuron_tp.job.layout_rules.refusals`."""
    pp, v = pins.get("pp") or 1, pins.get("virtual_stages") or 1
    why = pipeline_refusal(
        layers, pp, 10**9, pins.get("pp_schedule") or ("interleaved" if v > 1 else "1f1b"), v
    )
    if why:
        raise ValueError(f"--pp {pp}: {why}")
    cp = pins.get("cp") or 1
    if cp > 1 and pins.get("attention") == "sdpa":
        raise ValueError("--cp > 1 runs blockwise attention (the K/V ring): --attention blockwise")


def _layouts(job: Job, pins: dict, model_config) -> tuple[list[Layout], list[str]]:
    """Every layout of the job that ``neuron-tp train`` runs (respecting ``pins``: option ->
    value; :func:`neuron_tp.job.layout_rules.refusals` decides), and notes on what was left
    out."""
    layers = model_config.num_hidden_layers
    _check_pins(job, layers, pins)
    notes: list[str] = []
    refused: dict[str, None] = {}  # train's reasons for what was left out, in order
    tps = [t for t in divisors(job.world) if t <= job.per_node]
    tps = [pins["tp"]] if pins.get("tp") else tps
    out = []
    for tp in tps:
        for cp, pp in _axes(job, layers, tp, pins):
            dp = max(1, job.world // (tp * cp * pp))
            mode = pins.get("tp_mode") or "1d"
            degrees = ParallelLayout(job.world, tp, mode, pp=pp, cp=cp).refusals()
            if degrees:
                refused.update(dict.fromkeys(degrees))
                continue
            if job.global_batch % dp:
                notes.append(
                    f"tp={tp} pp={pp} cp={cp}: global batch {job.global_batch} is not a "
                    f"multiple of dp={dp}"
                )
                continue
            out += _at(job, pins, model_config, refused, tp=tp, cp=cp, pp=pp, dp=dp)
    if not out:
        notes += list(refused)[:3]
    if pins.get("pp", 1) > 1 and not out:
        notes.append(
            f"--pp {pins['pp']}: no micro-batch split gives {pins['pp']} or more micro-"
            "batches per step (global batch / dp / micro-batch): raise --global-batch or "
            "lower --pp"
        )
    short = sum(1 for n in notes if "not a multiple" in n)
    if short > 3:
        notes = [n for n in notes if "not a multiple" not in n][:3] + [
            f"{short} (tp, pp, cp) combinations left out: the global batch is not a multiple "
            "of their dp"
        ]
    return out, notes


def _at(
    job: Job, pins: dict, model_config, refused: dict, *, tp: int, cp: int, pp: int, dp: int
) -> list:
    """The layouts at these axes that train runs (the reasons of those it does not go into
    ``refused``): mode, attention, micro-batch, schedule, recompute, ZeRO-1."""
    out = []
    per_rank, layers = job.global_batch // dp, model_config.num_hidden_layers
    for mode, sp, split in _modes(tp, job.seq_len // cp, pins):
        if pins.get("tp_mode") not in (None, mode):
            continue
        if pins.get("sequence_parallel") is not None and pins["sequence_parallel"] != sp:
            continue
        for attention in _attentions(mode, cp, pins, job.seq_len):
            sizes = [split * m for m in MICRO_BATCH_STEPS]
            for b in [pins["micro_batch"]] if pins.get("micro_batch") else sizes:
                if per_rank % b:
                    continue
                for sched, v in _schedules(pp, layers, pins):
                    if pipeline_refusal(layers, pp, per_rank // b, sched, v):
                        continue  # what the stage predictions cover: even cuts
                    layout = ParallelLayout(job.world, tp, mode, sp, pp, sched, v, cp, 1, attention)
                    why = refusals(layout, BatchShape(job.seq_len, b, per_rank // b), model_config)
                    if why:
                        refused.update(dict.fromkeys(why))
                        continue
                    for rec in RECOMPUTE:
                        if pins.get("activation_checkpointing") not in (None, rec):
                            continue
                        if attention == "blockwise" and rec == "selective":
                            continue  # the same run as none: blockwise recomputes its tiles
                        for zero1 in (True,) if job.bf16 else (False, True):
                            if pins.get("zero1") not in (None, zero1) and not job.bf16:
                                continue
                            lay = Layout(tp, mode, sp, rec, b, per_rank // b, zero1, dp)
                            out.append(
                                replace(
                                    lay,
                                    pp=pp,
                                    pp_schedule=sched,
                                    virtual_stages=v,
                                    cp=cp,
                                    attention=attention,
                                )
                            )
    return out


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


def _axes_text(lay: Layout) -> str:
    text = f"tp={lay.tp}"
    text += f" x pp={lay.pp}" if lay.pp > 1 else ""
    return text + (f" x cp={lay.cp}" if lay.cp > 1 else "")


def _verdict(job: Job, candidates: list[Candidate]) -> str:
    """What to do when nothing fits (more pipeline stages, or more nodes for ZeRO-1)."""
    if any(c.fits for c in candidates):
        return "fits"
    sized = [c for c in candidates if c.memory is not None]
    if not sized:
        return "no layout can run: " + "; ".join(sorted({c.why for c in candidates}))[:500]
    best = min(sized, key=lambda c: c.memory.total)
    mem, lay = best.memory, best.layout
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
    layouts, notes = _layouts(job, pins, config)
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
    k = lay.micro_batch / _b0(lay)
    shape = model_shape(config, lay, job.seq_len, job.bf16)
    mems = stage_memories(lay, traces, None if base is traces else base, states, shape, k)
    cand.stage = max(range(len(mems)), key=lambda i: mems[i].total)
    cand.memory = mems[cand.stage]
    cand.timing, _ = stage_timing(lay, traces, states, shape, job, k)
    plain = replace(lay, activation_checkpointing="none")
    _, model_flops = stage_timing(plain, base, states, shape, job, k)
    peak = job.instance.peak_flops_per_core if job.bf16 else job.instance.peak_fp32_flops_per_core
    cand.seq_per_s = job.global_batch / cand.timing.step
    cand.mfu = useful * model_flops / (peak * cand.timing.step)
    cand.fits = cand.memory.total <= job.usable_bytes
    cand.headroom = 1 - cand.memory.total / job.usable_bytes
    if not cand.fits:
        cand.why = _why_not(cand.memory, job.usable_bytes)
