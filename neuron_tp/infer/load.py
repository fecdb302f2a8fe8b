"""Loading a model for generation: a preset, a HuggingFace directory (read slice by slice) or
a neuron_tp checkpoint directory (at any tp), sharded over the mesh."""

from __future__ import annotations

import argparse
import os

import torch

from ..train.config import GenerateConfig


def checkpoint_path(path: str) -> str | None:
    """The neuron_tp checkpoint ``path`` names: a step directory, or the newest one under a
    run's output (or checkpoints) directory; None when ``path`` is not one (e.g. a HF dir)."""
    from .. import checkpoint

    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    return checkpoint.latest(path) or checkpoint.latest(os.path.join(path, "checkpoints"))


def load_checkpoint_model(path: str, mesh, dtype: torch.dtype = torch.float32):
    """A causal LM built from the config recorded in neuron_tp checkpoint ``path``, sharded
    over ``mesh`` (any tp: resharded on load) with the checkpoint's weights. The full model is
    never built: parameters are created on the meta device, sharded, then filled."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from .. import checkpoint, hf
    from ..hf.loading import _params_on_meta

    meta = checkpoint.read_meta(path)
    recorded = meta.get("model") or {}
    cfg = recorded.get("config") or {}
    if cfg.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(
            f"{path}: the checkpoint records no transformers model config "
            f"(model_type {cfg.get('model_type')!r}); generation needs a checkpoint "
            "of a transformers causal LM"
        )
    config = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    with _params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if recorded.get("class") not in (None, type(model).__name__):
        raise ValueError(
            f"{path}: a checkpoint of {recorded['class']}, not of a causal LM "
            f"({type(model).__name__}); generation needs a causal LM"
        )
    hf.parallelize(model, mesh)
    made: dict[int, tuple] = {}  # old id -> (old, new): tied parameters stay tied
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None and p.is_meta:
                if id(p) not in made:
                    made[id(p)] = (
                        p,
                        torch.nn.Parameter(
                            torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad
                        ),
                    )
                mod._parameters[name] = made[id(p)][1]
    checkpoint.load(path, model, mesh=mesh, restore_rng=False)
    return model


def load_for_generation(args: GenerateConfig | argparse.Namespace, mesh):
    """The model named by ``--model`` sharded over ``mesh``, and the tokenizer: a preset
    (random init from the seed), a local HF directory (read slice by slice) or a neuron_tp
    checkpoint (at any tp). The tokenizer follows :func:`~neuron_tp.train.tokenizer.
    resolve_tokenizer` (its choice printed on rank 0) and is checked against the model's
    vocabulary before any weight is read."""
    from .. import hf
    from ..train.presets import PRESETS, build_model, is_preset, model_config
    from ..train.tokenizer import check_vocab, config_vocab, resolve_tokenizer

    config = GenerateConfig.from_args(args)
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    if not is_preset(config.model) and not os.path.exists(config.model):
        raise ValueError(
            f"--model {config.model!r} is neither a preset ({', '.join(PRESETS)}) "
            "nor a local directory (a HuggingFace model or a neuron_tp checkpoint)"
        )
    ckpt = None if is_preset(config.model) else checkpoint_path(config.model)
    resolved = resolve_tokenizer(config.tokenizer, config.model, ckpt)
    tok = resolved.tokenizer
    if mesh.rank == 0:
        print(resolved.describe(), flush=True)
    if is_preset(config.model):
        from ..train.runtime import BUILD_LOCK

        with BUILD_LOCK:  # seeds and draws the global RNG, shared by a process's threads
            full = build_model(config.model, resolved.size, config.seed, dtype)
        model = hf.parallelize(full, mesh)
    elif ckpt is not None:
        from ..checkpoint import read_meta

        check_vocab(resolved, config_vocab(read_meta(ckpt)["model"]["config"]), config.model)
        model = load_checkpoint_model(ckpt, mesh, dtype)
    else:
        check_vocab(resolved, config_vocab(model_config(config.model, 0)), config.model)
        model = hf.from_pretrained(config.model, mesh, torch_dtype=dtype)
    use_generation_config(model, ckpt or config.model)
    return model.eval(), tok


def use_generation_config(model, path: str) -> None:
    """Give ``model`` the ``generation_config.json`` in ``path`` (a HF directory or a
    checkpoint), as transformers' ``from_pretrained`` does; keep its own when there is none."""
    from ..checkpoint.assets import GENERATION_CONFIG

    if os.path.isfile(os.path.join(path, GENERATION_CONFIG)):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
