"""Which tokenizer a run uses, one rule for train, generate and serve
(:func:`resolve_tokenizer`), what a checkpoint records about it (:func:`checkpoint_assets`),
and the one check that its ids fit the model's embedding (:func:`check_vocab`).

The rule: ``--tokenizer DIR`` (``--tokenizer bytes``: the byte-level one), else the tokenizer
in the ``--model`` HuggingFace directory, else the one recorded in the neuron_tp checkpoint
``--model`` names, else the byte-level tokenizer for a built-in preset. Anything else (a model
directory or checkpoint without a tokenizer) is a :class:`~neuron_tp.errors.UserError`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

from ..checkpoint.assets import GENERATION_CONFIG, TOKENIZER_DIR
from ..errors import UserError
from .data import ByteTokenizer, load_tokenizer, vocab_size

BYTES = "bytes"  # --tokenizer bytes: the byte-level tokenizer
# Files whose presence makes a directory hold a HF tokenizer (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ResolvedTokenizer:
    """A run's tokenizer, the directory it came from (None: byte-level) and why it was
    chosen (``"--tokenizer"``, ``"the --model directory's"``, ``"recorded in CKPT"``,
    ``"preset default"``)."""

    tokenizer: Any  # a transformers tokenizer, or ByteTokenizer
    path: str | None
    origin: str

    @property
    def size(self) -> int:
        return vocab_size(self.tokenizer)

    def describe(self) -> str:
        """One line for the startup log, e.g. ``tokenizer: /m (LlamaTokenizerFast, 32000
        tokens; the --model directory's)``."""
        where = "byte-level" if self.path is None else self.path
        kind = "" if self.path is None else f"{type(self.tokenizer).__name__}, "
        return f"tokenizer: {where} ({kind}{self.size} tokens; {self.origin})"


def holds_tokenizer(path: str) -> bool:
    """True when directory ``path`` holds HF tokenizer files."""
    return any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES)


def _explicit(option: str) -> ResolvedTokenizer:
    if option == BYTES:
        return ResolvedTokenizer(ByteTokenizer(), None, "--tokenizer bytes")
    if not os.path.isdir(option) or not holds_tokenizer(option):
        what = "is not a directory" if not os.path.isdir(option) else "holds no tokenizer files"
        raise UserError(
            f"--tokenizer {option!r} {what} ({', '.join(TOKENIZER_FILES)}); pass a local "
            f"HuggingFace tokenizer directory, or --tokenizer {BYTES} for the byte-level one"
        )
    return ResolvedTokenizer(load_tokenizer(option), option, "--tokenizer")


def recorded_tokenizer(ckpt: str, meta: dict) -> ResolvedTokenizer:
    """The tokenizer a training run recorded in checkpoint ``ckpt`` (``meta``: its metadata);
    UserError when it records none (a checkpoint written before tokenizers were recorded)."""
    rec = (meta.get("extra") or {}).get("tokenizer") or {}
    where = f"recorded in {ckpt}"
    if rec.get("kind") == BYTES:
        return ResolvedTokenizer(ByteTokenizer(), None, where)
    path = os.path.join(ckpt, rec.get("dir") or TOKENIZER_DIR)
    if rec.get("kind") == "files" and holds_tokenizer(path):
        return ResolvedTokenizer(load_tokenizer(path), path, where)
    raise UserError(
        f"checkpoint {ckpt} records no tokenizer (written by an older neuron_tp, or its "
        f"{TOKENIZER_DIR}/ directory is missing): pass the tokenizer the run was trained with, "
        f"--tokenizer DIR (a HuggingFace tokenizer directory) or --tokenizer {BYTES}"
    )


def resolve_tokenizer(
    option: str | None, model: str, ckpt: str | None = None, meta: dict | None = None
) -> ResolvedTokenizer:
    """The tokenizer of a run on ``--model model`` with ``--tokenizer option`` (None: not
    given); ``ckpt``/``meta``: the neuron_tp checkpoint ``model`` names and its metadata
    (generate and serve). See the module docstring for the rule."""
    from .presets import PRESETS, is_preset

    if option is not None:
        return _explicit(option)
    if is_preset(model):
        return ResolvedTokenizer(
            ByteTokenizer(), None, "preset default; --tokenizer DIR for another"
        )
    if ckpt is not None:
        from .. import checkpoint

        return recorded_tokenizer(ckpt, meta if meta is not None else checkpoint.read_meta(ckpt))
    if not os.path.isdir(model):
        raise UserError(
            f"--model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a local "
            "directory (a HuggingFace model or a neuron_tp checkpoint)"
        )
    from ..hf.model_files import check_model_dir

    check_model_dir(model)  # a directory of something else: say what it is instead
    if holds_tokenizer(model):
        return ResolvedTokenizer(load_tokenizer(model), model, "the --model directory's")
    raise UserError(
        f"--model {model!r} holds no tokenizer ({', '.join(TOKENIZER_FILES)}): pass the "
        f"model's tokenizer with --tokenizer DIR (or --tokenizer {BYTES} for byte-level ids)"
    )


def check_vocab(resolved: ResolvedTokenizer, model_vocab: int | None, model: str) -> None:
    """UserError unless every id of the tokenizer is a row of the model's embedding
    (``len(tokenizer) <= model_vocab``; None: the model names no vocabulary, nothing to
    check): a larger tokenizer makes ids the model has no embedding for (an IndexError on the
    CPU, text from out-of-range ids on an XLA device)."""
    if model_vocab is not None and resolved.size > model_vocab:
        raise UserError(
            f"the tokenizer has {resolved.size} tokens but --model {model} has {model_vocab} "
            f"(its embedding rows): ids >= {model_vocab} have no embedding. "
            f"{resolved.describe()}; use the model's own tokenizer (omit --tokenizer when the "
            "model directory or checkpoint holds it, or pass --tokenizer DIR of the model's)"
        )


def config_vocab(cfg) -> int | None:
    """The vocabulary (embedding rows) of transformers config ``cfg`` (or its dict, as a
    checkpoint records it); None when it names none."""
    if isinstance(cfg, dict):
        found = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    else:
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        found = getattr(text, "vocab_size", None)
    return int(found) if found else None


def checkpoint_assets(resolved: ResolvedTokenizer, model: str) -> tuple[dict, dict[str, bytes]]:
    """What a training run records with each checkpoint: the metadata record of its tokenizer
    and the files to write (the tokenizer's, under ``tokenizer/``, and the ``--model``
    directory's ``generation_config.json`` when it has one)."""
    files: dict[str, bytes] = {}
    if resolved.path is None:
        record: dict = {"kind": BYTES, "size": resolved.size}
    else:
        record = {
            "kind": "files",
            "dir": TOKENIZER_DIR,
            "class": type(resolved.tokenizer).__name__,
            "size": resolved.size,
        }
        with tempfile.TemporaryDirectory() as tmp:
            resolved.tokenizer.save_pretrained(tmp)
            for name in sorted(os.listdir(tmp)):
                if not os.path.isfile(os.path.join(tmp, name)):
                    continue
                with open(os.path.join(tmp, name), "rb") as fh:
                    files[f"{TOKENIZER_DIR}/{name}"] = fh.read()
    gen = os.path.join(model, GENERATION_CONFIG)
    if os.path.isfile(gen):
        with open(gen, "rb") as fh:
            files[GENERATION_CONFIG] = fh.read()
    return record, files
