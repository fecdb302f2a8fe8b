"""Which parallel layouts a training job can run: ONE function, :func:`refusals`, lists every
reason a :class:`~neuron_tp.parallel.layout.ParallelLayout` cannot train a model at a batch
shape. ``neuron-tp train`` raises them before any collective, ``train --check`` prints them,
and the planner (``neuron-tp plan``, ``--plan auto``) enumerates only layouts with none, so the
three agree by construction."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from ..layers.ring_attention import check_length
from ..parallel.layout import ParallelLayout, grid_side
from ..pipeline import schedule as schedules
from ..pipeline.stages import SUPPORTED, plan_stages, sliding_window

ND_MODEL_TYPES = ("llama", "mistral", "qwen2")  # what the 2D / 3D layers take
STAGED_CONFIGS = {name.replace("ForCausalLM", "Config"): name for name in SUPPORTED}


@dataclass(frozen=True)
class BatchShape:
    """What a layout splits besides the model: tokens per sequence and sequences per step."""

    seq_len: int
    micro_batch: int
    grad_accum: int = 1
    objective: str = "lm"  # dpo / orpo: a micro-batch of pairs, 2 rows each
    reference: str = "auto"  # --reference of dpo (adapters / copy: a forward at each step)

    @classmethod
    def of(cls, config) -> BatchShape:
        """The shape a ``TrainConfig`` (or anything with its fields) trains."""
        pref = getattr(config, "preference", None)
        objective = pref.objective if pref is not None else "lm"
        reference = pref.reference if pref is not None else "auto"
        return cls(config.seq_len, config.micro_batch, config.grad_accum, objective, reference)


def refusals(layout: ParallelLayout, shape: BatchShape, model_config=None) -> list[str]:
    """Every reason ``layout`` cannot train ``model_config`` (a transformers config; None:
    only the rules that need no model) at ``shape``; empty when it can."""
    out = layout.refusals()  # the degrees first: what no mesh of ``world`` ranks can hold
    out += _tp_rules(layout, shape) + _cp_rules(layout, shape) + _pp_rules(layout, shape)
    out += _preference_rules(layout, shape)
    if model_config is not None:
        out += _model_rules(layout, shape, model_config)
    return out


def job_refusals(config, world: int | None = None, model_config=None) -> list[str]:
    """:func:`refusals` of the layout and shape a ``TrainConfig`` asks for at ``world`` ranks
    (None: the smallest world its degrees make, pp x cp x tp x ep)."""
    if world is None:
        world = config.pipeline.pp * config.context.cp * config.tp * config.ep
    return refusals(ParallelLayout.of(config, world), BatchShape.of(config), model_config)


def refuse(layout: ParallelLayout, shape: BatchShape, model_config=None) -> None:
    """UserError listing every one of :func:`refusals` (nothing when there is none)."""
    why = refusals(layout, shape, model_config)
    if len(why) == 1:
        raise UserError(why[0])
    if why:
        raise UserError(
            f"{len(why)} problems with this layout:\n" + "\n".join(f"  - {w}" for w in why)
        )


def _tp_rules(layout: ParallelLayout, shape: BatchShape) -> list[str]:
    out = []
    if layout.sequence_parallel and layout.tp_mode != "1d":
        out.append(
            f"--sequence-parallel is a --tp-mode 1d option: --tp-mode {layout.tp_mode} "
            "already splits the batch (and the features) over the grid; drop "
            "--sequence-parallel"
        )
    elif layout.sequence_parallel and shape.seq_len % layout.tp:
        out.append(
            f"--sequence-parallel needs --seq-len divisible by --tp "
            f"({shape.seq_len} % {layout.tp} != 0)"
        )
    if layout.tp_mode != "1d":
        q = grid_side(layout.tp, layout.tp_mode)
        chunks = q if layout.tp_mode == "2d" else q * q
        if shape.micro_batch % chunks:
            valid = ", ".join(str(chunks * k) for k in range(1, 5))
            out.append(
                f"--tp-mode {layout.tp_mode} with --tp {layout.tp} (q={q}) splits every "
                f"micro-batch into {chunks} batch chunks: --micro-batch must be a multiple of "
                f"{chunks} ({valid}, ...), got {shape.micro_batch}"
            )
    return out


def _cp_rules(layout: ParallelLayout, shape: BatchShape) -> list[str]:
    cp = layout.cp
    if cp == 1:
        return []
    out = []
    try:
        check_length(shape.seq_len, cp, "--seq-len")
    except ValueError as e:
        out.append(str(e))
    if layout.sequence_parallel and (shape.seq_len // cp) % layout.tp:
        out.append(
            f"--sequence-parallel with --cp {cp}: each rank's {shape.seq_len // cp} tokens "
            f"must split over --tp {layout.tp}; use a --seq-len multiple of "
            f"{2 * cp * layout.tp}"
        )
    unsupported = [f"--tp-mode {layout.tp_mode}"] if layout.tp_mode != "1d" else []
    unsupported += ["--ep"] if layout.ep > 1 else []
    if unsupported:
        out.append(
            f"--cp {cp} does not combine with {', '.join(unsupported)} yet; it works with "
            "--tp (1d, with or without --sequence-parallel), --pp, data parallelism, ZeRO-1 "
            "(--zero1, --bf16), LoRA (--lora-r), activation checkpointing, --eval-data, and "
            "text, packed or padded (--no-packing) instruction data"
        )
    return out


def _pp_rules(layout: ParallelLayout, shape: BatchShape) -> list[str]:
    pp, v = layout.pp, layout.virtual_stages
    if pp == 1:
        if v != 1 or layout.pp_schedule != "1f1b":
            return ["--pp-schedule interleaved / --virtual-stages need --pp > 1"]
        return []
    try:
        schedules.check_schedule_options(layout.pp_schedule, pp, shape.grad_accum, v)
    except ValueError as e:
        return [str(e)]
    return []


def _preference_rules(layout: ParallelLayout, shape: BatchShape) -> list[str]:
    """What ``--objective dpo|orpo`` (per-sequence log-probabilities of pairs) runs with."""
    if shape.objective == "lm":
        return []
    out = []
    if layout.pp > 1 and shape.objective == "dpo" and shape.reference in ("adapters", "copy"):
        out.append(
            f"--reference {shape.reference} does not combine with --pp {layout.pp}: the "
            "pipeline stages run one forward per micro-batch, so the reference is computed "
            "ahead through them (--reference precompute, the default under --pp)"
        )
    mixed = ["--cp > 1"] if layout.cp > 1 else []
    mixed += [f"--tp-mode {layout.tp_mode}"] if layout.tp_mode != "1d" else []
    if layout.pp > 1 and mixed:
        out.append(
            f"--objective {shape.objective} does not support --pp > 1 with "
            f"{' or '.join(mixed)}: the last stage sums the pairs' log-probabilities from "
            "--tp-mode 1d logits of whole rows (not a ring's parts or a grid's blocks); "
            "--cp, --tp-mode 2d / 3d, --ep, --sequence-parallel, data parallelism, --zero1, "
            "--bf16, --lora-r and --eval-data all run with --pp 1, and --pp with --tp-mode 1d "
            "at --cp 1"
        )
    return out


def _model_rules(layout: ParallelLayout, shape: BatchShape, model_config) -> list[str]:
    out = []
    if layout.tp_mode != "1d":
        model_type = getattr(model_config, "model_type", type(model_config).__name__)
        if model_type not in ND_MODEL_TYPES or getattr(model_config, "tie_word_embeddings", False):
            what = "tied embeddings" if model_type in ND_MODEL_TYPES else model_type
            out.append(
                f"--tp-mode {layout.tp_mode} supports untied Llama-family models "
                f"({', '.join(ND_MODEL_TYPES)}); this model is {what}: use --tp-mode 1d"
            )
    if layout.pp > 1:
        out += pp_model_refusals(model_config, shape.seq_len, layout.pp)
        try:
            plan_stages(model_config.num_hidden_layers, layout.pp, layout.virtual_stages)
        except ValueError as e:
            out.append(str(e))
    if layout.cp > 1:
        out += cp_model_refusals(model_config, layout.cp)
    return out


def pp_model_refusals(model_config, seq_len: int, pp: int = 2) -> list[str]:
    """Why this model cannot be cut into ``pp`` pipeline stages at ``seq_len`` (whatever the
    other degrees)."""
    name = type(model_config).__name__
    if name not in STAGED_CONFIGS:
        return [
            f"--pp cuts {', '.join(SUPPORTED)} models by their decoder layers; "
            f"{name.replace('Config', '')} is not one of them (use --pp 1)"
        ]
    window = sliding_window(model_config)
    if window is not None and window < seq_len:
        return [
            f"--pp {pp}: pipeline stages build a plain causal mask, but this model "
            f"attends over a sliding window of {window} tokens, shorter than --seq-len "
            f"{seq_len}: use --seq-len <= {window} or --pp 1"
        ]
    return []


def cp_model_refusals(model_config, cp: int = 2) -> list[str]:
    """Why ring attention (``--cp``) cannot run this model's attention."""
    out = []
    window = sliding_window(model_config)
    for what, value in (("sliding_window", window), ("softcap", _softcap(model_config))):
        if value is not None:
            out.append(
                f"--cp {cp}: {what}={value} is not supported by ring attention; models with "
                "full causal attention (Llama, Qwen2/3, Mistral without sliding window) work"
            )
    return out


def _softcap(model_config) -> float | None:
    value = getattr(model_config, "attn_logit_softcapping", None)
    return value if value else None
