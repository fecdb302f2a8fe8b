"""Consolidating a sharded checkpoint into one standard HF directory, or its optimizer state
into full tensors (offline, no mesh). A ZeRO-1 state is joined over dp first
(:mod:`.zero1_files`), then over tp like the parameters."""

from __future__ import annotations

import os
import shutil

import torch

from ..errors import UserError
from ..parallel.failures import describe
from .assets import export_for_transformers
from .buffers import PREFIX as BUFFER_PREFIX
from .format import CheckpointError, fsync, latest, read_meta
from .reader import Shards
from .reshard import to_hf


def prepare_target(out_dir: str) -> str:
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


def _find(path: str) -> str:
    ckpt = (
        path
        if os.path.exists(os.path.join(path, "meta.json"))
        else latest(path) or latest(os.path.join(path, "checkpoints"))
    )
    if ckpt is None:
        raise CheckpointError(
            f"{path}: no neuron_tp checkpoint there (no meta.json, no step-* dirs)"
        )
    return ckpt


def _shards(ckpt: str, meta: dict) -> Shards:
    return Shards.of(ckpt, meta)


def full_optimizer_state(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """The optimizer state of checkpoint ``path`` (or the newest one under it) unsharded over
    dp and tp, per parameter: ``{name: {"exp_avg": ..., "step": ..., "master": ...}}``, each
    tensor shaped like the HF parameter (as :func:`consolidate` writes it). Checksums are
    verified."""
    ckpt = _find(path)
    meta = read_meta(ckpt)
    shards = _shards(ckpt, meta)
    keys = shards.keys(0) if meta.get("optimizer") else set()
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, rec in meta["params"].items():
        for k in sorted(k for k in keys if k.rsplit("/", 1)[0] == f"optim/{name}"):
            short = k.rsplit("/", 1)[1]
            t = shards.get(0, k) if short == "step" else to_hf(shards.full(k, rec), rec["hf"])
            out.setdefault(name, {})[short] = t
    return out


def commit_dir(tmp: str, out_dir: str) -> None:
    """Make the written temporary directory durable and put it in place of ``out_dir``."""
    fsync(tmp)
    if os.path.exists(out_dir):
        os.rmdir(out_dir)
    os.replace(tmp, out_dir)


def consolidate(path: str, out_dir: str, adapter_only: bool = False) -> str:
    """Write checkpoint ``path`` (or the newest one under it) as one standard HF directory
    (config.json + model.safetensors, HF tensor names, the run's tokenizer files and a
    generation_config.json: plain transformers loads and generates from it). A LoRA run's
    checkpoint is written merged (``W + scaling * B A``, peft's ``merge_and_unload``: the plain
    model's keys), or with ``adapter_only`` as PEFT's adapter directory (adapter_config.json +
    adapter_model.safetensors). Every tensor's checksum is verified and non-finite weights are
    refused; an unusable ``out_dir`` (a file, not writable, not empty) is refused before any
    shard is read. Returns ``out_dir``."""
    from safetensors.torch import save_file

    from ..hf import lora_files

    ckpt = _find(path)
    meta = read_meta(ckpt)
    lora = lora_files.checkpoint_lora(meta, ckpt)
    if adapter_only and lora is None:
        raise UserError(
            f"{ckpt}: not a checkpoint of a LoRA run (--lora-r); --adapter-only writes the "
            "adapter of one, leave it out to consolidate the whole model"
        )
    adapter = lora if adapter_only else None  # the LoRA record exactly when adapter_only
    tmp = prepare_target(out_dir)
    try:
        shards = _shards(ckpt, meta)
        tensors = {}
        for name, rec in meta["params"].items():
            if adapter is not None and name not in adapter["keys"]:
                continue
            t = to_hf(shards.full(f"model/{name}", rec), rec["hf"]).contiguous()
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise CheckpointError(
                    f"{ckpt}: parameter {name} holds non-finite values "
                    "(NaN/inf); refusing to write a diverged model"
                )
            tensors[name] = t
        if not adapter_only:  # persistent buffers (replicated): tp rank 0's copy
            for name in meta.get("buffers") or {}:
                tensors[name] = shards.get(0, BUFFER_PREFIX + name)
        if adapter is not None:
            state = lora_files.adapter_state(tensors, adapter)
            lora_files.write_adapter_dir(tmp, lora_files.config_from_record(adapter), state)
            commit_dir(tmp, out_dir)
            return out_dir
        if lora is not None:
            tensors = lora_files.merged_state(tensors, lora)
        cfg, config = meta["model"]["config"], None
        if cfg is not None:
            from transformers import CONFIG_MAPPING

            config = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
            config.save_pretrained(tmp)
        export_for_transformers(ckpt, config, tmp)  # tokenizer, generation config
        target = os.path.join(tmp, "model.safetensors")
        save_file(tensors, target, metadata={"format": "pt"})
        fsync(target)
        commit_dir(tmp, out_dir)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, ValueError):
            raise CheckpointError(
                f"consolidating {ckpt} into {out_dir} failed: {describe(e)}"
            ) from e
        raise
    return out_dir
