"""Writing a checkpoint: every rank writes into a temporary directory, rank 0 renames it.

Three phases (prepare, write, commit), each ended by :func:`~.agree.agree`: an exception of
any type on any rank makes every rank raise ``"saving step N failed on rank R: ..."`` right
there, and nothing is committed (earlier checkpoints are never touched before the commit).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import warnings
from collections.abc import Iterable

import torch

from ..parallel.mesh import Mesh
from ..parallel.sharding import expert_split, gather_experts, named_parameter_meta
from ..parallel.state import mesh_of, stage_of, state_of
from . import zero1_files
from .agree import agree
from .assets import write_files
from .buffers import buffer_meta, buffer_tensors
from .format import (
    FORMAT,
    FORMAT_DP_SHARDED,
    FORMAT_STAGED,
    STEP_RE,
    CheckpointError,
    fsync,
    shard_file,
    step_name,
    write_tensors,
    write_text,
)
from .reshard import full_shape, hf_record, logical_shape, sharding_record


def device_of(model) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def dry_run_save(model: torch.nn.Module, mesh: Mesh | None = None) -> None:
    """The synchronisation of :func:`save` without writing anything: what the graph-extraction
    trial runs so that checkpointing compiles nothing new in the real run."""
    mesh = mesh_of(model, mesh)
    for t in _expert_tensors(model, None, mesh).values():
        t.cpu()
    for _ in range(3):
        agree(mesh, device_of(model), "dry-run save", None)


def _rng_state() -> tuple[dict, dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    state = {"python": _jsonable(random.getstate())}
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm

        state["xla_seed"] = int(xm.get_rng_state())
    return tensors, state


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _optimizer_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in _saved_parameters(model):
        for key, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{name}/{key}"] = v.detach().cpu().contiguous()
    return out


def _optimizer_meta(optimizer) -> dict | None:
    """Class and group count; for ZeRO-1 ``dp_shards``: the dp degree its state is cut in."""
    if optimizer is None:
        return None
    out = {"class": type(optimizer).__name__, "groups": len(optimizer.param_groups)}
    if is_zero1(optimizer):
        out["dp_shards"] = optimizer.group.size
    return out


def _saved_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of what this rank's files hold: every parameter but a pipeline
    stage's copies of another stage's (a tied table is saved once, by the first stage)."""
    stage = stage_of(model)
    copies = dict(stage.copies) if stage is not None else {}
    return [(n, p) for n, p in model.named_parameters() if n not in copies]


def stage_records(model, mesh: Mesh) -> dict:
    """This rank's part of ``meta.json``: the records of the parameters and persistent buffers
    its files hold (at pp > 1 each naming its ``stage``)."""
    saved = {n for n, _ in _saved_parameters(model)}
    params = {
        n: {
            "shape": _saved_shape(p, m, mesh),
            "full_shape": list(full_shape(p, m)),
            "logical_shape": list(logical_shape(p, m)),
            "dtype": str(p.dtype).replace("torch.", ""),
            "sharding": sharding_record(m),
            "hf": hf_record(m),
        }
        for n, p, m in named_parameter_meta(model)
        if n in saved
    }
    buffers = buffer_meta(model)  # replicated: stored once, in tp rank 0's file
    if mesh.pp_size > 1:
        for rec in (*params.values(), *buffers.values()):
            rec["stage"] = mesh.pp.rank
    return {"params": params, "buffers": buffers}


def merge_stages(records: list[dict], whole: tuple[str, ...] | None) -> dict:
    """Every stage's :func:`stage_records` as one model's (in ``whole``'s order, the whole
    model's parameter names, when given); CheckpointError when two stages hold a parameter or
    the stages do not hold ``whole`` exactly."""
    params: dict[str, dict] = {}
    buffers: dict[str, dict] = {}
    for rec in records:
        for name, r in rec["params"].items():
            if name in params:
                raise CheckpointError(
                    f"parameter {name} is held by pipeline stages {params[name].get('stage')} "
                    f"and {r.get('stage')}: each stage must save only its own layers"
                )
            params[name] = r
        buffers.update(rec["buffers"])
    if whole is not None:
        missing, extra = sorted(set(whole) - set(params)), sorted(set(params) - set(whole))
        if missing or extra:
            raise CheckpointError(
                f"the pipeline stages hold other parameters than the whole model: missing "
                f"{missing[:5]}, not in the model {extra[:5]}"
            )
        params = {n: params[n] for n in whole}
    return {"params": params, "buffers": buffers}


def _exchange_records(mesh: Mesh, mine: dict | None) -> list[dict | None] | None:
    """Every stage's records (None for a stage that failed to make them) on the ranks of rank
    0's pp group; ``[mine]`` at pp 1; None on the other ranks. A host exchange, no device
    collective."""
    if mesh.pp_size == 1:
        return [mine]
    if mesh.replicas.rank != 0 or mesh.tp_rank != 0:
        return None
    from ..parallel import host
    from ..parallel.failures import has_store

    if not has_store(mesh.pp):
        raise CheckpointError("saving a pipeline stage needs the job's store (a real mesh)")
    payload = b"" if mine is None else json.dumps(mine).encode()
    got = host.all_gather("checkpoint-stages", payload, mesh.pp)
    return [json.loads(g) if g else None for g in got]


