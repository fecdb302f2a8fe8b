"""What a training run reports: its opening line, one entry per logged step (kept on every
rank, printed by rank 0, written to TensorBoard and ``metrics.jsonl``) with the evaluation's
values at eval steps, the throughput, and the closing line."""

from __future__ import annotations

import os
import time

import torch

from ..backend.graphs import graph_counters
from .metrics import MetricsFile
from .preference import metric_names
from .run import Printer, Run


class StepLogger:
    """The reporting of one run of ``steps`` global steps (see the module docstring).

    ``on_log`` is the step closure of logged steps: it does the only two host reads of a log
    step (loss, grad norm). Tokens/s of a log line cover the steps since the previous line;
    :meth:`throughput` leaves the first two (compiling) steps out when the run is long enough.
    """

    def __init__(self, run: Run, steps: int, say: Printer, extract: bool):
        config, mesh = run.config, run.mesh
        self.run, self.steps, self.say, self.extract = run, steps, say, extract
        rows = 2 if config.preference.objective != "lm" else 1  # a pair: chosen + rejected
        self.tokens_per_step = (
            rows * config.seq_len * config.micro_batch * config.grad_accum * mesh.dp_size
        )
        self.writer = None
        if config.tensorboard and mesh.rank == 0 and not extract:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.writer = SummaryWriter(os.path.join(config.checkpoint.output_dir, "tensorboard"))
        self.metrics = None
        if mesh.rank == 0 and not extract:
            self.metrics = MetricsFile(config.checkpoint.output_dir, run.step)
        self._pending: dict | None = None  # this step's entry, written once the step is done
        now = time.perf_counter()
        self._last_log = (run.step, now)  # (step, time) of the previous log line
        self._start = (run.step, now)  # this process's first step
        self._steady = self._start  # moved past the first two (compiling) steps

    def begin(self) -> None:
        """The opening line: model, mesh, device, shapes, steps."""
        config, mesh = self.run.config, self.run.mesh
        self.say(
            f"neuron-tp train: {config.model} {mesh} device={self.run.device} "
            f"seq_len={config.seq_len} "
            f"global batch={config.micro_batch * config.grad_accum * mesh.dp_size} "
            f"steps={self.steps}"
            + (
                " [NEURON_EXTRACT_GRAPHS_ONLY: tracing only, no checkpoints]"
                if self.extract
                else ""
            )
        )

    def on_log(
        self,
        step: int,
        lr: float,
        loss: torch.Tensor,
        norm: torch.Tensor,
        metrics: torch.Tensor | None = None,
    ) -> None:
        """Record and print logged step ``step`` (called once its values exist)."""
        now = time.perf_counter()
        tps = (step - self._last_log[0]) * self.tokens_per_step / max(now - self._last_log[1], 1e-9)
        self._last_log = (step, now)
        if self.extract:
            self.say(f"step {step}/{self.steps} traced")
            return
        run = self.run
        loss, norm = loss.cpu(), norm.cpu()  # the only two host transfers of a log step
        entry = {
            "step": step,
            "loss": float(loss[0]),
            "lr": lr,
            "grad_norm": float(norm[0]),
            "tokens_per_s": tps,
            **graph_counters(),
        }
        if metrics is not None:  # --objective dpo|orpo (neuron_tp.train.preference)
            names = metric_names(run.config.preference.objective)
            entry.update(zip(names, (float(v) for v in metrics.cpu()), strict=True))
        if run.guard is not None:
            run.guard.note(step, loss, norm)
            if run.guard.skip:
                entry["skipped_steps"] = run.guard.skipped
        run.log.append(entry)
        self._pending = entry
        self.say(
            f"step {step:>6}/{self.steps} | loss {entry['loss']:.4f} | lr {lr:.2e} | grad "
            f"norm {entry['grad_norm']:.3f} | {tps:,.0f} tok/s | compiles "
            f"{entry['compiles'] if run.device.type == 'xla' else 'n/a (eager)'}"
            + "".join(f" | {k} {entry[k]:.4f}" for k in self._preference_keys(entry))
            + (
                f" | skipped {entry['skipped_steps']} non-finite step(s)"
                if entry.get("skipped_steps")
                else ""
            ),
            flush=True,
        )
        if self.writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                self.writer.add_scalar(f"train/{key}", entry[key], step)

    @staticmethod
    def _preference_keys(entry: dict) -> list[str]:
        return [k for k in ("rewards/margins", "rewards/accuracies", "nll_loss") if k in entry]

    def on_eval(self, step: int, result: dict | None) -> None:
        """Add an evaluation's values (:meth:`~.evaluate.Evaluator.evaluate`) to step
        ``step``'s entry (an eval step is a log step) and print them."""
        if result is None:  # traced only
            self.say(f"step {step}/{self.steps} eval traced")
            return
        entry = self._pending
        if entry is None or entry["step"] != step:
            raise RuntimeError(f"evaluation at step {step} without that step's log entry")
        entry.update(result)
        if "eval_pairs" in result:  # --objective dpo|orpo
            keys = ("eval_rewards/margins", "eval_rewards/accuracies")
            shown = "".join(f" | {k} {result[k]:.4f}" for k in keys)
            shown += f" | {result['eval_pairs']} pairs"
        else:
            shown = f" | perplexity {result['eval_perplexity']:.3f} | "
            shown += f"{result['eval_tokens']} tokens"
        self.say(
            f"eval   {step:>6}/{self.steps} | eval loss {result['eval_loss']:.4f}{shown}",
            flush=True,
        )
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", result["eval_loss"], step)
            if "eval_perplexity" in result:
                self.writer.add_scalar("eval/perplexity", result["eval_perplexity"], step)

    def step_done(self, step: int) -> None:
        """After each step (and its evaluation): its metrics line; the throughput clock
        starts after the first two steps."""
        if self._pending is not None:
            if self.metrics is not None:
                self.metrics.write(self._pending)
            self._pending = None
        if step == self._start[0] + 2:
            self._steady = (step, time.perf_counter())

    def throughput(self, step: int) -> float:
        """Tokens/s of this process's steps up to ``step``, the device drained first; without
        the first two steps unless fewer than two came after them."""
        mark = self._steady if step - self._steady[0] >= 2 else self._start
        if self.run.device.type == "xla":
            from ..backend import xla as _xla

            _xla.wait_own_device()
        elapsed = time.perf_counter() - mark[1]
        return (step - mark[0]) * self.tokens_per_step / max(elapsed, 1e-9)

    def finish(self, summary: dict) -> None:
        """The closing line; closes TensorBoard."""
        self.say(
            f"done: {summary['steps']} steps ({summary['steps_this_run']} this run), "
            f"{summary['tokens_per_s']:,.0f} tok/s (after the first 2 steps), "
            f"{summary['compiles']} graph compiles, "
            f"peak memory {summary['peak_memory_mb']:.0f} MiB, "
            f"checkpoints: {summary['checkpoints'] or 'none'}"
        )
        if self.writer is not None:
            self.writer.close()
        if self.metrics is not None:
            self.metrics.close()
