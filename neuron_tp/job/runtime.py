"""What a rank of ``neuron-tp train|generate|serve`` settles before building a model: whether
its launch can work at all (:func:`start`), its device, and the lock that keeps threads-as-ranks
from sharing the global RNG while one of them seeds it."""

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


def start(device: str, world=None):
    """The start-up every job shares, before the ranks agree on anything: a multi-rank
    ``--device xla`` launch off Neuron is refused, Neuron's compiler defaults are applied
    (before the first graph compiles), and the whole job is returned as one group (the process
    group created from torchrun's environment if needed, no sub-group yet: the ranks have not
    agreed on ``tp``; ``world``: that group when the caller already has a mesh). Pair it with
    :func:`neuron_tp.parallel.agreement.agreed`."""
    from ..backend.graphs import apply_neuron_defaults
    from ..parallel import agreement

    refuse_xla_ranks_off_neuron(device)
    apply_neuron_defaults()
    return world if world is not None else agreement.world_group()
