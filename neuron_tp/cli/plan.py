"""``neuron-tp plan``: will this model fit on this cluster, and which layout is fastest."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import ClassVar

from ..job.options import build_parser, group, non_negative, opt, positive
from ..plan.hardware import INSTANCES


@dataclass(frozen=True)
class LayoutPins:
    """Layout options pinned (None: the planner tries them all): the fields are
    :data:`neuron_tp.plan.layouts.PINS`, the `neuron-tp train` options of the same names."""

    TITLE: ClassVar[str] = "pin a choice (default: try them all)"

    tp: int | None = opt("--tp", type=positive(int))
    tp_mode: str | None = opt("--tp-mode", choices=("1d", "2d", "3d"))
    sequence_parallel: bool | None = opt(
        "--sequence-parallel", action=argparse.BooleanOptionalAction
    )
    micro_batch: int | None = opt("--micro-batch", type=positive(int))
    activation_checkpointing: str | None = opt(
        "--activation-checkpointing", choices=("none", "selective", "full")
    )
    zero1: bool | None = opt("--zero1", None, "fp32 jobs", action=argparse.BooleanOptionalAction)
    pp: int | None = opt("--pp", None, "pipeline stages", type=positive(int))
    pp_schedule: str | None = opt("--pp-schedule", choices=("1f1b", "interleaved"))
    virtual_stages: int | None = opt("--virtual-stages", type=positive(int), metavar="V")
    cp: int | None = opt("--cp", None, "context-parallel degree", type=positive(int))
    attention: str | None = opt("--attention", choices=("sdpa", "blockwise"))


@dataclass(frozen=True)
class Assumptions:
    """What the prediction assumes of the hardware."""

    TITLE: ClassVar[str] = "assumptions"

    efficiency: float | None = opt(
        "--efficiency",
        None,
        "achievable fraction of peak FLOP/s (default 0.5; 1.0 of a --calibration's "
        "measured matmul rate)",
        type=float,
    )
    calibration: str = opt(
        "--calibration",
        "",
        "measured figures from `neuron-tp selftest --calibrate PATH` instead of the "
        "datasheet's (bandwidths, collective latency, achieved TFLOP/s)",
        metavar="PATH",
    )
    memory_fraction: float = opt(
        "--memory-fraction", 0.9, "of a core's HBM the job may use", type=float
    )


@dataclass(frozen=True)
class PlanOptions:
    """``neuron-tp plan`` options."""

    model: str = opt(
        "--model",
        None,
        "llama-2-7b, llama-2-13b, llama-2-70b, llama-3-8b, llama-3-70b, llama-3.1-8b, "
        "llama-3.1-70b, llama-3.1-405b, "
        "mixtral-8x7b, qwen3-30b-a3b (mixtures of experts), a "
        "preset, a model directory or a config.json",
        required=True,
    )
    instance: str = opt("--instance", "trn1.32xlarge", choices=sorted(INSTANCES))
    nodes: int = opt("--nodes", 1, type=positive(int))
    seq_len: int = opt("--seq-len", type=positive(int), required=True)
    global_batch: int = opt(
        "--global-batch", None, "sequences per optimizer step", type=positive(int), required=True
    )
    fp32: bool = opt("--fp32", False, "fp32 training (default: --bf16)", action="store_true")
    objective: str = opt(
        "--objective",
        "lm",
        "train's --objective: dpo / orpo count --global-batch and --micro-batch in pairs, "
        "two rows each",
        choices=("lm", "dpo", "orpo"),
    )
    reference: str = opt(
        "--reference",
        "auto",
        "train's --reference of --objective dpo (auto: precompute): its memory per core "
        "(adapters 0, copy one more set of the sharded weights, precompute 2 floats per pair)",
        choices=("auto", "adapters", "copy", "precompute"),
    )
    pairs: int = opt(
        "--pairs",
        0,
        "preference pairs of the training data (--reference precompute holds 2 floats per "
        "pair of a rank's share; 0: one global batch)",
        type=non_negative(int),
    )
    pins: LayoutPins = group(LayoutPins)
    assumptions: Assumptions = group(Assumptions)
    top: int = opt("--top", 20, "rows to print (0: all)", type=int)
    json: bool = opt("--json", False, "print the plan as JSON", action="store_true")


def plan_parser() -> argparse.ArgumentParser:
    return build_parser(
        PlanOptions,
        "neuron-tp plan",
        "Predict per-NeuronCore memory and step time of every tensor/pipeline/context/"
        "data-parallel layout of a training job, from traced steps of the code that "
        "trains; rank them.",
    )


def job_from_args(args: argparse.Namespace, ranks_per_node: int = 0):
    """The :class:`~neuron_tp.plan.layouts.Job` of parsed options (checked before tracing)."""
    from ..plan.hardware import get_instance
    from ..plan.layouts import Job

    instance = get_instance(args.instance)
    efficiency = 0.5 if args.efficiency is None else args.efficiency
    if getattr(args, "calibration", ""):
        from ..plan.calibration import calibrated, load_calibration

        calibration = load_calibration(args.calibration)
        instance = calibrated(instance, calibration)
        if args.efficiency is None and calibration.has_compute:
            efficiency = 1.0
    if args.nodes > 1 and not instance.efa:
        multi = sorted(n for n, i in INSTANCES.items() if i.efa)
        raise ValueError(
            f"{instance.name} has no EFA: multi-node training needs one of {multi} (or --nodes 1)"
        )
    if not 0 < efficiency <= 1 or not 0 < args.memory_fraction <= 1:
        raise ValueError("--efficiency and --memory-fraction must be in (0, 1]")
    if args.reference != "auto" and args.objective != "dpo":
        raise ValueError(f"--reference applies to --objective dpo, not {args.objective}")
    return Job(
        instance,
        args.nodes,
        args.seq_len,
        args.global_batch,
        bf16=not args.fp32,
        efficiency=efficiency,
        memory_fraction=args.memory_fraction,
        ranks_per_node=ranks_per_node,
        objective=args.objective,
        reference=args.reference,
        pairs=args.pairs,
    )


def pins_from_args(args: argparse.Namespace) -> dict:
    """The layout options pinned on the command line (None: not pinned), by their
    ``neuron-tp train`` names (:data:`~neuron_tp.plan.layouts.PINS`)."""
    from ..plan.layouts import PINS

    return {name: getattr(args, name) for name in PINS}


def plan_command(argv: list[str]) -> int:
    """Run ``neuron-tp plan``; 0 when a layout fits, 1 when none does, 2 on bad input."""
    from ..plan.hardware import get_instance
    from ..plan.models import KNOWN, plan_config
    from ..plan.report import plan_dict, plan_table
    from ..plan.search import make_plan

    args = plan_parser().parse_args(argv)
    try:
        job = job_from_args(args)
        config = plan_config(args.model, args.seq_len)
        plan = make_plan(config, job, **pins_from_args(args))
        plan.model = args.model
        if args.calibration:
            from ..plan.calibration import describe, load_calibration

            datasheet = get_instance(args.instance)
            plan.notes.append(describe(datasheet, load_calibration(args.calibration)))
        if args.model.lower() in KNOWN:
            plan.notes.append(
                f"--model {args.model} names an architecture: give train the model's "
                "directory (config.json, weights, tokenizer) instead"
            )
    except ValueError as e:
        print(f"neuron-tp plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan_dict(plan, args.top), indent=1))
    else:
        print(plan_table(plan, args.top or len(plan.candidates)))
    return 0 if plan.recommended else 1
