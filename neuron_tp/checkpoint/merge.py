"""Consolidating a sharded checkpoint into one standard HF directory (offline, no mesh)."""

from __future__ import annotations

import os
import shutil

import torch

from .agree import describe
from .format import CheckpointError, fsync, latest, read_meta
from .reader import Shards
from .reshard import to_hf


def _prepare_target(out_dir: str) -> str:
    """Refuse a target that cannot receive the model, before any shard is read; returns the
    (new, empty) temporary directory next to it."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(
            f"{out_dir} exists and is not a directory; give a new (or empty) "
            "directory for the consolidated model"
        )
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise CheckpointError(f"{out_dir} exists and is not empty; refusing to overwrite it")
    tmp = out_dir.rstrip("/") + ".tmp-consolidate"
    try:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
        probe = os.path.join(tmp, ".write-test")
        with open(probe, "wb") as fh:
            fh.write(b"neuron_tp")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(
            f"cannot write the consolidated model to {out_dir}: "
            f"{e.strerror or e} ({e.filename or tmp}); choose a writable "
            "location"
        ) from None
    return tmp


def consolidate(path: str, out_dir: str) -> str:
    """Write checkpoint ``path`` (or the newest one under it) as one standard HF directory
    (config.json + model.safetensors, HF tensor names). Every tensor's checksum is verified
    and non-finite weights are refused; an unusable ``out_dir`` (a file, not writable, not
    empty) is refused before any shard is read. Returns ``out_dir``."""
    from safetensors.torch import save_file

    ckpt = (
        path
        if os.path.exists(os.path.join(path, "meta.json"))
        else latest(path) or latest(os.path.join(path, "checkpoints"))
    )
    if ckpt is None:
        raise CheckpointError(
            f"{path}: no neuron_tp checkpoint there (no meta.json, no step-* dirs)"
        )
    meta = read_meta(ckpt)
    tmp = _prepare_target(out_dir)
    try:
        shards = Shards(ckpt, meta["mesh"]["tp"], meta.get("step"))
        tensors = {}
        for name, rec in meta["params"].items():
            t = to_hf(shards.full(f"model/{name}", rec), rec["hf"]).contiguous()
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CheckpointError(
                    f"{ckpt}: parameter {name} holds non-finite values "
                    "(NaN/inf); refusing to write a diverged model"
                )
            tensors[name] = t
        cfg = meta["model"]["config"]
        if cfg is not None:
            from transformers import CONFIG_MAPPING

            config = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
            config.save_pretrained(tmp)
        target = os.path.join(tmp, "model.safetensors")
        save_file(tensors, target, metadata={"format": "pt"})
        fsync(target)
        fsync(tmp)
        if os.path.exists(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, ValueError):
            raise CheckpointError(
                f"consolidating {ckpt} into {out_dir} failed: {describe(e)}"
            ) from e
        raise
    return out_dir
