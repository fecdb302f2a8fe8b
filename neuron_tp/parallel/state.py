"""What :func:`neuron_tp.parallelize` records on the model it parallelized: one
:class:`ParallelState`, read back with :func:`state_of` (None: not parallelized). The record is
owned here; no other module reads or writes the attribute that holds it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from .mesh import Mesh, get_mesh

__all__ = [
    "ParallelState",
    "StageOfModel",
    "attach",
    "is_parallel",
    "mesh_of",
    "stage_of",
    "state_of",
]

_ATTR = "_ntp_state"


@dataclass(frozen=True)
class StageOfModel:
    """What a pipeline stage's model (this rank's part of a whole model, stage ``mesh.pp.rank``)
    is of the whole one, so that its checkpoints read like the whole model's.

    ``whole``: the whole model's parameter names (tied ones once), in order. ``copies``: ``(name
    here, whole-model name)`` of each parameter this stage holds as a copy of one another stage
    saves (a tied embedding table: the last stage's LM head)."""

    whole: tuple[str, ...]
    copies: tuple[tuple[str, str], ...] = ()

    def saved_name(self, name: str) -> str:
        """The whole-model name of this stage's parameter ``name``."""
        return dict(self.copies).get(name, name)


@dataclass(frozen=True)
class ParallelState:
    """How a model was parallelized."""

    mesh: Mesh
    parallel_loss: bool = False  # the vocab-parallel loss replaces the model's
    sequence_parallel: bool = False
    lora: dict | None = None  # a LoRA model's adapters (targets, rank, scaling; checkpoints)
    stage: StageOfModel | None = None  # a pipeline stage's model: what it is of the whole

    def with_lora(self, lora: dict | None) -> ParallelState:
        """The same record with ``lora`` (None: a merged model, no adapters)."""
        return replace(self, lora=lora)

    def with_stage(self, stage: StageOfModel | None) -> ParallelState:
        """The same record of a pipeline stage's model (None: a whole model)."""
        return replace(self, stage=stage)


def attach(model: nn.Module, state: ParallelState) -> None:
    """Record ``state`` on ``model`` (replacing an earlier record)."""
    setattr(model, _ATTR, state)


def state_of(model: nn.Module) -> ParallelState | None:
    """The record :func:`attach` left on ``model``, or None."""
    return getattr(model, _ATTR, None)


def stage_of(model: nn.Module) -> StageOfModel | None:
    """What pipeline stage ``model`` is of a whole model (None: a whole model)."""
    state = state_of(model)
    return state.stage if state is not None else None


def is_parallel(model: nn.Module) -> bool:
    """True once ``model`` was parallelized."""
    return state_of(model) is not None


def mesh_of(model: nn.Module, mesh: Mesh | None = None) -> Mesh:
    """``mesh`` itself, else the mesh ``model`` was parallelized on, else the default mesh."""
    if mesh is not None:
        return mesh
    state = state_of(model)
    return get_mesh(state.mesh if state is not None else None)
