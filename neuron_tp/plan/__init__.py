"""Planning a training job before any Neuron compile (``neuron-tp plan``): for every layout
``neuron-tp train`` can run (tp and mode, sequence parallel, dp, ZeRO-1, recompute, micro-batch
and gradient accumulation), one NeuronCore's memory and the step time, predicted from the code
that trains: parameter and optimizer bytes from the meta-device model sharded for a rank
(:mod:`.state`), collectives, FLOPs and saved activations from a traced step of a virtual rank
(:mod:`.trace`), combined with a cited instance table (:mod:`.hardware`, or the figures
``neuron-tp selftest`` measured: :mod:`.calibration`) in :mod:`.predict`; ranked by
:mod:`.search` and printed by :mod:`.report`. Also: the built-in architectures
(:mod:`.models`), MoE parameter counts (:mod:`.moe`) and ``neuron-tp train --plan auto``
(:mod:`.auto`)."""

from .hardware import INSTANCES, Instance, get_instance
from .search import Candidate, Job, Layout, Plan, make_plan
from .state import StateBytes, state_bytes

__all__ = [
    "INSTANCES",
    "Candidate",
    "Instance",
    "Job",
    "Layout",
    "Plan",
    "StateBytes",
    "get_instance",
    "make_plan",
    "state_bytes",
]
