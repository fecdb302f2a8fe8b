"""What a rank of ``neuron-tp train|generate`` settles before building a model: whether its
launch can work at all, its device, and the lock that keeps threads-as-ranks from sharing the
global RNG while one of them seeds it."""

from __future__ import annotations

import os
import threading

import torch

from ..errors import UserError

# Ranks may be threads of one process (--xla-cpu-devices): the global RNG is shared by them.
# Hold this while seeding the global RNG and drawing a model's initial weights from it.
BUILD_LOCK = threading.Lock()


def rank_device(kind: str) -> torch.device:
    """The device of ``--device kind``: the XLA device of this rank, or the CPU."""
    if kind == "xla":
        from ..backend import xla as _xla

        return _xla.device()
    return torch.device("cpu")


def refuse_xla_ranks_off_neuron(device: str) -> None:
    """``--device xla`` under torchrun with several ranks needs NeuronCores (ValueError)."""
    from ..backend import xla as _xla

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "xla" and world > 1 and not _xla.on_neuron():
        raise UserError(
            f"--device xla with {world} ranks needs NeuronCores: off Neuron the "
            "XLA CPU device runs one rank only; use --device cpu (gloo) for a "
            "multi-rank CPU run"
        )
