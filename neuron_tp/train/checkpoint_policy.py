"""Where and when a training run checkpoints, and what it resumes from.

Before training every rank together claims ``--output-dir`` (:func:`claim_output`): writable,
this job's lock taken, the resume source chosen (:func:`resume_source`) and the planned
checkpoints checked against those already there; a resume source of another model is refused,
one of other training data too unless ``--resume`` names it (:func:`check_resume_source`: the
data fingerprint every checkpoint records). During training :func:`save` writes one after
each ``--save-every`` step (:func:`periodic_save_due`) and :func:`save_at_end` the final one;
none is written after a non-finite step (:func:`check_finite`).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from .. import checkpoint
from ..backend.graphs import extract_graphs_only
from ..errors import UserError
from ..job.config import TrainConfig
from .run import Printer, Run

if TYPE_CHECKING:
    from ..checkpoint.outdir import OutputLock


def checkpoint_root(config: TrainConfig) -> str:
    """The directory holding a run's ``step-*`` checkpoints."""
    return os.path.join(config.checkpoint.output_dir, "checkpoints")


def resume_source(config: TrainConfig) -> str | None:
    """The checkpoint ``--resume`` names (None: start from scratch); ValueError for ``none``
    when checkpoints exist (they are never overwritten) and for a path that is none."""
    if config.checkpoint.resume == "none":
        existing = checkpoint.latest(checkpoint_root(config))
        if existing is not None:  # refuse now rather than at the first colliding save
            raise UserError(
                f"--resume none but {existing} exists; checkpoints are never "
                "overwritten: use --resume auto or another --output-dir"
            )
        return None
    if config.checkpoint.resume == "auto":
        return checkpoint.latest(checkpoint_root(config))
    if not os.path.isdir(config.checkpoint.resume):
        raise UserError(
            f"--resume {config.checkpoint.resume!r}: not a checkpoint directory (or use auto/none)"
        )
    return config.checkpoint.resume


def claim_output(run: Run, say: Printer) -> OutputLock | None:
    """Before training, every rank together (one agreement): --output-dir writable, this
    job's lock taken (rank 0; the caller releases the returned lock), and unless tracing only,
    ``run.resumed_from`` chosen and the planned checkpoints checked against those there."""
    from ..checkpoint import outdir
    from ..checkpoint.agree import agree

    config, root, lock, error = run.config, checkpoint_root(run.config), None, None
    try:
        outdir.check_writable(root, tag=f"-rank{run.mesh.rank}")
        if run.mesh.rank == 0:
            lock = outdir.OutputLock(config.checkpoint.output_dir)
            note = lock.acquire()
            if note:
                say(f"warning: {note}")
        if not extract_graphs_only():
            run.resumed_from = resume_source(config)
            start = check_resume_source(run, say) if run.resumed_from else 0
            outdir.check_resume_plan(
                root, run.resumed_from, start, config.steps, config.checkpoint.save_every
            )
    except Exception as e:  # noqa: BLE001 - every rank learns about it, none trains
        error = e
    try:
        agree(run.mesh, run.device, f"checking --output-dir {config.checkpoint.output_dir}", error)
        _check_shared(run, lock)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


DATA_KEY = "training data"  # checkpoint meta["extra"]: what the run trained on


def data_fingerprint(run: Run) -> dict | None:
    """The run's training tokens in brief (sequences, CRC-32), computed once per run."""
    if run.data_fingerprint is None and getattr(run.data, "chunks", None) is not None:
        from ..parallel.agreement import tensor_checksum

        chunks = run.data.chunks
        run.data_fingerprint = {"sequences": len(chunks), "checksum": tensor_checksum(chunks)}
    return run.data_fingerprint


