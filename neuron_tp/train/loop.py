"""The training loop: setup (agreement, model, optimizer), the optimizer step (gradient
accumulation, TP/DP gradient sync, clipping by the true global norm, one graph per step, host
reads only at log intervals) and the run from first to last step.

Its parts: options in :mod:`neuron_tp.job.config`, AdamW and the schedule in
:mod:`neuron_tp.optim.adamw`, gradient reduction in :mod:`neuron_tp.optim.grads`, graph shaping
and counters in :mod:`neuron_tp.backend.graphs`; next to it the run's state (:mod:`.run`),
reporting (:mod:`.step_log`), checkpoints and resume (:mod:`.checkpoint_policy`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import torch

from ..backend.graphs import (
    extract_graphs_only,
    graph_counters,
    on_step_end,
    peak_memory_mb,
    step_boundary,
)
from ..errors import UserError
from ..hf.attention import takes_segments
from ..hf.packing import check_packable, model_inputs
from ..hf.recompute import apply_activation_checkpointing
from ..job.config import TrainConfig
from ..job.data import RowData, vocab_size
from ..job.layout_rules import BatchShape, refuse
from ..job.presets import is_preset, model_config, preload
from ..job.runtime import BUILD_LOCK, rank_device, start
from ..job.tokenizer import check_vocab, checkpoint_assets, config_vocab, resolve_tokenizer
from ..job.train_data import load_train_rows
from ..optim.adamw import WarmupCosine, make_optimizer
from ..optim.grads import reduce_gradients
from ..parallel import comm
from ..parallel.layout import ParallelLayout
from ..parallel.mesh import Mesh, init_mesh
from ..parallel.sharding import move_to
from . import build, pipelined, preference
from . import peft_wrap as lora
from .checkpoint_policy import (
    check_finite,
    claim_output,
    periodic_save_due,
    restore,
    save,
    save_at_end,
)
from .evaluate import Evaluator, eval_data
from .graph_guard import check_same_graph
from .nonfinite import NonFiniteGuard
from .preempt import StopSignal, signal_name, stop_agreed
from .run import Printer, Run
from .step_log import StepLogger


def _layout(config: TrainConfig, world, mesh: Mesh | None, hf_config) -> Mesh:
    """This rank's place in the job's mesh (``mesh``, or one built for the checks), after
    refusing a layout the job cannot run (:func:`~neuron_tp.job.layout_rules.refuse`: every
    reason at once) and a ``mesh`` that contradicts the options."""
    layout = ParallelLayout.of(config, world.size)
    refuse(layout, BatchShape.of(config), hf_config)
    if mesh is not None:
        _check_given_mesh(config, mesh)
    if config.tensorboard:
        import importlib.util

        if importlib.util.find_spec("tensorboard") is None:
            raise UserError("--tensorboard needs the tensorboard package (pip install tensorboard)")
    return mesh or Mesh.of(layout, world.rank)


def _check_given_mesh(config: TrainConfig, mesh: Mesh) -> None:
    """A ``mesh`` passed to :func:`setup` must be the one the options describe."""
    pp, cp = config.pipeline.pp, config.context.cp
    if (mesh.pp_size, mesh.cp_size) != (pp, cp):
        raise ValueError(f"mesh has pp={mesh.pp_size}, cp={mesh.cp_size} but --pp={pp}, --cp={cp}")
    if mesh.ep_size != config.ep:
        raise ValueError(f"mesh has ep={mesh.ep_size} but --ep={config.ep}")
    if mesh.tp_size != config.tp:
        raise ValueError(f"mesh has tp={mesh.tp_size} but --tp={config.tp}")
    if mesh.tp_mode != config.tp_mode:
        raise ValueError(
            f"mesh has tp_mode={mesh.tp_mode!r} but --tp-mode={config.tp_mode}: pass "
            f"init_mesh(tp={config.tp}, tp_mode={config.tp_mode!r})"
        )
    if mesh.reduce_dtype != config.mesh_reduce_dtype:
        raise ValueError(
            f"mesh has reduce_dtype={mesh.reduce_dtype} but --reduce-dtype="
            f"{config.reduce_dtype}: pass init_mesh(..., reduce_dtype="
            f"{config.mesh_reduce_dtype})"
        )


def setup(args: TrainConfig | argparse.Namespace, mesh: Mesh | None = None) -> Run:
    """Build mesh, device, data, model (sharded), optimizer and schedule from the options.

    The ranks first agree (one small all-gather over the world, before the tp groups exist) on
    every option, library versions, model config and files, tokenizer and training tokens, and
    once the model is sharded on its weights; a rank that differs or fails makes every rank
    raise (:mod:`neuron_tp.parallel.agreement`) instead of hanging or training different models."""
    from ..parallel import agreement

    config = TrainConfig.from_args(args)
    preference.check_options(config)
    world = start(config.device, mesh.group("world") if mesh is not None else None)
    with agreement.agreed(world, "neuron-tp train") as agree:  # local work, then the check
        with BUILD_LOCK:
            preload(config.model)
        resolved = resolve_tokenizer(config.tokenizer, config.model)
        tokenizer = resolved.tokenizer
        hf_config = model_config(config.model, resolved.size)
        check_vocab(resolved, config_vocab(hf_config), config.model)
        layout = _layout(config, world, mesh, hf_config)  # this rank's place; the layout's checks
        data = load_train_rows(
            config, config.data, tokenizer, dp_size=layout.dp_size, dp_rank=layout.dp_rank
        )
        evaluation = eval_data(config, tokenizer, layout)
        if any("segment_ids" in d.rows for d in (data, evaluation) if d is not None):
            check_packable(hf_config, config.seq_len)  # a 4D mask, or segment ids at --cp
        agree.values, agree.details = startup_values(config, tokenizer, data)
        record, files = checkpoint_assets(resolved, config.model)
    device = rank_device(config.device)  # before any backward (see neuron_tp.xla_device)
    mesh = mesh or init_mesh(
        layout.tp_size,
        layout.tp_mode,
        reduce_dtype=config.mesh_reduce_dtype,
        ep=layout.ep_size,
        pp=layout.pp_size,
        cp=layout.cp_size,
    )
    stages: list = []  # --pp: this rank's stage, cut before its weights are read

    def cut(whole) -> None:
        stages.append(pipelined.cut(config, mesh, whole))

    vocab = vocab_size(tokenizer)
    model = build.sharded_model(config, mesh, vocab, cut if mesh.pp_size > 1 else None)
    pipeline = pipelined.build(config, mesh, model, device, stage=stages[0]) if stages else None
    build.attention(model, config, mesh)
    apply_activation_checkpointing(model, config.activation_checkpointing)
    move_to(model, device).train()  # keeps tied embeddings tied (CPU -> XLA unties them)
    reference_model = None  # --reference copy: the initial model, frozen, no optimizer state
    if preference.reference_kind(config) == "copy":
        reference_model = build.reference_copy(config, mesh, vocab, device)
    optimizer = make_optimizer(
        model,
        config.optim.lr,
        config.optim.weight_decay,
        device,
        zero1_mesh=mesh if config.uses_zero1 else None,
    )
    schedule = WarmupCosine(
        optimizer, config.optim.lr, config.optim.min_lr, config.optim.warmup_steps, config.steps
    )
    return Run(
        config,
        mesh,
        device,
        model,
        optimizer,
        schedule,
        data,
        tokenizer,
        guard=NonFiniteGuard(device, skip=config.skip_nonfinite),
        tokenizer_source=resolved.describe(),
        checkpoint_extra={"tokenizer": record},
        checkpoint_files=files,
        eval_data=evaluation,
        pipeline=pipeline,
        reference_model=reference_model,
    )


def startup_values(
    config: TrainConfig, tokenizer, data: RowData | None = None
) -> tuple[dict, dict[str, dict]]:
    """What every rank must agree on before anything else (``values``, ``details``, see
    :func:`neuron_tp.parallel.agreement.check_agreement`): every option, library versions, the model
    config (and, for a local model, its files), the tokenizer and the training tokens."""
    from ..hf.model_files import check_model_dir, checkpoint_files, files_fingerprint
    from ..job.presets import model_config
    from ..parallel.agreement import fingerprint, tensor_checksum, versions

    values = config.option_values()
    if not is_preset(config.model) and os.path.isdir(config.model):
        check_model_dir(config.model)  # e.g. a neuron_tp checkpoint: say what to do instead
    model_cfg = {
        k: v
        for k, v in model_config(config.model, vocab_size(tokenizer)).to_dict().items()
        if k != "_name_or_path"
    }
    details = {"model config": model_cfg}
    values.update({"library versions": versions(), "model config": model_cfg})
    if not is_preset(config.model):
        files = files_fingerprint(checkpoint_files(config.model).values())
        values["model files (size, header + sampled data checksum)"] = details[
            "model files (size, header + sampled data checksum)"
        ] = files
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    values["tokenizer"] = {
        "class": type(tokenizer).__name__,
        "size": vocab_size(tokenizer),
        "vocabulary": fingerprint(sorted(vocab.items())) if vocab else None,
    }
    if data is not None:
        values["training data (tokens)"] = {
            "sequences": len(data.chunks),
            "checksum": tensor_checksum(data.chunks),
        }
        if "rejected_input_ids" in data.rows:  # preference pairs: the other half too
            values["training data (tokens)"]["rejected"] = tensor_checksum(
                data.rows["rejected_input_ids"]
            )
    return values, details


def train_step(run: Run, log_this_step: bool, on_log: Callable | None) -> None:
    """One optimizer step (``grad_accum`` micro-batches) ending in exactly one graph cut;
    on a log step ``on_log(step, lr, loss, grad_norm)`` once the step's values exist."""
    config, model, mesh, dev = run.config, run.model, run.mesh, run.device
    run.optimizer.zero_grad(set_to_none=True)
    lr = run.schedule.apply()
    loss_sum = None
    # The loss is the mean over every loss token of the step (all micro-batches, all dp
    # ranks), as one unsharded model would take it: each micro-batch's sum / (tokens / dp),
    # since the dp gradient reduction averages. A device tensor: the graph stays the same.
    tokens = max(1, run.data.loss_tokens(config.grad_accum))
    per_rank = torch.tensor(tokens / mesh.dp_size, dtype=torch.float32).to(dev)
    segments = takes_segments(model.config)  # blockwise / ring attention: no [b, 1, s, s] mask
    pairs = config.preference.objective != "lm"
    metrics = None
    if pairs:  # the mean over the step's pairs: each micro-batch's sum / (k * grad_accum)
        scale = torch.tensor(float(config.micro_batch * config.grad_accum)).to(dev)
    if run.pipeline is not None and pairs:
        loss_sum, metrics = preference.pipeline_step(run, scale, run.reference)
    elif run.pipeline is not None:
        loss_sum = pipelined.forward_backward(run.pipeline, run.data, per_rank)
    for _ in range(config.grad_accum if pairs and run.pipeline is None else 0):
        batch = {k: t.to(dev) for k, t in run.data.next_batch().items()}
        loss, summed = preference.micro_step(run, batch, scale, run.reference)
        loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        metrics = summed.detach() if metrics is None else metrics + summed.detach()
    for _ in range(config.grad_accum if run.pipeline is None and not pairs else 0):
        batch = {k: t.to(dev) for k, t in run.data.next_batch().items()}
        # a packed batch's 4D mask in the model's dtype (half the bytes of fp32 under --bf16)
        inputs = model_inputs(batch, dtype=config.model_dtype, segments=segments)
        loss = model(**inputs, num_items_in_batch=per_rank).loss
        loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    norm = reduce_gradients(
        model,
        run.optimizer,
        mesh,
        config.optim.max_grad_norm,
        config.uses_zero1,
        pp_sum=None if run.pipeline is None else run.pipeline.pp_sum,
    )
    zero = run.optimizer if config.uses_zero1 else None
    # Computed at every step (so every step traces the same graph), read only at log steps,
    # after the graph ran (step closure): the dp-mean loss and the global gradient norm.
    mean_loss = comm.all_reduce(loss_sum.float().reshape(1), mesh.dp) / mesh.dp_size
    if metrics is not None:  # the step's pairs: micro_batch x grad_accum x dp
        metrics = comm.all_reduce(metrics.float(), mesh.dp) / (
            config.micro_batch * config.grad_accum * mesh.dp_size
        )
    norm = norm.float().reshape(1)
    guard = run.guard
    if guard is None:
        run.optimizer.step()
    else:  # non-finite steps counted on the device (and undone there with --skip-nonfinite)
        ok = guard.observe(mean_loss, norm)
        if zero is not None:
            zero.step(ok if guard.skip else None)
        else:
            guard.optimizer_step(run.optimizer, ok)
        mean_loss, norm = guard.pack(mean_loss, norm)  # the counters travel with the values
    run.schedule.step()
    run.step += 1
    if log_this_step:
        if metrics is not None:
            on_step_end(dev, on_log, run.step, lr, mean_loss, norm, metrics)
        else:
            on_step_end(dev, on_log, run.step, lr, mean_loss, norm)
    if dev.type == "xla" and not run.graph_checked:  # before it runs: a mismatch would hang
        state = [
            t
            for st in run.optimizer.state.values()
            for t in st.values()
            if isinstance(t, torch.Tensor)
        ]
        tensors = [*model.parameters(), *state, mean_loss, norm]
        tensors += [] if metrics is None else [metrics]
        check_same_graph(tensors, pipelined.guard_group(mesh))
        run.graph_checked = True
    step_boundary(dev)