def _metadata(
    model,
    optimizer,
    scheduler,
    step: int,
    *,
    mesh: Mesh,
    data_state,
    extra,
    records: list[dict] | None = None,
) -> dict:
    """``meta.json``; ``records``: every stage's :func:`stage_records` (default: this rank's,
    a whole model's)."""
    config = getattr(model, "config", None)
    state = state_of(model)
    stage = stage_of(model)
    described = merge_stages(
        records if records is not None else [stage_records(model, mesh)],
        stage.whole if stage is not None else None,
    )
    kind = FORMAT_DP_SHARDED if is_zero1(optimizer) else FORMAT
    return {
        "format": FORMAT_STAGED if mesh.pp_size > 1 else kind,
        "step": int(step),
        "mesh": {
            "world_size": mesh.world_size,
            "tp": mesh.tp_size,
            "dp": mesh.dp_size,
            "tp_mode": mesh.tp_mode,
            "ep": mesh.ep_size,
            "pp": mesh.pp_size,
        },
        "model": {
            "class": type(model).__name__,
            "config": config.to_dict()
            if config is not None and hasattr(config, "to_dict")
            else None,
            "sequence_parallel": bool(state and state.sequence_parallel),
            # a parallelized PeftModel: how to merge / export its LoRA adapter offline
            "lora": state.lora if state is not None else None,
        },
        "params": described["params"],
        "buffers": described["buffers"],  # replicated: stored once, in tp rank 0's file
        "optimizer": _optimizer_meta(optimizer),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "data_state": data_state,
        "extra": extra or {},
    }


def _expert_tensors(model, optimizer, mesh: Mesh) -> dict[str, torch.Tensor]:
    """Every expert-parallel parameter and its optimizer state with ALL its experts, gathered
    over ``ep`` (collective: every rank calls it), so the files hold what an ``ep=1`` run
    saves and resume or consolidate do not depend on the expert-parallel degree. Moved to the
    host on every rank: on an XLA device the gathers run when a tensor is read, and a rank
    that does not write files must still join them."""
    out: dict[str, torch.Tensor] = {}
    if mesh.ep_size == 1:
        return out
    for n, p, m in named_parameter_meta(model):
        if expert_split(m.sharding) is None:
            continue
        out[f"model/{n}"] = gather_experts(p, m.sharding, mesh)
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and v.shape == p.shape:
                out[f"optim/{n}/{key}"] = gather_experts(v, m.sharding, mesh)
    return {k: v.cpu().contiguous() for k, v in out.items()}


def _saved_shape(p: torch.Tensor, meta, mesh: Mesh) -> list[int]:
    """The shape of ``p`` as the files hold it (every expert of an expert-parallel one)."""
    shape, dim = list(p.shape), expert_split(meta.sharding)
    if dim is not None:
        shape[dim] *= mesh.ep_size
    return shape


def _model_tensors(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in _saved_parameters(model):
        t = p.detach().cpu().contiguous()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"parameter {n} holds non-finite values (NaN/inf): refusing "
                "to save a diverged model"
            )
        out[f"model/{n}"] = t
    return out


def is_zero1(optimizer) -> bool:
    """A :class:`~neuron_tp.optim.zero1.Zero1`: its state is saved dp-sharded
    (:mod:`.zero1_files`)."""
    return hasattr(optimizer, "load_full_state_dict")


def _write_rank_files(
    tmp: str,
    model,
    optimizer,
    mesh: Mesh,
    *,
    step: int,
    meta_text: str | None,
    files: dict[str, bytes] | None = None,
) -> None:
    stage = mesh.pp.rank if mesh.pp_size > 1 else None
    if is_zero1(optimizer):  # every rank its own ZeRO-1 shard, no dp gather
        skip = {n for n, _ in model.named_parameters()} - {n for n, _ in _saved_parameters(model)}
        zero1_files.write_shard(tmp, optimizer, mesh, step, skip=skip)
    experts = _expert_tensors(model, optimizer, mesh)
    if mesh.replicas.rank == 0:  # one copy of each tp shard: dp replica 0, cp rank 0
        tensors = _model_tensors(model)
        if mesh.tp_rank == 0:
            tensors.update(buffer_tensors(model))
        if optimizer is not None and not is_zero1(optimizer):
            tensors.update(_optimizer_tensors(model, optimizer))
        tensors.update(experts)
        info = {"step": int(step), "tp_rank": mesh.tp_rank, "tp": mesh.tp_size}
        if stage is not None:
            info.update(pp_rank=stage, pp=mesh.pp_size)
        write_tensors(shard_file(tmp, mesh.tp_rank, stage), tensors, info)
    rng_t, rng_j = _rng_state()
    base = os.path.join(tmp, f"rng-rank{mesh.rank:05d}")
    write_tensors(base + ".safetensors", rng_t, {"step": int(step), "rank": mesh.rank})
    write_text(base + ".json", json.dumps(rng_j))
    if meta_text is not None:  # rank 0
        write_files(tmp, files or {})
        write_text(os.path.join(tmp, "meta.json"), meta_text)
    fsync(tmp)  # the directory entries of this rank's files


