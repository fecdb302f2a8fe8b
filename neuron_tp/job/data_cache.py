"""Tokenize once: the rows of a run's data (:mod:`.sft_data`) stored under ``--data-cache DIR``
as ``.npy`` arrays, memory-mapped by every reader.

An entry's key hashes the data files' contents, the tokenizer (class, vocabulary, special
tokens, chat template) and the options that shape the rows. The first rank of a node to take the
entry's lock (``flock``, also between threads of one process) tokenizes and writes the entry
(into a temporary directory renamed into place: never half-written); the others wait on the lock
and then read it. The arrays are mapped read-only, so the ranks of a node share one copy of
the tokens in the page cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable

import numpy as np
import torch

from ..errors import UserError
from .data import data_files

VERSION = 1  # of the entry layout and of the row building: a change makes new keys
META = "meta.json"


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what makes the tokenizer's ids: class, vocabulary, special tokens, template."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    elif hasattr(tokenizer, "get_vocab"):
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "chat_template"):
        h.update(repr(getattr(tokenizer, name, None)).encode())
    return h.hexdigest()


def cache_key(path: str, tokenizer, options: dict) -> str:
    """The entry name of the data at ``path`` tokenized by ``tokenizer`` into rows shaped by
    ``options``."""
    h = hashlib.sha256(json.dumps({"version": VERSION, **options}, sort_keys=True).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    for f in data_files(path):
        h.update(os.path.basename(f).encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:24]


def _write(entry: str, rows: dict[str, torch.Tensor], notes: list[str]) -> None:
    parent = os.path.dirname(entry)
    tmp = tempfile.mkdtemp(dir=parent, prefix=os.path.basename(entry) + ".tmp-")
    try:
        names = []
        for name, t in rows.items():
            if name == "labels" and t is rows["input_ids"]:
                continue  # language modelling: the labels are the ids
            np.save(os.path.join(tmp, f"{name}.npy"), t.numpy())
            names.append(name)
        with open(os.path.join(tmp, META), "w") as fh:
            json.dump({"arrays": names, "notes": notes}, fh)
        os.rename(tmp, entry)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _read(entry: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    with open(os.path.join(entry, META)) as fh:
        meta = json.load(fh)
    rows = {}
    with warnings.catch_warnings():  # read-only mapping: torch warns it is not writable
        warnings.simplefilter("ignore", UserWarning)
        for name in meta["arrays"]:
            rows[name] = torch.from_numpy(np.load(os.path.join(entry, f"{name}.npy"), "r"))
    rows.setdefault("labels", rows["input_ids"])
    return rows, meta["notes"]


def rows_of(
    cache_dir: str | None,
    path: str,
    tokenizer,
    options: dict,
    build: Callable[[], tuple[dict[str, torch.Tensor], list[str]]],
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The rows and notes of the data at ``path``: ``build()``'s, through the entry of
    ``cache_dir`` keyed by the data, the tokenizer and ``options`` (the row shape; they name
    the kind of rows) when there is one (its note says whether it was written or read)."""
    if not cache_dir:
        return build()
    key = cache_key(path, tokenizer, options)
    rows, notes, built = cached_rows(cache_dir, key, build)
    return rows, [*notes, f"data cache: {cache_dir}/{key} ({'written' if built else 'read'})"]


def cached_rows(
    cache_dir: str,
    key: str,
    build: Callable[[], tuple[dict[str, torch.Tensor], list[str]]],
) -> tuple[dict[str, torch.Tensor], list[str], bool]:
    """The rows and notes of entry ``key`` in ``cache_dir``, built by ``build()`` (and written)
    when missing; the last value is True when this call built them."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = open(os.path.join(cache_dir, f"{key}.lock"), "w")  # noqa: SIM115
    except OSError as e:
        raise UserError(f"--data-cache {cache_dir!r} is not a writable directory: {e}") from None
    entry = os.path.join(cache_dir, key)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        built = not os.path.isfile(os.path.join(entry, META))
        if built:
            rows, notes = build()
            _write(entry, rows, notes)
    rows, notes = _read(entry)
    return rows, notes, built
