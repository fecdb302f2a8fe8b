"""Shared pieces of the training tests on gloo ranks: the training CLI's options for a tiny
CPU run (seq 32, warm-up 3, cosine to 1e-4, clipping at 1.0), a silent printer, the losses
of a run's summary."""

from __future__ import annotations

import argparse

from neuron_tp.cli.args import train_parser

# the schedule of the tiny training runs, on any device
SCHEDULE = [
    "--seq-len",
    "32",
    "--log-every",
    "1",
    "--warmup-steps",
    "3",
    "--lr",
    "3e-3",
    "--min-lr",
    "1e-4",
    "--max-grad-norm",
    "1.0",
]
COMMON = ["--device", "cpu", *SCHEDULE]


def train_args(out, *extra: str) -> argparse.Namespace:
    """``neuron-tp train`` options: ``COMMON``, ``--output-dir out`` and ``extra``."""
    return train_parser().parse_args([*COMMON, "--output-dir", str(out), *extra])


def quiet(*a, **k) -> None:
    """A printer that prints nothing."""


def losses(summary: dict) -> list[float]:
    """The logged losses of a ``train`` summary, in step order."""
    return [e["loss"] for e in summary["log"]]
