"""The training loop: AdamW, warmup + cosine decay, gradient accumulation, TP/DP gradient
sync, clipping by the true global norm, one graph per optimizer step, host reads only at log
intervals, sharded checkpoints and exact resume."""
from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field

import torch

from .. import comm
from ..grads import (allreduce_data_parallel_grads, clip_grad_norm_, global_grad_norm,
                     sync_sequence_parallel_grads)
from ..mesh import Mesh, init_mesh
from ..sharding import move_to
from . import compile as C
from .data import PackedData, load_tokenizer, vocab_size
from .nonfinite import NonFiniteGuard
from .graph_guard import check_same_graph
from .presets import build_model, is_preset, preload


class WarmupCosine:
    """Linear warmup to ``lr`` over ``warmup`` steps, cosine decay to ``min_lr`` at ``total``.

    The learning rate is computed on the host from the step count (known without reading the
    device) and handed to the optimizer as a device tensor, so it is graph *data*: the step
    graph is the same at every step."""

    def __init__(self, optimizer, lr: float, min_lr: float, warmup: int, total: int):
        self.optimizer, self.base, self.min_lr = optimizer, lr, min_lr
        self.warmup, self.total, self.step_count = warmup, total, 0

    def value(self, step: int) -> float:
        if step < self.warmup:
            return self.base * (step + 1) / self.warmup
        span = max(1, self.total - self.warmup)
        progress = min(1.0, (step - self.warmup) / span)
        return self.min_lr + 0.5 * (self.base - self.min_lr) * (1 + math.cos(math.pi * progress))

    def apply(self) -> float:
        """Set the learning rate of the upcoming step; returns it."""
        lr = self.value(self.step_count)
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].copy_(torch.tensor(lr, dtype=group["lr"].dtype))
            else:
                group["lr"] = lr
        return lr

    def step(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        return {"step_count": self.step_count, "base": self.base, "min_lr": self.min_lr,
                "warmup": self.warmup, "total": self.total}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float,
                   device: torch.device) -> torch.optim.AdamW:
    """AdamW; on XLA with a tensor learning rate and ``capturable`` (the step count stays on
    the device: no host read, no step-dependent constant in the graph). Matrices decay,
    vectors (norms, biases) do not."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    xla = device.type == "xla"
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    if xla:
        for g in groups:
            g["lr"] = torch.tensor([lr], dtype=torch.float32, device=device)
    return torch.optim.AdamW(groups, lr=lr, capturable=xla, foreach=False)


@dataclass
class Run:
    """Everything a training run holds (returned by :func:`setup`)."""

    args: object
    mesh: Mesh
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosine
    data: PackedData
    tokenizer: object
    step: int = 0
    log: list = field(default_factory=list)  # dicts of logged steps (rank 0 and others)
    guard: NonFiniteGuard | None = None  # non-finite loss / grad norm: stop, or skip the step
    resumed_from: str | None = None  # never deleted by --keep-last during this run
    graph_checked: bool = False  # ranks compared their step graphs (XLA, first step)


# Ranks may be threads of one process (--xla-cpu-devices): the global RNG is shared by them.
_BUILD_LOCK = threading.Lock()


def _device(kind: str) -> torch.device:
    if kind == "xla":
        from .. import _xla
        return _xla.device()
    return torch.device("cpu")


def refuse_xla_ranks_off_neuron(device: str) -> None:
    """``--device xla`` under torchrun with several ranks needs NeuronCores (ValueError)."""
    from .. import _xla
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if device == "xla" and world > 1 and not _xla.on_neuron():
        raise ValueError(f"--device xla with {world} ranks needs NeuronCores: off Neuron the "
                         "XLA CPU device runs one rank only; use --device cpu (gloo) for a "
                         "multi-rank CPU run")


def setup(args, mesh: Mesh | None = None) -> Run:
    """Build mesh, device, data, model (sharded), optimizer and schedule from parsed args.

    The ranks first agree (one small all-gather over the world, before the tp groups exist) on
    every option, library versions, model config and files, tokenizer and training tokens, and
    once the model is sharded on its weights; a rank that differs or fails makes every rank
    raise (:mod:`neuron_tp.agreement`) instead of hanging or training different models."""
    from .. import agreement
    refuse_xla_ranks_off_neuron(args.device)
    C.apply_neuron_defaults()  # before the first (agreement) graph compiles on Neuron
    world = mesh.group("world") if mesh is not None else agreement.world_group()
    error, values, details, tokenizer, data = None, {}, {}, None, None
    try:  # local work only: a failure here is shared with every rank by the check below
        with _BUILD_LOCK:
            preload(args.model)
        if args.seq_len % args.tp and args.sequence_parallel:
            raise ValueError(f"--sequence-parallel needs --seq-len divisible by --tp "
                             f"({args.seq_len} % {args.tp} != 0)")
        layout = mesh or Mesh(world.size, world.rank, tp=args.tp)  # valid tp? dp rank
        if layout.tp_size != args.tp:
            raise ValueError(f"mesh has tp={layout.tp_size} but --tp={args.tp}")
        if args.tensorboard:
            import importlib.util
            if importlib.util.find_spec("tensorboard") is None:
                raise ValueError("--tensorboard needs the tensorboard package (pip install "
                                 "tensorboard)")
        tokenizer = load_tokenizer(args.tokenizer)
        data = PackedData(args.data, tokenizer, args.seq_len, args.micro_batch, layout.dp_size,
                          layout.dp_rank, args.seed)
        values, details = startup_values(args, tokenizer, data)
    except Exception as e:  # noqa: BLE001 - re-raised on this rank by check_agreement
        error = e
    agreement.check_agreement(values, world, details=details, error=error,
                              what="neuron-tp train")
    device = _device(args.device)  # before any backward (see neuron_tp.xla_device)
    mesh = mesh or init_mesh(tp=args.tp)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    from .. import hf
    model, error = None, None
    try:
        # Seeding and drawing the global RNG (shared by a process's threads) under one lock:
        # a thread seeding while another draws its init would give the ranks other weights.
        with _BUILD_LOCK:
            torch.manual_seed(args.seed)
            if is_preset(args.model):
                model = build_model(args.model, vocab_size(tokenizer), args.seed, dtype)
        if is_preset(args.model):
            hf.parallelize(model, mesh, sequence_parallel=args.sequence_parallel,
                           parallel_loss=mesh.tp_size > 1)
        else:
            model = hf.from_pretrained(args.model, mesh, sequence_parallel=args.sequence_parallel,
                                       parallel_loss=mesh.tp_size > 1, torch_dtype=dtype)
        if model.config.vocab_size < vocab_size(tokenizer):
            raise ValueError(f"model vocabulary {model.config.vocab_size} < tokenizer vocabulary "
                             f"{vocab_size(tokenizer)}; pass the model's own --tokenizer")
    except Exception as e:  # noqa: BLE001 - re-raised on this rank by the check below
        error = e
    # Same shard on data-parallel replicas, same replicated parameters everywhere.
    agreement.check_model_replicas(model, mesh, error=error, what="neuron-tp train")
    move_to(model, device).train()  # keeps tied embeddings tied (CPU -> XLA unties them)
    optimizer = make_optimizer(model, args.lr, args.weight_decay, device)
    schedule = WarmupCosine(optimizer, args.lr, args.min_lr, args.warmup_steps, args.steps)
    return Run(args, mesh, device, model, optimizer, schedule, data, tokenizer,
               guard=NonFiniteGuard(device, skip=getattr(args, "skip_nonfinite", False)))


def startup_values(args, tokenizer, data: PackedData | None = None
                   ) -> tuple[dict, dict[str, dict]]:
    """What every rank must agree on before anything else (``values``, ``details``, see
    :func:`neuron_tp.agreement.check_agreement`): every option, library versions, the model
    config (and, for a local model, its files), the tokenizer and the training tokens."""
    from ..agreement import fingerprint, tensor_checksum, versions
    from ..hf.loading import _checkpoint_files, check_model_dir, files_fingerprint
    from .presets import model_config
    values = {"--" + k.replace("_", "-"): v for k, v in sorted(vars(args).items())}
    if not is_preset(args.model) and os.path.isdir(args.model):
        check_model_dir(args.model)  # e.g. a neuron_tp checkpoint: say what to do instead
    config = {k: v for k, v in model_config(args.model, vocab_size(tokenizer)).to_dict().items()
              if k != "_name_or_path"}
    details = {"model config": config}
    values.update({"library versions": versions(), "model config": config})
    if not is_preset(args.model):
        files = files_fingerprint(_checkpoint_files(args.model).values())
        values["model files (size, header checksum)"] = details[
            "model files (size, header checksum)"] = files
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else None
    values["tokenizer"] = {"class": type(tokenizer).__name__, "size": vocab_size(tokenizer),
                           "vocabulary": fingerprint(sorted(vocab.items())) if vocab else None}
    if data is not None:
        values["training data (tokens)"] = {"sequences": len(data.chunks),
                                            "checksum": tensor_checksum(data.chunks)}
    return values, details


def train_step(run: Run, log_this_step: bool, on_log) -> None:
    """One optimizer step (``grad_accum`` micro-batches) ending in exactly one graph cut."""
    args, model, mesh, dev = run.args, run.model, run.mesh, run.device
    run.optimizer.zero_grad(set_to_none=True)
    lr = run.schedule.apply()
    loss_sum = None
    for _ in range(args.grad_accum):
        ids = run.data.next_batch().to(dev)
        loss = model(input_ids=ids, labels=ids).loss / args.grad_accum
        loss.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    # Replicated parameters with partial gradients: SP norms, but also e.g. Qwen3's q/k norms
    # (replicated_with_grad_allreduce) without SP. A no-op when the model has none.
    sync_sequence_parallel_grads(model, mesh)
    allreduce_data_parallel_grads(model, mesh)
    if args.max_grad_norm > 0:
        norm = clip_grad_norm_(model, args.max_grad_norm, mesh)
    else:
        norm = global_grad_norm(model, mesh)
    # Computed at every step (so every step traces the same graph), read only at log steps,
    # after the graph ran (step closure): the dp-mean loss and the global gradient norm.
    mean_loss = comm.all_reduce(loss_sum.float().reshape(1), mesh.dp) / mesh.dp_size
    norm = norm.float().reshape(1)
    guard = run.guard
    if guard is None:
        run.optimizer.step()
    else:  # non-finite steps counted on the device (and undone there with --skip-nonfinite)
        guard.optimizer_step(run.optimizer, guard.observe(mean_loss, norm))
        mean_loss, norm = guard.pack(mean_loss, norm)  # the counters travel with the values
    run.schedule.step()
    run.step += 1
    if log_this_step:
        C.on_step_end(dev, on_log, run.step, lr, mean_loss, norm)
    if dev.type == "xla" and not run.graph_checked:  # before it runs: a mismatch would hang
        state = [t for st in run.optimizer.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor)]
        check_same_graph([*model.parameters(), *state, mean_loss, norm], mesh.group("world"))
        run.graph_checked = True
    C.step_boundary(dev)


def _checkpoint_root(args) -> str:
    return os.path.join(args.output_dir, "checkpoints")


def _resume_path(args) -> str | None:
    from .. import checkpoint
    if args.resume == "none":
        existing = checkpoint.latest(_checkpoint_root(args))
        if existing is not None:  # refuse now rather than at the first colliding save
            raise ValueError(f"--resume none but {existing} exists; checkpoints are never "
                             "overwritten: use --resume auto or another --output-dir")
        return None
    if args.resume == "auto":
        return checkpoint.latest(_checkpoint_root(args))
    if not os.path.isdir(args.resume):
        raise ValueError(f"--resume {args.resume!r}: not a checkpoint directory (or use auto/none)")
    return args.resume


def _check_finite(run: Run, sync: bool = True) -> None:
    """Stop (every rank alike) when a non-finite step is known; with ``sync`` read the device
    counters first (one transfer, unless this step was logged): never save after one."""
    from .. import checkpoint
    if sync:
        run.guard.sync(run.step)
    run.guard.check(lambda: checkpoint.latest(_checkpoint_root(run.args)))


def _save(run: Run) -> str:
    from .. import checkpoint
    if run.guard is not None:
        _check_finite(run)
    return checkpoint.save(_checkpoint_root(run.args), run.model, run.optimizer, run.schedule,
                           run.step, mesh=run.mesh, data_state=run.data.state_dict(),
                           keep_last=run.args.keep_last,
                           protect=[run.resumed_from] if run.resumed_from else ())


def _claim_output(run: Run, printer) -> object:
    """Before training, every rank together (one agreement): --output-dir writable, this
    job's lock taken (rank 0; released by :func:`train` at exit), and unless tracing only, the
    resume source chosen and the planned checkpoints checked against those already there."""
    from .. import checkpoint
    from ..checkpoint import outdir
    from ..checkpoint.agree import agree
    args, root, lock, error = run.args, _checkpoint_root(run.args), None, None
    try:
        outdir.check_writable(root, tag=f"-rank{run.mesh.rank}")
        if run.mesh.rank == 0:
            lock = outdir.OutputLock(args.output_dir)
            note = lock.acquire()
            if note:
                printer(f"warning: {note}")
        if not C.extract_graphs_only():
            run.resumed_from = _resume_path(args)
            start = checkpoint.read_meta(run.resumed_from)["step"] if run.resumed_from else 0
            outdir.check_resume_plan(root, run.resumed_from, start, args.steps,
                                     args.save_every)
    except Exception as e:  # noqa: BLE001 - every rank learns about it, none trains
        error = e
    try:
        agree(run.mesh, run.device, f"checking --output-dir {args.output_dir}", error)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


def train(args, mesh: Mesh | None = None, stop_at: int | None = None,
          printer=print, on_step=None) -> dict:
    """Run training as configured by ``args`` (from :func:`~neuron_tp.train.args.train_parser`).

    ``stop_at``: end the process's work after that global step (and its periodic checkpoint)
    without a final checkpoint, as if the job had been killed (for resume tests).
    ``on_step(run)`` is called after every step's graph cut. Returns the summary (rank-local ``log``
    of the logged steps included). Before training every rank checks, together, that
    --output-dir is writable and not used by another job (a lock held until return), and that
    the resume source and the planned checkpoints fit those already there."""
    run = setup(args, mesh)
    lock = _claim_output(run, printer if run.mesh.rank == 0 else (lambda *a, **k: None))
    try:
        return _train(run, stop_at, printer, on_step)
    finally:
        if lock is not None:
            lock.release()


def _train(run: Run, stop_at: int | None, printer, on_step) -> dict:
    args, extract = run.args, C.extract_graphs_only()
    rank0 = run.mesh.rank == 0
    say = printer if rank0 else (lambda *a, **k: None)
    steps = min(args.steps, 3) if extract else args.steps
    resumed = run.resumed_from  # chosen and checked by _claim_output
    if resumed:
        from .. import checkpoint
        meta = checkpoint.load(resumed, run.model, run.optimizer, run.schedule, mesh=run.mesh)
        run.step = meta["step"]
        run.data.load_state_dict(meta["data_state"])
        say(f"resumed from {resumed} at step {run.step}")
    if run.guard is not None:
        run.guard.base = run.step
    tokens_per_step = args.seq_len * args.micro_batch * args.grad_accum * run.mesh.dp_size
    say(f"neuron-tp train: {args.model} {run.mesh} device={run.device} seq_len={args.seq_len} "
        f"global batch={args.micro_batch * args.grad_accum * run.mesh.dp_size} steps={steps}"
        + (" [NEURON_EXTRACT_GRAPHS_ONLY: tracing only, no checkpoints]" if extract else ""))
    writer = None
    if args.tensorboard and rank0 and not extract:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        writer = SummaryWriter(os.path.join(args.output_dir, "tensorboard"))
    clock = {"t": time.perf_counter(), "step": run.step}
    start_step, t_start = run.step, time.perf_counter()
    marks = (start_step, t_start)

    def on_log(step, lr, loss, norm):
        now = time.perf_counter()
        tps = (step - clock["step"]) * tokens_per_step / max(now - clock["t"], 1e-9)
        clock.update(t=now, step=step)
        if extract:
            say(f"step {step}/{steps} traced")
            return
        loss, norm = loss.cpu(), norm.cpu()  # the only two host transfers of a log step
        entry = {"step": step, "loss": float(loss[0]), "lr": lr,
                 "grad_norm": float(norm[0]), "tokens_per_s": tps,
                 **C.graph_counters()}
        if run.guard is not None:
            run.guard.note(step, loss, norm)
            if run.guard.skip:
                entry["skipped_steps"] = run.guard.skipped
        run.log.append(entry)
        say(f"step {step:>6}/{steps} | loss {entry['loss']:.4f} | lr {lr:.2e} | grad norm "
            f"{entry['grad_norm']:.3f} | {tps:,.0f} tok/s | compiles "
            f"{entry['compiles'] if run.device.type == 'xla' else 'n/a (eager)'}"
            + (f" | skipped {entry['skipped_steps']} non-finite step(s)"
               if entry.get("skipped_steps") else ""), flush=True)
        if writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s"):
                writer.add_scalar(f"train/{key}", entry[key], step)

    saved = []
    while run.step < steps:
        nxt = run.step + 1
        train_step(run, log_this_step=nxt % args.log_every == 0 or nxt == steps, on_log=on_log)
        if run.guard is not None and not extract:  # what the log closure saw (no transfer)
            _check_finite(run, sync=False)
        if run.step == start_step + 2:  # throughput after the first two (compiling) steps
            marks = (run.step, time.perf_counter())
        if on_step is not None:
            on_step(run)
        if not extract and args.save_every and run.step % args.save_every == 0:
            saved.append(_save(run))
        if stop_at is not None and run.step >= stop_at:
            break
    if run.step - marks[0] < 2:  # too short a run to leave the compiling steps out
        marks = (start_step, t_start)
    if run.device.type == "xla":
        from .. import _xla
        _xla.xm().wait_device_ops()
    elapsed = time.perf_counter() - marks[1]  # the final checkpoint is not timed
    finished = run.step >= steps
    if extract:  # trace the checkpoint's synchronisation too, without writing anything
        from .. import checkpoint
        checkpoint.dry_run_save(run.model, run.mesh)
    trained = run.step > start_step
    if trained and not extract and run.guard is not None:  # never end silently on NaN
        _check_finite(run)
    if finished and not extract and trained and \
            not (saved and saved[-1].endswith(f"{run.step:08d}")):
        saved.append(_save(run))
    if not trained:
        say(f"nothing to do: already at step {run.step} of {steps} (--steps, --resume)")
    summary = {"steps": run.step, "steps_this_run": run.step - start_step,
               "tokens_per_s": (run.step - marks[0]) * tokens_per_step / max(elapsed, 1e-9),
               **C.graph_counters(), "peak_memory_mb": C.peak_memory_mb(run.device),
               "checkpoints": saved, "log": run.log, "extract_graphs_only": extract}
    say(f"done: {summary['steps']} steps ({summary['steps_this_run']} this run), "
        f"{summary['tokens_per_s']:,.0f} tok/s (after the first 2 steps), "
        f"{summary['compiles']} graph compiles, "
        f"peak memory {summary['peak_memory_mb']:.0f} MiB, checkpoints: {saved or 'none'}")
    if writer is not None:
        writer.close()
    return summary
