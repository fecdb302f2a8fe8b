"""Sharded, atomic, resumable checkpoints.

Layout of one checkpoint ``ROOT/step-00000100/``::

    meta.json                      mesh, model class + config, layout of every parameter,
                                   optimizer/scheduler state, data position
    shard-tp00000.safetensors      the tp rank's parameters and optimizer states (written by
    ...                            the ranks of data-parallel replica 0)
    rng-rank00000.safetensors/json each rank's RNG states

All ranks write into ``ROOT/.tmp-step-00000100`` and rank 0 renames it only after every rank
finished (a barrier), so an interrupted save never touches an earlier checkpoint and an
incomplete directory is never picked up by :func:`latest`. No tensor is pickled.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil

import torch

from .. import comm
from ..mesh import Mesh, get_mesh
from ..sharding import ParamMeta, named_parameter_meta
from .reshard import (assemble, full_shape, hf_record, local_piece, logical_shape,
                      sharding_record, to_hf)

FORMAT = "neuron_tp.checkpoint/1"
_STEP_RE = re.compile(r"^step-(\d{8})$")

__all__ = ["save", "load", "latest", "consolidate", "read_meta", "dry_run_save"]


def _mesh_of(model, mesh: Mesh | None) -> Mesh:
    return get_mesh(mesh if mesh is not None else getattr(model, "_ntp_mesh", None))


def _agree(mesh: Mesh, device: torch.device, error: Exception | None = None) -> None:
    """Barrier over the job that also shares failure: raises on every rank when any rank
    passed an ``error`` (so no rank goes on into collectives the others never reach).

    One ``[1]`` float all-reduce of uploaded data: on XLA the same single small graph every
    time (traced in the NEURON_EXTRACT_GRAPHS_ONLY trial too, see :func:`dry_run_save`)."""
    world = mesh.group("world")
    failed = 1.0 if error is not None else 0.0
    if world.size > 1:
        failed = float(comm.all_reduce(torch.tensor([failed]).to(device), world).cpu()[0])
    if error is not None:
        raise error
    if failed:
        raise ValueError("another rank failed while saving/loading the checkpoint (see its "
                         "error message)")


def _barrier(mesh: Mesh, device: torch.device) -> None:
    _agree(mesh, device, None)


def dry_run_save(model: torch.nn.Module, mesh: Mesh | None = None) -> None:
    """The synchronisation of :func:`save` without writing anything: what the graph-extraction
    trial runs so that checkpointing compiles nothing new in the real run."""
    mesh = _mesh_of(model, mesh)
    for _ in range(3):
        _barrier(mesh, _device(model))


def _device(model) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def latest(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (None when there is none)."""
    if not os.path.isdir(root):
        return None
    steps = sorted(d for d in os.listdir(root) if _STEP_RE.match(d)
                   and os.path.exists(os.path.join(root, d, "meta.json")))
    return os.path.join(root, steps[-1]) if steps else None


def read_meta(path: str) -> dict:
    """The metadata of checkpoint ``path``; ValueError when it is not a readable checkpoint."""
    f = os.path.join(path, "meta.json")
    try:
        with open(f) as fh:
            meta = json.load(fh)
    except FileNotFoundError:
        raise ValueError(f"{path} is not a neuron_tp checkpoint (no meta.json)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: unreadable checkpoint metadata ({e})") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{f}: format {meta.get('format')!r}, expected {FORMAT!r}")
    return meta


def _rng_state() -> tuple[dict, dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    state = {"python": _jsonable(random.getstate())}
    import sys
    if "torch_xla" in sys.modules:
        import torch_xla.core.xla_model as xm
        state["xla_seed"] = int(xm.get_rng_state())
    return tensors, state


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x


def _optimizer_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        for key, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"optim/{name}/{key}"] = v.detach().cpu().contiguous()
    return out


def _metadata(model, optimizer, scheduler, step: int, mesh: Mesh, data_state, extra) -> dict:
    config = getattr(model, "config", None)
    return {
        "format": FORMAT, "step": int(step),
        "mesh": {"world_size": mesh.world_size, "tp": mesh.tp_size, "dp": mesh.dp_size,
                 "tp_mode": mesh.tp_mode},
        "model": {"class": type(model).__name__,
                  "config": config.to_dict() if hasattr(config, "to_dict") else None,
                  "sequence_parallel": bool(getattr(model, "_ntp_sequence_parallel", False))},
        "params": {n: {"shape": list(p.shape), "full_shape": list(full_shape(p, m)),
                       "logical_shape": list(logical_shape(p, m)),
                       "dtype": str(p.dtype).replace("torch.", ""),
                       "sharding": sharding_record(m), "hf": hf_record(m)}
                   for n, p, m in named_parameter_meta(model)},
        "optimizer": None if optimizer is None else {
            "class": type(optimizer).__name__, "groups": len(optimizer.param_groups)},
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "data_state": data_state, "extra": extra or {},
    }


