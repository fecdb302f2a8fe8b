"""Measured hardware figures in place of the datasheet's: ``neuron-tp selftest --calibrate
PATH`` writes them, ``neuron-tp plan --calibration PATH`` and ``neuron-tp train --plan auto
--plan-calibration PATH`` read them.

A calibration replaces, where it has a figure, the instance's NeuronLink bandwidth per core
(the all-reduce bus bandwidth measured on a tp group inside a node: the quantity
:func:`neuron_tp.plan.predict.comm_seconds` divides ring bytes by), its EFA bandwidth per node,
the fixed cost per collective (the latency of a small all-reduce) and the BF16 FLOP/s per core
(the achieved matmul throughput). Compute is then predicted at ``efficiency`` x that achieved
rate, and the default ``efficiency`` becomes 1.0 (the figure is already an achieved one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

from .hardware import Instance

FORMAT = "neuron_tp-calibration-1"
FIELDS = {  # JSON key -> Instance field
    "link_bandwidth_per_core": "link_bandwidth_per_core",
    "network_bandwidth_per_node": "network_bandwidth",
    "collective_latency_s": "collective_latency",
    "bf16_flops_per_core": "peak_flops_per_core",
}


@dataclass(frozen=True)
class Calibration:
    """The measured figures (SI units; None: not measured, the datasheet's stays)."""

    path: str
    figures: dict[str, float]  # Instance field -> value
    measured_on: str  # e.g. "NEURON x 32 (32/node)"

    @property
    def has_compute(self) -> bool:
        return "peak_flops_per_core" in self.figures


def load_calibration(path: str) -> Calibration:
    """The calibration file ``path``; ValueError saying what is wrong with it."""
    try:
        with open(path) as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"--calibration {path!r}: cannot read it as JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(
            f"--calibration {path!r}: not a calibration file (format {FORMAT!r}); write one "
            "with `neuron-tp selftest --calibrate PATH` on the target instance"
        )
    figures = {}
    for key, attr in FIELDS.items():
        value = data.get(key)
        if value is None:
            continue
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(
                f"--calibration {path!r}: {key} must be a positive number, got {value!r}"
            )
        figures[attr] = float(value)
    return Calibration(path, figures, str(data.get("measured_on", "?")))


def calibrated(instance: Instance, calibration: Calibration) -> Instance:
    """``instance`` with the measured figures in place of the datasheet's."""
    return replace(instance, **calibration.figures)  # type: ignore[arg-type]  # float fields


def describe(before: Instance, calibration: Calibration) -> str:
    """One line for the plan's output: which figures are measured, next to the datasheet's."""
    after = calibrated(before, calibration)
    parts = []
    for attr in FIELDS.values():
        if attr in calibration.figures:
            old, new = getattr(before, attr), getattr(after, attr)
            parts.append(f"{attr} {_fmt(attr, new)} (datasheet {_fmt(attr, old)})")
    return f"calibrated from {calibration.path} (measured on {calibration.measured_on}): " + (
        "; ".join(parts) or "no figures"
    )


def _fmt(attr: str, v: float) -> str:
    if attr == "collective_latency":
        return f"{v * 1e6:.0f} us"
    if attr == "peak_flops_per_core":
        return f"{v / 1e12:.2f} TFLOP/s"
    return f"{v / 1e9:.1f} GB/s"
