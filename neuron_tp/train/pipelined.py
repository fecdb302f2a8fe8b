"""Training with pipeline parallelism (``--pp``; what it refuses is in
:mod:`neuron_tp.job.layout_rules`): the cut of the sharded model into this rank's stage, and
a step's forward and backward through the schedule (:mod:`neuron_tp.pipeline`). A step's
micro-batches are its ``--grad-accum`` batches of ``--micro-batch`` sequences, so the same flags
give the same global batch with and without pipeline parallelism."""

from __future__ import annotations

import torch

from ..hf.lora import is_peft_model
from ..job.config import TrainConfig
from ..job.data import RowData
from ..parallel.mesh import Group, Mesh
from ..pipeline import schedule as schedules
from ..pipeline.runner import PipelineRunner
from ..pipeline.stages import PipelineStage, plan_stages, split_model, sum_tied_grads


def cut(config: TrainConfig, mesh: Mesh, model: torch.nn.Module) -> PipelineStage:
    """Cut ``model`` (sharded, still whole; its parameters may be on the meta device) into
    this rank's stage, in place."""
    pipe = config.pipeline
    plan = plan_stages(model.config.num_hidden_layers, pipe.pp, pipe.virtual_stages)
    # LoRA: the peft wrapper's causal LM is cut; the adapters go with their layers
    causal = model.base_model.model if is_peft_model(model) else model
    return split_model(causal, mesh, plan)


def build(
    config: TrainConfig,
    mesh: Mesh,
    model: torch.nn.Module,
    device,
    *,
    stage: PipelineStage | None = None,
) -> PipelineRunner:
    """The runner of this rank's stage (``stage``, or ``model`` cut by :func:`cut`)."""
    pipe = config.pipeline
    stage = stage if stage is not None else cut(config, mesh, model)
    sched = schedules.build(pipe.pp_schedule, pipe.pp, config.grad_accum, pipe.virtual_stages)
    return PipelineRunner(
        stage,
        sched,
        # a micro-batch of pairs: 2 rows each (chosen, rejected), together on every stage
        batch=config.micro_batch * (1 if config.preference.objective == "lm" else 2),
        seq=config.seq_len,
        device=device,
        sequence_parallel=config.sequence_parallel,
    )


def describe(runner: PipelineRunner) -> str:
    """The startup lines: where the layers went, the schedule and its bubble."""
    return f"pipeline: {runner.stage.plan.describe()}\n{runner.schedule.summary()}"


def forward_backward(runner: PipelineRunner, data: RowData, per_rank: torch.Tensor):
    """The step's micro-batches through the stages; returns the step's loss (this dp rank's
    share, as the loop's own accumulation) with the tied table's gradients summed (both pp
    sums in one small graph of their own)."""
    batches = [data.next_batch() for _ in range(runner.schedule.micro_batches)]
    loss = runner.step(batches, 1.0 / per_rank)
    sum_tied_grads(runner.stage)
    runner.cut()
    return loss


def guard_group(mesh: Mesh) -> Group:
    """The ranks whose step graphs must be the same: all of them at pp 1; else the ranks of
    one stage and replica (stages trace different graphs)."""
    return mesh.group("world") if mesh.pp_size == 1 else mesh.tp
