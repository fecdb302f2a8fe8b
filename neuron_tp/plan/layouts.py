"""The layouts ``neuron-tp plan`` considers for a job: the job and layout records, and the
enumeration of every layout ``neuron-tp train`` runs (the levers: tp and its mode, pp with its
schedule, cp, micro-batch, recompute, ZeRO-1, attention), each one accepted by the same rules
train applies (:func:`neuron_tp.job.layout_rules.refusals`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..job.config import TrainConfig
from ..job.layout_rules import BatchShape, refusals
from ..job.options import option_flags
from ..parallel.layout import ParallelLayout, divisors, grid_side
from .hardware import Instance
from .pipeline import pipeline_refusal

RECOMPUTE = ("none", "selective", "full")
CP_STEPS = (1, 2, 4, 8)  # context-parallel degrees searched (the ring inside a node)
CP_MIN_SEQ = 16384  # shorter sequences are planned without context parallelism
MAX_PP = 16  # pipeline degrees searched (unless pinned)
BLOCKWISE_MIN_SEQ = 8192  # shorter sequences are planned with sdpa (unless pinned)
MICRO_BATCH_STEPS = (1, 2, 4, 8, 16)


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
    objective: str = "lm"  # --objective: dpo / orpo run fewer layouts (job.layout_rules)
    reference: str = "auto"  # --reference of dpo (predict.reference_kind)
    pairs: int = 0  # preference pairs of the training data (0: one global batch)

    @property
    def rows(self) -> int:
        """Rows a sequence of the batch is: a preference pair is two (chosen, rejected)."""
        return 1 if self.objective == "lm" else 2

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


def enumerate_layouts(job: Job, pins: dict, model_config) -> tuple[list[Layout], list[str]]:
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
                    why = refusals(
                        layout,
                        BatchShape(job.seq_len, b, per_rank // b, job.objective, job.reference),
                        model_config,
                    )
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
