"""The on-disk format: directory names, metadata, per-tensor checksums and durable writes.

Every safetensors file a checkpoint writes carries, in its header metadata under
``neuron_tp``, a CRC-32 of every tensor's bytes plus what the file is (step, tp rank), so a
damaged or misplaced file is refused on load and consolidate, naming file and tensor. CRC-32
(zlib, ~2.4 GB/s here, 3x sha256) because it guards against storage damage, not tampering.
"""

from __future__ import annotations

import json
import os
import re
import zlib

import torch

from ..errors import UserError

FORMAT = "neuron_tp.checkpoint/2"  # /2: per-tensor checksums in every safetensors file
# /3: a ZeRO-1 optimizer state sharded over dp (meta["optimizer"]["dp_shards"], one
# optim-tp*-dp*.safetensors per rank); older readers refuse it instead of losing the state.
FORMAT_DP_SHARDED = "neuron_tp.checkpoint/3"
# /4: pipeline stage files (meta["mesh"]["pp"] > 1, each parameter's record names its "stage";
# shard-pp*-tp*.safetensors, optim-pp*-tp*-dp*.safetensors), with or without ZeRO-1.
FORMAT_STAGED = "neuron_tp.checkpoint/4"
READABLE = ("neuron_tp.checkpoint/1", FORMAT, FORMAT_DP_SHARDED, FORMAT_STAGED)
STEP_RE = re.compile(r"^step-(\d{8})$")


class CheckpointError(UserError):
    """A checkpoint could not be written, read or verified (raised on every rank)."""


def step_name(step: int) -> str:
    return f"step-{int(step):08d}"


def stage_part(stage: int | None) -> str:
    """The part of a file name that says which pipeline stage wrote it (none at pp 1)."""
    return "" if stage is None else f"-pp{stage:05d}"


def shard_file(path: str, tp_rank: int, stage: int | None = None) -> str:
    """The parameter file of tp rank ``tp_rank`` (of pipeline stage ``stage``; None: pp 1)."""
    name = "shard" + stage_part(stage) + f"-tp{tp_rank:05d}.safetensors"
    return os.path.join(path, name)


def step_dirs(root: str) -> list[int]:
    """Steps of every ``step-*`` directory under ``root`` (complete or not), ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(STEP_RE.match, os.listdir(root)) if m)


def latest(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (None when there is none)."""
    done = [
        s for s in step_dirs(root) if os.path.exists(os.path.join(root, step_name(s), "meta.json"))
    ]
    return os.path.join(root, step_name(done[-1])) if done else None


def read_meta(path: str) -> dict:
    """The metadata of checkpoint ``path``; ValueError when it is not a readable checkpoint."""
    f = os.path.join(path, "meta.json")
    try:
        with open(f) as fh:
            meta = json.load(fh)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{path} is not a neuron_tp checkpoint (no meta.json)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{f}: unreadable checkpoint metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") not in READABLE:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise CheckpointError(f"{f}: format {got!r}, expected one of {READABLE}")
    return meta


def checksum(t: torch.Tensor) -> str:
    """CRC-32 of the tensor's bytes (row-major), as 8 hex digits."""
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{zlib.crc32(data.data) & 0xFFFFFFFF:08x}"


def fsync(path: str) -> None:
    """Flush a file or directory to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` and fsync it."""
    with open(path, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def write_tensors(path: str, tensors: dict[str, torch.Tensor], info: dict) -> None:
    """safetensors file with a checksum of every tensor and ``info`` in its header; fsynced."""
    from safetensors import torch as st

    record = {**info, "crc32": {k: checksum(t) for k, t in tensors.items()}}
    st.save_file(tensors, path, metadata={"format": "pt", "neuron_tp": json.dumps(record)})
    fsync(path)


def file_record(path: str, header: dict | None) -> dict | None:
    """The ``neuron_tp`` record of a safetensors header's metadata (None when absent)."""
    raw = (header or {}).get("neuron_tp")
    if raw is None:
        return None
    try:
        rec = json.loads(raw)
    except ValueError:
        raise CheckpointError(f"{path}: damaged checksum record in the file header") from None
    if not isinstance(rec, dict) or not isinstance(rec.get("crc32"), dict):
        raise CheckpointError(f"{path}: damaged checksum record in the file header")
    return rec


def verify(path: str, key: str, t: torch.Tensor, record: dict | None) -> torch.Tensor:
    """``t`` (tensor ``key`` read from ``path``) after checking it against the file's record
    (None: a format-1 checkpoint, nothing to check)."""
    if record is None:
        return t
    want = record["crc32"].get(key)
    if want is None:
        raise CheckpointError(
            f"{path}: tensor {key!r} has no checksum in the file header "
            "(the file does not belong to this checkpoint, or is damaged)"
        )
    got = checksum(t)
    if got != want:
        raise CheckpointError(
            f"{path}: tensor {key!r} is damaged (CRC-32 {got}, recorded "
            f"{want}); restore the file or use an earlier checkpoint"
        )
    return t