def _silent(*_args, **_kwargs) -> None:
    """The printer of ranks other than 0."""


def train(
    args: TrainConfig | argparse.Namespace,
    mesh: Mesh | None = None,
    stop_at: int | None = None,
    printer: Printer = print,
    on_step: Callable[[Run], None] | None = None,
    stop: StopSignal | None = None,
) -> dict:
    """Run training as configured by ``args`` (a :class:`~neuron_tp.job.config.TrainConfig`,
    or the Namespace of :func:`~neuron_tp.cli.args.train_parser`).

    ``stop_at``: end the process's work after that global step (and its periodic checkpoint)
    without a final checkpoint, as if the job had been killed (for resume tests).
    ``on_step(run)`` is called after every step's graph cut. ``stop``: when any rank's
    :class:`~.preempt.StopSignal` is set (SIGTERM / SIGINT), every rank ends after the same
    step and saves it (summary ``stopped_by``: the signal's name). Returns the summary (rank-local
    ``log`` of the logged steps included). Before training every rank checks, together, that
    --output-dir is writable and not used by another job (a lock held until return), and that
    the resume source and the planned checkpoints fit those already there."""
    run = setup(args, mesh)
    say = printer if run.mesh.rank == 0 else _silent
    say(run.tokenizer_source)
    if run.pipeline is not None:
        say(pipelined.describe(run.pipeline))
    for note in run.data.notes:
        say(note)
    lock = claim_output(run, say)
    try:
        return _train(run, stop_at, say, on_step, stop)
    finally:
        if lock is not None:
            lock.release()


