"""Files a checkpoint carries besides tensors and metadata: the run's tokenizer (under
``tokenizer/``) and the model's ``generation_config.json``. Rank 0 writes them into the
temporary directory with the rest (:func:`write_files`), so they commit atomically with the
checkpoint; :func:`export_for_transformers` puts them next to a consolidated model."""

from __future__ import annotations

import os
import shutil

from .format import fsync

TOKENIZER_DIR = "tokenizer"
GENERATION_CONFIG = "generation_config.json"


def write_files(root: str, files: dict[str, bytes]) -> None:
    """Write ``files`` (path relative to ``root`` -> content) durably under ``root``."""
    dirs = set()
    for rel, data in files.items():
        path = os.path.join(root, rel)
        if os.path.isabs(rel) or os.path.normpath(rel).startswith(".."):
            raise ValueError(f"checkpoint file {rel!r} must be a relative path inside it")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        dirs.add(os.path.dirname(path))
    for d in dirs:
        fsync(d)


def export_for_transformers(ckpt: str, config, out: str) -> None:
    """Into consolidated directory ``out``: the tokenizer files checkpoint ``ckpt`` carries
    (none for a byte-level run) and a ``generation_config.json`` (the checkpoint's, else one
    derived from transformers config ``config``), so plain ``AutoTokenizer`` /
    ``AutoModelForCausalLM.generate`` work on ``out``."""
    tok = os.path.join(ckpt, TOKENIZER_DIR)
    if os.path.isdir(tok):
        for name in sorted(os.listdir(tok)):
            if os.path.isfile(os.path.join(tok, name)):
                shutil.copyfile(os.path.join(tok, name), os.path.join(out, name))
    gen = os.path.join(ckpt, GENERATION_CONFIG)
    if os.path.isfile(gen):
        shutil.copyfile(gen, os.path.join(out, GENERATION_CONFIG))
    elif config is not None:
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(config).save_pretrained(out)