def check_resume_source(run: Run, say: Printer) -> int:
    """The step of ``run.resumed_from`` after checking it is a checkpoint of this model
    (UserError otherwise) and of this run's training data: other data is refused when the
    checkpoint was found by ``--resume auto``, a warning when ``--resume`` names it."""
    from ..checkpoint.reader import check_model

    path, config = run.resumed_from, run.config
    assert path is not None  # called on resume only
    meta = checkpoint.read_meta(path)
    auto = config.checkpoint.resume == "auto"
    try:
        check_model(meta, run.model, path)
    except checkpoint.CheckpointError as e:
        where = (
            f"--output-dir {config.checkpoint.output_dir} holds checkpoints of another model"
            if auto
            else f"--resume {path} is a checkpoint of another model"
        )
        raise UserError(
            f"{where} than --model {config.model} ({e}); train this model into a new "
            "--output-dir (--resume none refuses to write next to existing checkpoints), "
            "or resume that run with its own --model"
        ) from None
    recorded = (meta.get("extra") or {}).get(DATA_KEY)
    now = data_fingerprint(run)
    if recorded is not None and now is not None and recorded != now:
        change = (
            f"{recorded['sequences']} sequences of {config.seq_len} tokens, checksum "
            f"{recorded['checksum']} then; {now['sequences']}, checksum {now['checksum']} now"
        )
        if auto:
            raise UserError(
                f"the training data changed since {path} was saved ({change}): to continue "
                f"on the new data pass --resume {path}; to start over, a new --output-dir"
            )
        say(f"warning: resuming {path} with other training data than it was saved with ({change})")
    return meta["step"]


def _check_shared(run: Run, lock: OutputLock | None) -> None:
    """Every rank sees rank 0's lock file: the ranks write one checkpoint into one directory,
    so ``--output-dir`` must be the same directory everywhere (a file system every node
    mounts), not a node-local path that gives each node its own (found only at the first
    save, hours later)."""
    from ..checkpoint import outdir
    from ..checkpoint.agree import agree
    from ..parallel import host
    from ..parallel.failures import has_store

    world = run.mesh.group("world")
    if world.size == 1 or not has_store(world):
        return
    mine = (lock.token or "").encode() if lock is not None else b""
    token = host.all_gather("output-dir-token", mine, world)[0].decode()
    error = None
    if run.mesh.rank != 0:
        path = os.path.join(run.config.checkpoint.output_dir, outdir.LOCK_NAME)
        try:
            with open(path) as fh:
                seen = json.load(fh).get("token")
        except (OSError, ValueError):
            seen = None
        if seen != token:
            error = ValueError(
                f"this rank does not see rank 0's lock file {os.path.abspath(path)}: every "
                "rank must write into the same --output-dir (a file system that every node "
                "mounts, e.g. FSx for Lustre or EFS); a node-local path gives each node its "
                "own directory and the first checkpoint would fail"
            )
    agree(
        run.mesh,
        run.device,
        f"checking --output-dir {run.config.checkpoint.output_dir} is shared",
        error,
    )


def restore(run: Run, say: Printer) -> None:
    """Load ``run.resumed_from`` (if any) into the run: weights, optimizer, schedule, data
    position and step."""
    if run.resumed_from:
        meta = checkpoint.load(
            run.resumed_from, run.model, run.optimizer, run.schedule, mesh=run.mesh
        )
        run.step = meta["step"]
        run.data.load_state_dict(meta["data_state"])
        say(f"resumed from {run.resumed_from} at step {run.step}")


def check_finite(run: Run, sync: bool = True) -> None:
    """Stop (every rank alike) when a non-finite step is known; with ``sync`` read the device
    counters first (one transfer, unless this step was logged): never save after one."""
    guard = run.guard
    assert guard is not None  # set up before the first step
    if sync:
        guard.sync(run.step)
    guard.check(lambda: checkpoint.latest(checkpoint_root(run.config)))


def save(run: Run) -> str:
    """Checkpoint the run at its current step (after the non-finite check); returns the path."""
    if run.guard is not None:
        check_finite(run)
    return checkpoint.save(
        checkpoint_root(run.config),
        run.model,
        run.optimizer,
        run.schedule,
        step=run.step,
        mesh=run.mesh,
        data_state=run.data.state_dict(),
        extra={**run.checkpoint_extra, DATA_KEY: data_fingerprint(run)},
        keep_last=run.config.checkpoint.keep_last,
        protect=[run.resumed_from] if run.resumed_from else (),
        files=run.checkpoint_files,  # the tokenizer's, the model's generation config
    )


def periodic_save_due(config: TrainConfig, step: int) -> bool:
    """True after each ``--save-every`` step (never with 0)."""
    return bool(config.checkpoint.save_every) and step % config.checkpoint.save_every == 0


def save_at_end(run: Run, saved: list[str], finished: bool, trained: bool) -> None:
    """After this process's last step: never end silently after a non-finite step, and save
    a finished run's last step unless the periodic save just did (appended to ``saved``)."""
    if trained and run.guard is not None:
        check_finite(run)
    if finished and trained and not (saved and saved[-1].endswith(f"{run.step:08d}")):
        saved.append(save(run))