def _references(run: Run, say: Printer, extract: bool) -> torch.Tensor | None:
    """DPO's reference log-probabilities of the training pairs (into ``run.reference``) and
    those of the eval pairs (returned), when they are computed ahead (not under extract)."""
    if not preference.needs_reference_pass(run.config) or extract:
        return None
    run.reference = preference.reference_pass(run, say)
    if run.eval_data is None:
        return None
    return preference.reference_pass(run, say, run.eval_data, preference.EVAL_REFERENCE_FILE)


def _evaluator(
    run: Run, start_step: int, extract: bool, eval_reference: torch.Tensor | None
) -> Evaluator | None:
    if run.eval_data is None:
        return None
    pairs = None
    if run.config.preference.objective != "lm":
        pairs = preference.eval_totals(run, eval_reference)
    return Evaluator(run.config, run.eval_data, start_step, extract, pairs)


def _train(
    run: Run,
    stop_at: int | None,
    say: Printer,
    on_step: Callable[[Run], None] | None,
    stop: StopSignal | None = None,
) -> dict:
    """The steps of this process, from the resumed one to ``--steps`` (or ``stop_at``).

    Under ``neuron_parallel_compile`` (:func:`~neuron_tp.backend.graphs.extract_graphs_only`)
    only three steps are traced (with the eval graph after the first, see
    :class:`~.evaluate.Evaluator`), and nothing is checked or saved. An eval step is a log step
    too: its metrics line (:mod:`.metrics`) carries both."""
    config, extract = run.config, extract_graphs_only()
    steps = min(config.steps, 3) if extract else config.steps
    restore(run, say)  # the checkpoint claim_output chose, if any
    eval_reference = _references(run, say, extract)
    if run.guard is not None:
        run.guard.base = run.step
    start_step = run.step
    logger = StepLogger(run, steps, say, extract)
    logger.begin()
    evaluator = _evaluator(run, start_step, extract, eval_reference)
    saved: list[str] = []
    stopped = False
    while run.step < steps:
        nxt = run.step + 1
        evaluate_now = evaluator is not None and evaluator.due(nxt)
        log_now = nxt % config.log_every == 0 or nxt == steps or evaluate_now
        train_step(run, log_this_step=log_now, on_log=logger.on_log)
        if run.guard is not None and not extract:  # what the log closure saw (no transfer)
            check_finite(run, sync=False)
        if evaluate_now:
            result = evaluator.evaluate(run.model, run.mesh, run.device, pipeline=run.pipeline)
            logger.on_eval(run.step, result)
        logger.step_done(run.step)
        if on_step is not None:
            on_step(run)
        if not extract and periodic_save_due(config, run.step):
            saved.append(save(run))
        if not extract and stop_agreed(stop, run.mesh):
            stopped = run.step < steps
            if stopped:
                say(f"stop requested: saving step {run.step} of {steps} and exiting")
            break
        if stop_at is not None and run.step >= stop_at:
            break
    if stop is not None:
        stop.settle()  # the final save runs to its end, signalled or not
    tokens_per_s = logger.throughput(run.step)  # the final checkpoint is not timed
    trained = run.step > start_step
    if extract:  # trace the checkpoint's synchronisation too, without writing anything
        from .. import checkpoint

        checkpoint.dry_run_save(run.model, run.mesh)
    else:
        save_at_end(run, saved, finished=run.step >= steps or stopped, trained=trained)
        if config.lora.r and trained:
            saved = lora.save(run.model, config.checkpoint.output_dir, run.mesh)
            say(f"LoRA adapters (PEFT format): {saved}")
    if not trained:
        say(f"nothing to do: already at step {run.step} of {steps} (--steps, --resume)")
    summary = {
        "steps": run.step,
        "steps_this_run": run.step - start_step,
        "tokens_per_s": tokens_per_s,
        **graph_counters(),
        "peak_memory_mb": peak_memory_mb(run.device),
        "checkpoints": [c for c in saved if os.path.isdir(c)],  # --keep-last removed others
        "log": run.log,
        "extract_graphs_only": extract,
        "stopped_by": signal_name(stop) if stopped else None,
    }
    logger.finish(summary)
    return summary
