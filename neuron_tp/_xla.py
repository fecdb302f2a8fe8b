"""Lazy access to torch-xla. Importing neuron_tp never imports torch_xla (it costs seconds and
may be absent); these helpers import it on first use."""
from __future__ import annotations

import importlib.util
import os

import torch


def available() -> bool:
    """True when torch-xla is installed."""
    return importlib.util.find_spec("torch_xla") is not None


def on_neuron() -> bool:
    """True when this process runs on NeuronCores (PJRT device NEURON or a Neuron device node)."""
    if os.environ.get("PJRT_DEVICE"):
        return os.environ["PJRT_DEVICE"].upper() == "NEURON"
    return os.path.exists("/dev/neuron0")


def is_xla(t: torch.Tensor) -> bool:
    return t.device.type == "xla"


def xm():
    """The ``torch_xla.core.xla_model`` module."""
    import torch_xla.core.xla_model as xla_model
    return xla_model


def device() -> torch.device:
    """The XLA device of this process (a NeuronCore on Neuron, the CPU PJRT device elsewhere).

    Call it before the first ``backward()`` of the process: PyTorch's autograd engine sizes its
    per-device queues once, and a device type registered later makes backward fail.
    """
    if not os.environ.get("PJRT_DEVICE"):
        os.environ["PJRT_DEVICE"] = "NEURON" if on_neuron() else "CPU"
    import torch_xla
    return torch_xla.device()
