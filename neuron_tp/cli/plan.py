"""``neuron-tp plan``: will this model fit on this cluster, and which layout is fastest."""

from __future__ import annotations

import argparse
import json
import sys

from ..plan.hardware import INSTANCES
from .args import positive


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="neuron-tp plan",
        description="Predict per-NeuronCore memory and step time of every tensor/data-parallel "
        "layout of a training job, from traced steps of the code that trains; rank them.",
    )
    p.add_argument(
        "--model",
        required=True,
        help="llama-2-7b, llama-2-13b, llama-2-70b, llama-3-8b, llama-3.1-8b, llama-3.1-70b, "
        "mixtral-8x7b, qwen3-30b-a3b (mixtures of experts), a "
        "preset, a model directory or a config.json",
    )
    p.add_argument("--instance", default="trn1.32xlarge", choices=sorted(INSTANCES))
    p.add_argument("--nodes", type=positive(int), default=1)
    p.add_argument("--seq-len", type=positive(int), required=True)
    p.add_argument(
        "--global-batch", type=positive(int), required=True, help="sequences per optimizer step"
    )
    p.add_argument("--fp32", action="store_true", help="fp32 training (default: --bf16)")
    pins = p.add_argument_group("pin a choice (default: try them all)")
    pins.add_argument("--tp", type=positive(int))
    pins.add_argument("--tp-mode", choices=("1d", "2d", "3d"))
    pins.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction)
    pins.add_argument("--micro-batch", type=positive(int))
    pins.add_argument("--activation-checkpointing", choices=("none", "selective", "full"))
    pins.add_argument("--zero1", action=argparse.BooleanOptionalAction, help="fp32 jobs")
    model = p.add_argument_group("assumptions")
    model.add_argument(
        "--efficiency",
        type=float,
        default=None,
        help="achievable fraction of peak FLOP/s (default 0.5; 1.0 of a --calibration's "
        "measured matmul rate)",
    )
    model.add_argument(
        "--calibration",
        default="",
        metavar="PATH",
        help="measured figures from `neuron-tp selftest --calibrate PATH` instead of the "
        "datasheet's (bandwidths, collective latency, achieved TFLOP/s)",
    )
    model.add_argument(
        "--memory-fraction", type=float, default=0.9, help="of a core's HBM the job may use"
    )
    p.add_argument("--top", type=int, default=20, help="rows to print (0: all)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def job_from_args(args: argparse.Namespace, ranks_per_node: int = 0):
    """The :class:`~neuron_tp.plan.search.Job` of parsed options (checked before tracing)."""
    from ..plan.hardware import get_instance
    from ..plan.search import Job

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
    return Job(
        instance,
        args.nodes,
        args.seq_len,
        args.global_batch,
        bf16=not args.fp32,
        efficiency=efficiency,
        memory_fraction=args.memory_fraction,
        ranks_per_node=ranks_per_node,
    )


def pins_from_args(args: argparse.Namespace) -> dict:
    """The layout options pinned on the command line (None: not pinned), by their
    ``neuron-tp train`` names (:data:`~neuron_tp.plan.search.PINS`)."""
    from ..plan.search import PINS

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