def save(root: str, model: torch.nn.Module, optimizer=None, scheduler=None, step: int = 0,
         mesh: Mesh | None = None, data_state: dict | None = None, extra: dict | None = None,
         keep_last: int | None = None) -> str:
    """Write checkpoint ``root/step-<step>`` (collective: every rank calls it); returns its
    path. Refuses (ValueError, on every rank, before writing) to overwrite an existing one;
    with ``keep_last`` deletes all but the newest ``keep_last`` checkpoints afterwards."""
    from safetensors.torch import save_file
    mesh = _mesh_of(model, mesh)
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (or None to keep all), got {keep_last}")
    name = f"step-{int(step):08d}"
    final, tmp = os.path.join(root, name), os.path.join(root, ".tmp-" + name)
    if os.path.exists(final):
        raise ValueError(f"checkpoint {final} already exists; refusing to overwrite it")
    device = _device(model)
    if mesh.rank == 0:
        if os.path.exists(tmp):  # left over by an interrupted save of the same step
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier(mesh, device)
    error = None
    try:
        if mesh.dp_rank == 0:
            tensors = {f"model/{n}": p.detach().cpu().contiguous()
                       for n, p in model.named_parameters()}
            if optimizer is not None:
                tensors.update(_optimizer_tensors(model, optimizer))
            save_file(tensors, os.path.join(tmp, f"shard-tp{mesh.tp_rank:05d}.safetensors"),
                      metadata={"format": "pt"})
        rng_t, rng_j = _rng_state()
        save_file(rng_t, os.path.join(tmp, f"rng-rank{mesh.rank:05d}.safetensors"))
        with open(os.path.join(tmp, f"rng-rank{mesh.rank:05d}.json"), "w") as fh:
            json.dump(rng_j, fh)
        if mesh.rank == 0:
            meta = _metadata(model, optimizer, scheduler, step, mesh, data_state, extra)
            with open(os.path.join(tmp, "meta.json"), "w") as fh:
                json.dump(meta, fh, indent=1)
    except (OSError, ValueError, RuntimeError) as e:  # e.g. disk full on one rank
        error = ValueError(f"saving {final} failed on rank {mesh.rank}: {e}")
    _agree(mesh, device, error)  # every rank's files are complete (or every rank raises)
    if mesh.rank == 0:
        os.replace(tmp, final)
        if keep_last is not None:
            done = sorted(d for d in os.listdir(root) if _STEP_RE.match(d))
            for old in done[:-keep_last]:
                shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    _barrier(mesh, device)
    return final


class _Shards:
    """Lazy readers of a checkpoint's tp shard files."""

    def __init__(self, path: str, tp: int):
        self.path, self.tp, self.handles = path, tp, {}

    def _open(self, tp_rank: int):
        from safetensors import safe_open
        if tp_rank not in self.handles:
            f = os.path.join(self.path, f"shard-tp{tp_rank:05d}.safetensors")
            try:
                self.handles[tp_rank] = safe_open(f, "pt")
            except Exception as e:  # noqa: BLE001 - missing/corrupt file: one clear message
                raise ValueError(f"{f}: unreadable checkpoint shard ({e})") from None
        return self.handles[tp_rank]

    def get(self, tp_rank: int, key: str) -> torch.Tensor:
        try:
            return self._open(tp_rank).get_tensor(key)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{self.path}: tensor {key!r} missing or unreadable ({e})") from None

    def keys(self, tp_rank: int) -> set[str]:
        return set(self._open(tp_rank).keys())

    def full(self, key: str, rec: dict) -> torch.Tensor:
        n = self.tp if rec["sharding"] else 1
        return assemble([self.get(r, key) for r in range(n)], rec["sharding"])


def _check_model(meta: dict, model: torch.nn.Module, path: str) -> None:
    saved = meta["params"]
    names = {n: (p, m) for n, p, m in named_parameter_meta(model)}
    missing, unexpected = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    if missing or unexpected:
        raise ValueError(f"{path} does not match the model: parameters missing from the "
                         f"checkpoint {missing[:5]}, not in the model {unexpected[:5]}")
    wrong = [(n, saved[n]["logical_shape"], list(logical_shape(p, m)))
             for n, (p, m) in names.items()
             if saved[n]["logical_shape"] != list(logical_shape(p, m))]
    if wrong:
        raise ValueError(f"{path} does not match the model (name, saved shape, model shape): "
                         f"{wrong[:5]}")


