"""What a training run holds (:class:`Run`, built by :func:`~.loop.setup`) and how it speaks
(:data:`Printer`): the types the loop, its reporting and its checkpoint policy share."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..job.config import TrainConfig
from ..job.data import RowData
from ..optim.adamw import WarmupCosine
from ..parallel.mesh import Mesh
from ..pipeline.runner import PipelineRunner
from .nonfinite import NonFiniteGuard

Printer = Callable[..., None]  # print-like: rank 0's printer, a no-op on the other ranks


@dataclass
class Run:
    """Everything a training run holds (returned by :func:`setup`)."""

    config: TrainConfig
    mesh: Mesh
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer  # or a neuron_tp.optim.zero1.Zero1 (--zero1, --bf16)
    schedule: WarmupCosine
    data: RowData
    tokenizer: object
    step: int = 0
    log: list = field(default_factory=list)  # dicts of logged steps (rank 0 and others)
    guard: NonFiniteGuard | None = None  # non-finite loss / grad norm: stop, or skip the step
    resumed_from: str | None = None  # never deleted by --keep-last during this run
    graph_checked: bool = False  # ranks compared their step graphs (XLA, first step)
    data_fingerprint: dict | None = None  # recorded in checkpoints, compared on resume
    tokenizer_source: str = ""  # "tokenizer: DIR (class, N tokens; why)", logged at start
    # written with every checkpoint: meta extra (the tokenizer record), files (its files)
    checkpoint_extra: dict = field(default_factory=dict)
    checkpoint_files: dict = field(default_factory=dict)
    eval_data: RowData | None = None  # --eval-data of this dp rank (train.evaluate)
    pipeline: PipelineRunner | None = None  # --pp > 1: this rank's stage and schedule
    reference: torch.Tensor | None = None  # --objective dpo: [pairs, 2] reference log-probs
    reference_model: torch.nn.Module | None = None  # --reference copy: the frozen initial model