def _prune(root: str, keep_last: int, protect: Iterable[str]) -> None:
    """Delete all but the newest ``keep_last`` step directories, never one in ``protect``.
    Each goes out of sight with one rename first, so a half-deleted checkpoint is never
    taken for a complete one."""
    keep = {os.path.realpath(p) for p in protect}
    names = sorted(d for d in os.listdir(root) if STEP_RE.match(d))
    for old in names[:-keep_last]:
        if os.path.realpath(os.path.join(root, old)) in keep:
            continue
        gone = os.path.join(root, ".deleting-" + old)
        os.replace(os.path.join(root, old), gone)
        shutil.rmtree(gone)
    for left in os.listdir(root):  # left over by an earlier prune that failed
        if left.startswith(".deleting-step-"):
            shutil.rmtree(os.path.join(root, left), ignore_errors=True)


def _prepare(
    root: str, model, optimizer, scheduler, *, step: int, mesh: Mesh, data_state, extra
) -> tuple[BaseException | None, str | None]:
    """The prepare phase of :func:`save` on this rank: refuse an existing checkpoint; rank 0
    also makes the metadata (every pipeline stage's parameters: a host exchange over rank 0's
    pp group) and the temporary directory. Returns this rank's error and rank 0's
    ``meta.json`` text."""
    final = os.path.join(root, step_name(step))
    tmp = os.path.join(root, ".tmp-" + step_name(step))
    error, mine = None, None
    try:
        if os.path.lexists(final):
            raise CheckpointError(f"checkpoint {final} already exists; refusing to overwrite it")
        mine = stage_records(model, mesh)
    except Exception as e:  # noqa: BLE001 - any failure takes the agreed path
        error = e
    try:
        records = _exchange_records(mesh, mine)  # also when this rank failed: no one waits
        if mesh.rank != 0 or error is not None:
            return error, None
        assert records is not None
        failed = [s for s, r in enumerate(records) if r is None]
        if failed:  # that stage's rank reports its own error
            raise CheckpointError(f"pipeline stage(s) {failed} could not describe their files")
        meta = _metadata(
            model,
            optimizer,
            scheduler,
            step,
            mesh=mesh,
            data_state=data_state,
            extra=extra,
            records=[r for r in records if r is not None],
        )
        meta_text = json.dumps(meta, indent=1)  # a non-JSON extra fails here
        if os.path.lexists(tmp):  # left over by an interrupted save of the same step
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        return None, meta_text
    except Exception as e:  # noqa: BLE001
        return error or e, None


def save(
    root: str,
    model: torch.nn.Module,
    optimizer=None,
    scheduler=None,
    *,
    step: int = 0,
    mesh: Mesh | None = None,
    data_state: dict | None = None,
    extra: dict | None = None,
    keep_last: int | None = None,
    protect: Iterable[str] = (),
    files: dict[str, bytes] | None = None,
) -> str:
    """Write checkpoint ``root/step-<step>`` (collective: every rank calls it); returns its
    path. Refuses to overwrite an existing one and to save non-finite parameters. With
    ``keep_last`` deletes all but the newest ``keep_last`` checkpoints afterwards, except the
    paths in ``protect`` (e.g. the one the run resumed from). ``files`` (path inside the
    checkpoint -> bytes, e.g. the tokenizer's; :mod:`.assets`) are written by rank 0 and
    committed with the rest. Any failure on any rank:
    :class:`CheckpointError` on every rank, nothing committed."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    mesh, device = mesh_of(model, mesh), device_of(model)
    what = f"saving step {int(step)}"
    final = os.path.join(root, step_name(step))
    tmp = os.path.join(root, ".tmp-" + step_name(step))
    error, meta_text = _prepare(
        root,
        model,
        optimizer,
        scheduler,
        step=step,
        mesh=mesh,
        data_state=data_state,
        extra=extra,
    )
    agree(mesh, device, what, error)
    error = None
    try:
        _write_rank_files(tmp, model, optimizer, mesh, step=step, meta_text=meta_text, files=files)
    except Exception as e:  # noqa: BLE001 - e.g. disk full on one rank
        error = e
    try:
        agree(mesh, device, what, error)  # every rank's files are complete and durable
    except CheckpointError:
        if mesh.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    error = None
    if mesh.rank == 0:
        try:
            os.replace(tmp, final)
        except Exception as e:  # noqa: BLE001
            error = e
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            _after_commit(root, keep_last, protect)
    agree(mesh, device, what, error)
    return final


def _after_commit(root: str, keep_last: int | None, protect: Iterable[str]) -> None:
    """Make the rename durable and prune; the checkpoint is committed, so failures here are
    warnings."""
    try:
        fsync(root)
        if keep_last is not None:
            _prune(root, keep_last, protect)
    except Exception as e:  # noqa: BLE001
        warnings.warn(
            f"checkpoint committed, but cleaning up {root} failed: {e}",
            RuntimeWarning,
            stacklevel=3,
        )
