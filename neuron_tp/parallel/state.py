"""What :func:`neuron_tp.parallelize` records on the model it parallelized: one
:class:`ParallelState`, read back with :func:`state_of` (None: not parallelized). The record is
owned here; no other module reads or writes the attribute that holds it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from .mesh import Mesh, get_mesh

__all__ = ["ParallelState", "attach", "is_parallel", "mesh_of", "state_of"]

_ATTR = "_ntp_state"


@dataclass(frozen=True)
class ParallelState:
    """How a model was parallelized."""

    mesh: Mesh
    parallel_loss: bool = False  # the vocab-parallel loss replaces the model's
    sequence_parallel: bool = False
    lora: dict | None = None  # a LoRA model's adapters (targets, rank, scaling; checkpoints)

    def with_lora(self, lora: dict | None) -> ParallelState:
        """The same record with ``lora`` (None: a merged model, no adapters)."""
        return replace(self, lora=lora)


def attach(model: nn.Module, state: ParallelState) -> None:
    """Record ``state`` on ``model`` (replacing an earlier record)."""
    setattr(model, _ATTR, state)


def state_of(model: nn.Module) -> ParallelState | None:
    """The record :func:`attach` left on ``model``, or None."""
    return getattr(model, _ATTR, None)


def is_parallel(model: nn.Module) -> bool:
    """True once ``model`` was parallelized."""
    return state_of(model) is not None


def mesh_of(model: nn.Module, mesh: Mesh | None = None) -> Mesh:
    """``mesh`` itself, else the mesh ``model`` was parallelized on, else the default mesh."""
    if mesh is not None:
        return mesh
    state = state_of(model)
    return get_mesh(state.mesh if state is not None else None)
