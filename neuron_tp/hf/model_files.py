"""A HF model directory's safetensors files: checks, the name -> file map, fingerprints, and
tensors read by name (whole or a range) with each file opened once."""

from __future__ import annotations

import json
import os
import zlib

import torch

from ..errors import UserError


def check_model_dir(path: str) -> None:
    """ValueError saying what ``path`` is instead, unless it is a local HF model directory."""
    if not os.path.isdir(path):
        what = "a file" if os.path.exists(path) else "does not exist"
        raise UserError(
            f"model {path!r}: {what}; neuron_tp loads a local HuggingFace model "
            "directory (config.json + *.safetensors; download it first, e.g. "
            "`huggingface-cli download ORG/NAME --local-dir DIR`)"
        )
    if not os.path.exists(os.path.join(path, "config.json")):
        if os.path.exists(os.path.join(path, "meta.json")) or os.path.isdir(
            os.path.join(path, "checkpoints")
        ):
            raise UserError(
                f"model {path!r} is a neuron_tp training checkpoint, not a "
                "HuggingFace model directory: resume it with --resume PATH, "
                "generate from it with `neuron-tp generate --model PATH`, or "
                "convert it with `neuron-tp consolidate PATH OUT`"
            )
        raise UserError(
            f"model {path!r}: no config.json; pass a HuggingFace model directory "
            "(config.json + *.safetensors)"
        )


def open_safetensors(file: str):
    """``safe_open(file)``; ValueError naming the file when it is missing, truncated or not
    safetensors."""
    from safetensors import safe_open

    try:
        return safe_open(file, "pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: one clear message
        size = os.path.getsize(file) if os.path.exists(file) else None
        raise UserError(
            f"{file}: unreadable safetensors file ({size} bytes: {e}); it is "
            "missing, truncated (an interrupted download or copy?) or corrupt: "
            "copy or download it again"
        ) from None


SAMPLES, SAMPLE_BYTES = 16, 4096  # tensor-data blocks read per file by files_fingerprint


def files_fingerprint(files) -> dict[str, list]:
    """``{file name: [size, CRC32 of its safetensors header and of 16 evenly spaced 4 KiB
    blocks of its tensor data]}``: cheap (64 KiB read per file), and differs for a truncated,
    re-saved or different file, also one with the same header but other weights (each rank
    reads only its own slices, so nothing else would compare them)."""
    out: dict[str, list] = {}
    for file in sorted(set(files)):
        try:
            size = os.path.getsize(file)
            with open(file, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                crc = zlib.crc32(fh.read(min(n, 100_000_000)))
                start = 8 + n
                step = max(1, (size - start) // SAMPLES)
                for offset in range(start, size, step):
                    fh.seek(offset)
                    crc = zlib.crc32(fh.read(SAMPLE_BYTES), crc)
            out[os.path.basename(file)] = [size, crc]
        except OSError as e:
            out[os.path.basename(file)] = [None, repr(e)]
    return out


def checkpoint_files(path: str) -> dict[str, str]:
    """``{tensor name: file}`` of a single-file or sharded (index.json) safetensors checkpoint."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        try:
            with open(index) as f:
                wmap = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UserError(
                f"{index}: unreadable safetensors index ({e!r}); it needs a "
                "'weight_map' of tensor name -> file"
            ) from None
        return {k: os.path.join(path, v) for k, v in wmap.items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise UserError(f"{path}: no model.safetensors or model.safetensors.index.json")
    with open_safetensors(single) as f:
        return {k: single for k in f.keys()}


class OpenedFiles:
    """The checkpoint's tensors by name, each file opened once (``handles``: file -> handle)."""

    def __init__(self, files: dict[str, str], handles: dict):
        self.files, self.handles = files, handles

    def handle(self, name: str):
        """The safetensors slice handle of tensor ``name``."""
        file = self.files[name]
        if file not in self.handles:
            self.handles[file] = open_safetensors(file)
        return self.handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handle(name).get_shape())

    def read(
        self,
        name: str,
        dim: int | None,
        start: int,
        stop: int,
        rows: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Tensor ``name`` (``dim`` None) or its ``[start, stop)`` range along ``dim``; only
        the ``rows`` range of dim 0 when given (a rank's experts)."""
        sl = self.handle(name)
        if dim is None and rows is None:
            return sl[:]
        ranges = {d: slice(None) for d in range(len(sl.get_shape()))}
        if rows is not None:
            ranges[0] = slice(*rows)
        if dim is not None:
            ranges[dim] = slice(start, stop)
        return sl[tuple(ranges[d] for d in sorted(ranges))]
