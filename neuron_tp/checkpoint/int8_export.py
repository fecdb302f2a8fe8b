"""``neuron-tp consolidate --quantize int8``: a training checkpoint or a float HF directory
written straight to neuron_tp's int8 directory (:mod:`neuron_tp.hf.quantized_files`), offline,
in one process (no mesh, no collective).

The weights are quantized as ``--quantize int8`` quantizes them on load (per output channel of
the full weight, in the stored dtype: float32 unless config.json says bfloat16 / float16), so
the directory loads at any tp with the int8 weights ``neuron_tp.quantize`` computes from the
float model. A checkpoint is first consolidated (:func:`.merge.consolidate`: LoRA merged) into
a temporary float directory next to the target, removed afterwards."""

from __future__ import annotations

import os
import shutil

import torch

from ..errors import UserError
from .format import latest
from .merge import commit_dir, consolidate, prepare_target

_MODEL_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def is_hf_dir(path: str) -> bool:
    """True for a HF model directory (config.json, no checkpoint in or under it)."""
    if os.path.exists(os.path.join(path, "meta.json")):
        return False
    if latest(path) or latest(os.path.join(path, "checkpoints")):
        return False
    return os.path.isfile(os.path.join(path, "config.json"))


def write_int8_dir(src: str, dst: str) -> None:
    """Quantize float HF directory ``src`` into ``dst`` (int8 weights, float32 scales, its
    ``quantization_config``), with ``src``'s tokenizer and other non-weight files."""
    from transformers import AutoConfig

    from ..hf.int8_model import quantize
    from ..hf.loading import from_pretrained
    from ..hf.quantized_files import read_format
    from ..hf.saving import save_pretrained
    from ..parallel.mesh import Mesh

    config = AutoConfig.from_pretrained(src)
    if read_format(config, src) is not None:
        raise UserError(
            f"{src} is already a neuron_tp int8 directory; consolidate --quantize int8 reads "
            "a training checkpoint or a float HF directory"
        )
    dtype = _DTYPES.get(str(getattr(config, "dtype", None) or "").replace("torch.", ""))
    mesh = Mesh(world_size=1, rank=0, tp=1)
    model = from_pretrained(src, mesh, torch_dtype=dtype or torch.float32).eval()
    quantize(model, mesh)
    save_pretrained(model, dst, mesh)
    for name in sorted(os.listdir(src)):
        if name in _MODEL_FILES or name.endswith(".safetensors") or name.endswith(".bin"):
            continue
        here, there = os.path.join(src, name), os.path.join(dst, name)
        if os.path.isdir(here):
            shutil.copytree(here, there)
        else:
            shutil.copy2(here, there)


def consolidate_int8(path: str, out_dir: str) -> str:
    """Write checkpoint ``path`` (or the newest one under it), or float HF directory ``path``,
    as an int8 directory ``out_dir`` (new or empty; refused before anything is read).
    Returns ``out_dir``."""
    hf_src = is_hf_dir(path)
    tmp = prepare_target(out_dir)
    float_dir = None if hf_src else out_dir.rstrip("/") + ".tmp-float"
    try:
        if float_dir is not None:
            shutil.rmtree(float_dir, ignore_errors=True)
            consolidate(path, float_dir)
        write_int8_dir(path if float_dir is None else float_dir, tmp)
        commit_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if float_dir is not None:
            shutil.rmtree(float_dir, ignore_errors=True)
    return out_dir
