"""Run a training or generation job on N XLA CPU devices of this one process.

``neuron-tp train --xla-cpu-devices 4 --tp 2 ...`` runs the same graphs and collectives a
4-NeuronCore job would (tp=2 x dp=2), on the CPU: one thread per device started by
``xmp.spawn``, channel-id collectives between them (see :mod:`neuron_tp.parallel.comm`). For trying
a Neuron configuration's numerics and graph counts on a laptop; far slower than real hardware.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
from collections.abc import Callable

from ..errors import UserError, set_reporter
from ..job.config import GenerateConfig, ServeConfig, TrainConfig
from ..job.presets import preload


def run_on_xla_cpu_devices(n: int, fn: Callable, *args) -> None:
    """Call ``fn(*args)`` once per device, each in its own thread, on ``n`` XLA CPU devices.

    Must run before torch-xla's runtime starts in this process (no XLA tensor created yet).
    """
    if n < 1:
        raise UserError(f"--xla-cpu-devices must be >= 1, got {n}")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise UserError(
            "--xla-cpu-devices runs all ranks in this one process: do not launch "
            "it with torchrun (WORLD_SIZE is set)"
        )
    if os.environ.get("PJRT_DEVICE", "CPU").upper() != "CPU":
        raise UserError(
            f"--xla-cpu-devices needs PJRT_DEVICE=CPU, got "
            f"{os.environ['PJRT_DEVICE']!r}; on NeuronCores launch with torchrun"
        )
    if "torch_xla" in sys.modules and sys.modules["torch_xla"]._XLAC._xla_runtime_is_initialized():
        raise RuntimeError(
            "the XLA runtime already started in this process; "
            "--xla-cpu-devices must be set up before any XLA tensor exists"
        )
    from ..backend import xla as _xla

    os.environ.update(_xla.cpu_devices_env(n))
    import torch_xla.distributed.xla_multiprocessing as xmp

    # fork: the device process starts with this one's imports (spawn would import torch,
    # torch-xla and transformers again, ~10 CPU-seconds); safe here, the runtime is not up
    xmp.spawn(_per_device, args=(fn, args), start_method="fork")


_warm_lock = threading.Lock()


def _per_device(_index: int, fn: Callable, args: tuple) -> None:
    with _warm_lock:
        preload(getattr(args[0], "model", None) if args else None)
    fn(*args)


def _command(config: TrainConfig | GenerateConfig | ServeConfig, fn: Callable):
    """Run ``fn(config)`` as this process's rank (returns what it returns), or as N ranks with
    ``--xla-cpu-devices N`` (returns None)."""
    if not config.xla_cpu_devices:
        return fn(config)
    if config.device != "xla":
        raise UserError("--xla-cpu-devices runs the XLA path: use it with --device xla")
    try:
        run_on_xla_cpu_devices(config.xla_cpu_devices, fn, config)
    except UserError as e:  # one rank's error, raised here: this process reports it
        set_reporter(e, None)
        raise
    return None


def train_command(args: argparse.Namespace | TrainConfig, on_step: Callable | None = None) -> int:
    """``neuron-tp train``: this process's rank(s) of the job described by the parsed
    options ``args`` (turned into a :class:`~neuron_tp.job.config.TrainConfig` here).

    Returns the exit status: 0, or ``128 + signal`` (143 for SIGTERM) when SIGTERM / SIGINT
    stopped the run early after saving a checkpoint (:mod:`neuron_tp.train.preempt`), so
    that nothing takes a preempted run for a finished one (Kubeflow's ``ExitCode`` restart
    policy retries 128-255). ``on_step(run)``: passed to ``train`` (tests)."""
    from ..train.loop import train
    from ..train.preempt import StopSignal

    config = TrainConfig.from_args(args)
    if config.check.enabled:
        from ..train.check import check_job

        return check_job(config)
    if config.check.world_size:
        raise UserError("--world-size is read by --check only (a launched job has its own)")
    if config.plan.global_batch and config.plan.mode != "auto":
        raise UserError(
            "--global-batch is read by --plan auto only; without it the global batch is "
            "--micro-batch x --grad-accum x dp"
        )
    if config.plan.mode == "auto":
        from ..plan.auto import apply_plan, rank0_printer

        config = apply_plan(config, rank0_printer)
    stop = StopSignal()
    # The main thread's handlers (the ranks check the flag per step), and the watchdog where
    # this process's main thread is the rank (with --xla-cpu-devices the ranks are a child's).
    with stop.installed(watchdog=not config.xla_cpu_devices):
        summary = _command(config, functools.partial(train, on_step=on_step, stop=stop))
    stopped = summary.get("stopped_by") if summary is not None else stop.requested
    return stop.exit_code() if stopped else 0


def generate_command(args: argparse.Namespace | GenerateConfig) -> None:
    """``neuron-tp generate``: this process's rank(s) of the generation job (the parsed
    options become a :class:`~neuron_tp.job.config.GenerateConfig` here)."""
    from ..infer.generate_command import run_cli

    _command(GenerateConfig.from_args(args), run_cli)


def serve_command(args: argparse.Namespace | ServeConfig) -> None:
    """``neuron-tp serve``: this process's rank(s) of the server (rank 0 answers HTTP, the
    other tp ranks follow its batches); the options become a
    :class:`~neuron_tp.job.config.ServeConfig` here."""
    from ..infer.serve_command import serve

    _command(ServeConfig.from_args(args), serve)
