"""Evaluation during training (``--eval-data``, ``--eval-every``, ``--eval-batches``).

The eval loss is the mean token loss over every label token (``labels != -100``, after the
causal shift) of the eval batches of all data-parallel ranks, the same masking as training;
the perplexity is its exponential. The model runs in eval mode (no dropout) under
``no_grad``, one micro-batch of the training shape per XLA graph: an evaluation adds exactly
one graph to a run, compiled once, whatever the number of batches or evaluations. The totals
(loss sum, token count) stay on the device; the one host read is at the end of an evaluation.
Preference pairs (``--objective dpo|orpo``): the eval loss and TRL's metrics
(``eval_rewards/chosen``, ...) as means over the eval pairs (:func:`.preference.eval_totals`).
With pipeline stages (``--pp``) the eval batches go through the stages on a forward-only
schedule (:meth:`~neuron_tp.pipeline.runner.PipelineRunner.evaluate`: a fixed set of graphs
per stage, as in training) and every stage holds the last stage's totals.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from ..backend.graphs import step_boundary
from ..errors import UserError
from ..hf.attention import takes_segments
from ..hf.packing import IGNORE_INDEX, model_inputs
from ..job.config import TrainConfig
from ..job.data import RowData
from ..job.train_data import load_train_rows
from ..parallel import comm
from ..parallel.mesh import Mesh
from ..pipeline.runner import PipelineRunner
from .preference import metric_names


def eval_data(config: TrainConfig, tokenizer, mesh: Mesh) -> RowData | None:
    """This dp rank's eval data (file order, no shuffle), None without ``--eval-data``;
    UserError for inconsistent options or missing, empty or too small eval data."""
    if config.eval.data is None:
        if config.eval.every or config.eval.batches:
            raise UserError("--eval-every / --eval-batches need --eval-data FILE")
        return None
    if not config.eval.every:
        raise UserError(
            f"--eval-data {config.eval.data!r} needs --eval-every N (steps between evaluations)"
        )
    if not os.path.exists(config.eval.data):
        raise UserError(
            f"--eval-data {config.eval.data!r} does not exist; pass a .txt/.jsonl/.parquet/"
            ".arrow file or a directory of them"
        )
    try:
        data = load_train_rows(
            config,
            config.eval.data,
            tokenizer,
            dp_size=mesh.dp_size,
            dp_rank=mesh.dp_rank,
            training=False,
            in_order=True,
        )
    except UserError as e:
        raise UserError(f"--eval-data: {e}") from None
    if config.eval.batches > data.batches_per_epoch:
        raise UserError(
            f"--eval-batches {config.eval.batches}: --eval-data {config.eval.data!r} has only "
            f"{data.batches_per_epoch} batches of micro_batch x dp = {data.global_batch} "
            f"sequences of {config.seq_len}; pass at most {data.batches_per_epoch} (or 0: all)"
        )
    return data


def label_count(labels: torch.Tensor) -> torch.Tensor:
    """How many tokens a causal LM's loss averages over: labels after the shift != -100."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def evaluation_totals(
    model: torch.nn.Module,
    data,
    batches: int,
    mesh: Mesh,
    device: torch.device,
    mask_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``[loss sum, label tokens]`` (fp32, on ``device``) of the next ``batches`` batches of
    ``data`` on every dp rank, summed over the dp ranks; one graph cut per batch. A packed
    batch's attention mask is built in ``mask_dtype`` (the model's dtype, as in training)."""
    training = model.training
    model.eval()
    totals = torch.zeros(2).to(device)  # device data: every batch traces the same graph
    segments = takes_segments(model.config)  # blockwise / ring attention: no 4D mask
    try:
        with torch.no_grad():
            for _ in range(batches):
                batch = {k: v.to(device) for k, v in data.next_batch().items()}
                # the training step's masking and packing
                inputs = model_inputs(batch, dtype=mask_dtype, segments=segments)
                n = label_count(inputs["labels"]).float()
                loss = model(**inputs).loss.float()
                # a batch without label tokens has a NaN mean: it adds nothing
                part = torch.stack([torch.where(n > 0, loss, torch.zeros_like(loss)) * n, n])
                totals = totals + comm.all_reduce(part, mesh.dp)
                step_boundary(device)
    finally:
        model.train(training)
    return totals


class Evaluator:
    """When to evaluate a run and how: every ``--eval-every`` steps and at the last step
    (``--steps``), the first ``--eval-batches`` batches of the eval data (the same ones each
    time). Under ``neuron_parallel_compile`` (``extract``) one batch is traced after the first
    step, so the eval graph is compiled ahead of training, and nothing is read."""

    def __init__(
        self,
        config: TrainConfig,
        data: RowData,
        first_step: int,
        extract: bool,
        pairs: Callable[[RowData, int], torch.Tensor] | None = None,
    ):
        self.every, self.data, self.extract = config.eval.every, data, extract
        self.pairs, self.objective = pairs, config.preference.objective
        self.batches = config.eval.batches or data.batches_per_epoch
        self.first_step, self.last_step = first_step, config.steps
        self.mask_dtype = config.model_dtype  # packed batches' mask: as in training

    def due(self, step: int) -> bool:
        """Whether global step ``step`` ends with an evaluation."""
        if self.extract:
            return step == self.first_step + 1
        return step % self.every == 0 or step == self.last_step

    def _pair_result(self, totals: torch.Tensor) -> dict | None:
        """TRL's eval names (``eval_loss``, ``eval_rewards/chosen``, ...): means over the
        eval pairs."""
        if self.extract:
            return None
        values = [float(v) for v in totals.cpu()]  # the one host read
        count = values[-1]
        names = ("loss", *metric_names(self.objective))
        out = {f"eval_{k}": v / count for k, v in zip(names, values[:-1], strict=True)}
        return out | {"eval_pairs": int(count)}

    def evaluate(
        self,
        model: torch.nn.Module,
        mesh: Mesh,
        device: torch.device,
        *,
        pipeline: PipelineRunner | None = None,
    ) -> dict | None:
        """``{"eval_loss", "eval_perplexity", "eval_tokens"}`` (None when only tracing);
        ``pipeline``: this rank's stage runner at ``--pp`` > 1."""
        self.data.position = 0
        batches = 1 if self.extract else self.batches
        if self.pairs is not None:
            return self._pair_result(self.pairs(self.data, batches))
        if pipeline is not None:
            mine = pipeline.evaluate([self.data.next_batch() for _ in range(batches)])
            totals = comm.all_reduce(mine, mesh.dp)
        else:
            totals = evaluation_totals(model, self.data, batches, mesh, device, self.mask_dtype)
        if self.extract:
            return None
        loss_sum, count = (float(v) for v in totals.cpu())  # the one host read
        if count == 0:
            raise UserError(
                f"--eval-data: the {self.batches} eval batch(es) have no label tokens "
                "(every label is -100); nothing to evaluate"
            )
        loss = loss_sum / count
        return {
            "eval_loss": loss,
            "eval_perplexity": math.exp(loss) if loss < 700 else math.inf,
            "eval_tokens": int(count),
        }
