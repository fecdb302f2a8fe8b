"""``neuron-tp selftest``: prove the library on this machine's devices, in minutes."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from ..errors import UserError
from ..job.options import build_parser, opt, positive
from ..plan.hardware import INSTANCES

CHECKS = ("environment", "collectives", "bandwidth", "layers", "model", "compile", "compute")


@dataclass(frozen=True)
class SelftestArgs:
    """``neuron-tp selftest`` options (:func:`options_from_args` checks them)."""

    device: str = opt(
        "--device",
        "xla",
        "xla: NeuronCores (or XLA CPU devices); cpu: gloo ranks under torchrun",
        choices=("xla", "cpu"),
    )
    xla_cpu_devices: int = opt(
        "--xla-cpu-devices",
        0,
        "run N ranks as XLA CPU devices of this one process (no torchrun)",
        type=int,
        metavar="N",
    )
    tp: int | None = opt(
        "--tp",
        None,
        "tp degree of the mesh (default: the ranks of a node, or half the world from 4 ranks)",
        type=positive(int),
    )
    quick: bool = opt("--quick", False, "a one-minute subset", action="store_true")
    json: bool = opt("--json", False, "print the report as JSON", action="store_true")
    timeout: float = opt(
        "--timeout",
        300.0,
        "seconds per check; a rank stuck longer names its collective and exits 1",
        type=positive(float),
    )
    instance: str = opt(
        "--instance",
        "",
        "print the instance's theoretical bandwidth and peak next to the measured ones",
        choices=sorted(INSTANCES),
    )
    checks: str = opt(
        "--checks", "", f"comma-separated subset of {','.join(CHECKS)} (environment always runs)"
    )
    max_bytes: int | None = opt(
        "--max-bytes",
        None,
        "largest bandwidth message (default 256 MiB on Neuron, 4 MiB --quick; smaller off Neuron)",
        type=positive(int),
    )
    calibrate: str = opt(
        "--calibrate",
        "",
        "write the measured bandwidths, latencies and TFLOP/s as JSON for "
        "`neuron-tp plan --calibration PATH`",
        metavar="PATH",
    )


def selftest_parser() -> argparse.ArgumentParser:
    return build_parser(
        SelftestArgs,
        "neuron-tp selftest",
        "Check collectives (exact results, bus bandwidth), every parallel layer, a "
        "patched tiny Llama (training and generation), compiles and matmul throughput on this "
        "job's devices; one line per check, exit 0 only when all pass. On Neuron: "
        "`torchrun --nproc_per_node=32 -m neuron_tp.cli selftest`.",
    )


def options_from_args(args: argparse.Namespace):
    """The selftest's :class:`~neuron_tp.selftest.context.Options`; UserError on bad input."""
    from ..selftest.context import Options

    checks = tuple(c.strip() for c in args.checks.split(",") if c.strip())
    bad = [c for c in checks if c not in CHECKS]
    if bad:
        raise UserError(f"--checks: unknown {bad}; valid: {', '.join(CHECKS)}")
    if args.xla_cpu_devices < 0:
        raise UserError(f"--xla-cpu-devices must be >= 0, got {args.xla_cpu_devices}")
    if args.xla_cpu_devices and args.device != "xla":
        raise UserError("--xla-cpu-devices runs the XLA path: use it with --device xla")
    if args.calibrate and os.path.isdir(args.calibrate):
        raise UserError(f"--calibrate {args.calibrate!r} is a directory; give a file path")
    return Options(
        device=args.device,
        tp=args.tp or 0,
        quick=args.quick,
        timeout=args.timeout,
        instance=args.instance,
        checks=checks,
        max_bytes=args.max_bytes or 0,
        calibrate=args.calibrate,
        json=args.json,
        xla_cpu_devices=args.xla_cpu_devices,
    )


def selftest_command(argv: list[str]) -> int:
    """Run ``neuron-tp selftest``; the exit status (0: every check passed)."""
    from concurrent.futures.process import BrokenProcessPool

    from ..selftest.runner import SelftestFailed, Shared, run_rank, run_selftest
    from .launch import run_on_xla_cpu_devices

    options = options_from_args(selftest_parser().parse_args(argv))
    shared = Shared(options)
    if not options.xla_cpu_devices:
        return run_selftest(shared)
    try:
        run_on_xla_cpu_devices(options.xla_cpu_devices, run_rank, shared)
    except SelftestFailed:
        return 1
    except BrokenProcessPool:  # the watchdog ended the ranks' process (it said why)
        print("selftest: FAIL (the ranks' process ended early)", file=sys.stderr)
        return 1
    return 0