def load(path: str, model: torch.nn.Module, optimizer=None, scheduler=None,
         mesh: Mesh | None = None, restore_rng: bool = True) -> dict:
    """Load checkpoint ``path`` into ``model`` (and optimizer, scheduler, RNG); returns its
    metadata. A different tp degree is resharded from the files. Everything is read and
    checked before anything is modified (ValueError for a mismatched model or bad files)."""
    mesh = _mesh_of(model, mesh)
    error, staged = None, None
    try:
        staged = _read_for(path, model, optimizer, mesh)
    except ValueError as e:
        error = e
    _agree(mesh, _device(model), error)  # every rank read its part, or all raise
    meta, new_params, new_state = staged
    _apply(model, optimizer, new_params, new_state)
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if restore_rng and meta["mesh"]["world_size"] == mesh.world_size:
        _load_rng(path, mesh.rank)
    return meta


def _read_for(path: str, model, optimizer, mesh: Mesh):
    """Read and check this rank's tensors (nothing modified): (meta, params, optimizer state)."""
    meta = read_meta(path)
    _check_model(meta, model, path)
    saved_mesh = meta["mesh"]
    same = saved_mesh["tp"] == mesh.tp_size and saved_mesh["tp_mode"] == mesh.tp_mode
    shards = _Shards(path, saved_mesh["tp"])
    if not same and saved_mesh["tp_mode"] != "1d":
        raise ValueError(f"{path} was saved with tp_mode={saved_mesh['tp_mode']!r} tp="
                         f"{saved_mesh['tp']}; it can only be loaded with the same layout")

    def piece(name: str, key: str, pmeta: ParamMeta) -> torch.Tensor:
        rec = meta["params"][name]
        if same:
            return shards.get(mesh.tp_rank, key)
        return local_piece(shards.full(key, rec), rec["hf"], pmeta, mesh)

    new_params, new_state = {}, {}
    optim_keys = shards.keys(mesh.tp_rank if same else 0) if optimizer is not None else set()
    for name, p, pmeta in named_parameter_meta(model):
        t = piece(name, f"model/{name}", pmeta)
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{path}: {name} has shape {tuple(t.shape)} for this rank, the "
                             f"model's is {tuple(p.shape)}")
        new_params[name] = t
        if optimizer is not None:
            keys = [k for k in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq")
                    if f"optim/{name}/{k}" in optim_keys]
            new_state[name] = {k: (shards.get(mesh.tp_rank if same else 0, f"optim/{name}/{k}")
                                   if k == "step" else piece(name, f"optim/{name}/{k}", pmeta))
                               for k in keys}
    if optimizer is not None and meta["optimizer"] and \
            meta["optimizer"]["groups"] != len(optimizer.param_groups):
        raise ValueError(f"{path}: optimizer had {meta['optimizer']['groups']} parameter groups, "
                         f"this one has {len(optimizer.param_groups)}")
    return meta, new_params, new_state


def _apply(model, optimizer, new_params: dict, new_state: dict) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(new_params[name].to(p.dtype))
    if optimizer is not None:
        capturable = {id(p): g.get("capturable", False) for g in optimizer.param_groups
                      for p in g["params"]}
        for name, p in model.named_parameters():
            st = {}
            for k, v in new_state.get(name, {}).items():
                on_device = k != "step" or capturable.get(id(p), False)
                st[k] = v.to(p.device) if on_device else v
            if st:
                optimizer.state[p] = st


def _load_rng(path: str, rank: int) -> None:
    from safetensors.torch import load_file
    base = os.path.join(path, f"rng-rank{rank:05d}")
    try:
        t = load_file(base + ".safetensors")
        with open(base + ".json") as fh:
            j = json.load(fh)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{base}: unreadable RNG state ({e})") from None
    torch.set_rng_state(t["torch_cpu"])
    random.setstate(_tuples(j["python"]))
    if "xla_seed" in j:
        import torch_xla.core.xla_model as xm
        xm.set_rng_state(j["xla_seed"])


def consolidate(path: str, out_dir: str) -> str:
    """Write checkpoint ``path`` (or the newest one under it) as one standard HF directory
    (config.json + model.safetensors, HF tensor names); offline, no mesh. Refuses to write
    into a non-empty ``out_dir``. Returns ``out_dir``."""
    from safetensors.torch import save_file
    ckpt = path if os.path.exists(os.path.join(path, "meta.json")) else latest(path) or \
        latest(os.path.join(path, "checkpoints"))
    if ckpt is None:
        raise ValueError(f"{path}: no neuron_tp checkpoint there (no meta.json, no step-* dirs)")
    meta = read_meta(ckpt)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise ValueError(f"{out_dir} exists and is not empty; refusing to overwrite it")
    shards = _Shards(ckpt, meta["mesh"]["tp"])
    tensors = {name: to_hf(shards.full(f"model/{name}", rec), rec["hf"]).contiguous()
               for name, rec in meta["params"].items()}
    tmp = out_dir.rstrip("/") + ".tmp-consolidate"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    cfg = meta["model"]["config"]
    if cfg is not None:
        from transformers import CONFIG_MAPPING
        config = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
        config.save_pretrained(tmp)
    save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    if os.path.exists(out_dir):
        os.rmdir(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
