"""Planning a job before any Neuron compile (issue: ``neuron-tp plan``). So far: the per-rank
bytes of parameters, gradients and optimizer state, from the sharding records of the model
built on the meta device and sharded for the rank (:mod:`.state`)."""

from .state import StateBytes, state_bytes

__all__ = ["StateBytes", "state_bytes"]
