"""Loading a model for generation: a preset, a HuggingFace directory (read slice by slice) or
a neuron_tp checkpoint directory (at any tp), sharded over the mesh."""

from __future__ import annotations

import argparse
import os

import torch

from ..errors import UserError
from ..job.config import GenerateConfig


def checkpoint_path(path: str) -> str | None:
    """The neuron_tp checkpoint ``path`` names: a step directory, or the newest one under a
    run's output (or checkpoints) directory; None when ``path`` is not one (e.g. a HF dir)."""
    from .. import checkpoint
    from ..checkpoint.format import step_dirs

    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    found = checkpoint.latest(path) or checkpoint.latest(os.path.join(path, "checkpoints"))
    root = os.path.join(path, "checkpoints")
    if found is None and (os.path.isdir(root) or step_dirs(path)):
        raise UserError(
            f"{path}: a training run with no complete checkpoint yet (none under {root}); "
            "a run saves one every --save-every steps and at its end: wait for the first "
            "save, or train with --save-every N"
        )
    return found


def skipped_checkpoints(path: str, chosen: str) -> list[str]:
    """Step directories next to ``chosen`` (the checkpoint ``--model path`` resolved to) that
    are newer but incomplete (no meta.json: a save cut short), skipped by the resolution."""
    from ..checkpoint.format import STEP_RE, step_dirs, step_name

    root, name = os.path.split(chosen.rstrip("/"))
    if os.path.normpath(chosen) == os.path.normpath(path):
        return []  # a step directory named explicitly
    m = STEP_RE.match(name)
    if m is None:
        raise ValueError(f"{chosen}: not a step directory")
    step = int(m.group(1))
    return [os.path.join(root, step_name(s)) for s in step_dirs(root) if s > step]


def load_checkpoint_model(path: str, mesh, dtype: torch.dtype = torch.float32):
    """A causal LM built from the config recorded in neuron_tp checkpoint ``path``, sharded
    over ``mesh`` (any tp: resharded on load) with the checkpoint's weights; a LoRA run's
    checkpoint with its adapters merged into the sharded base weights. The full model is
    never built: parameters are created on the meta device, sharded, then filled."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from .. import checkpoint, hf
    from ..hf.loading import params_on_meta
    from ..hf.lora_files import checkpoint_lora, config_from_record

    meta = checkpoint.read_meta(path)
    lora = checkpoint_lora(meta, path)
    recorded = meta.get("model") or {}
    cfg = recorded.get("config") or {}
    if cfg.get("model_type") not in CONFIG_MAPPING:
        raise UserError(
            f"{path}: the checkpoint records no transformers model config "
            f"(model_type {cfg.get('model_type')!r}); generation needs a checkpoint "
            "of a transformers causal LM"
        )
    config = CONFIG_MAPPING[cfg["model_type"]].from_dict(cfg)
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if lora is not None:  # the adapters are merged once loaded
        from .adapters import peft_wrap

        model = peft_wrap(model, config_from_record(lora))
    if recorded.get("class") not in (None, type(model).__name__):
        raise UserError(
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
    if lora is not None:
        from ..hf.lora import merge_adapters

        model = merge_adapters(model)
    return model


def load_for_generation(args: GenerateConfig | argparse.Namespace, mesh):
    """The model named by ``--model`` sharded over ``mesh``, and the tokenizer: a preset
    (random init from the seed), a local HF directory (read slice by slice) or a neuron_tp
    checkpoint (at any tp; a LoRA run's: adapters merged). ``--adapter DIR``: the PEFT adapter
    in DIR merged into a preset or HF directory base on load. The tokenizer follows
    :func:`~neuron_tp.job.tokenizer.resolve_tokenizer` (its choice printed on rank 0) and is
    checked against the model's vocabulary before any weight is read. ``--quantize int8``:
    the sharded linear layers get int8 weights (:func:`neuron_tp.layers.quantized.quantize_int8`;
    each rank converts its own shard on the host before the model moves to its device). A
    directory written by ``neuron_tp.save_pretrained`` of a quantized model loads its int8
    weights and scales directly (whatever ``--quantize`` says: they are never dequantized)."""
    from .. import hf
    from ..job.presets import PRESETS, build_model, is_preset, model_config
    from ..job.tokenizer import check_vocab, config_vocab, resolve_tokenizer
    from .adapters import adapter_wrap, merge_adapter_dir

    config = GenerateConfig.from_args(args)
    dtype = torch.bfloat16 if config.dtype == "bfloat16" else torch.float32
    if not is_preset(config.model) and not os.path.exists(config.model):
        raise UserError(
            f"--model {config.model!r} is neither a preset ({', '.join(PRESETS)}) "
            "nor a local directory (a HuggingFace model or a neuron_tp checkpoint)"
        )
    wrap = adapter_wrap(config.adapter) if config.adapter else None
    ckpt = None if is_preset(config.model) else checkpoint_path(config.model)
    if wrap and ckpt is not None:
        raise UserError(
            f"--adapter applies to a base model (a HuggingFace directory or a preset), not "
            f"to the neuron_tp checkpoint {ckpt}; consolidate it first (neuron-tp "
            "consolidate CKPT DIR) and pass --model DIR"
        )
    resolved = resolve_tokenizer(config.tokenizer, config.model, ckpt)
    tok = resolved.tokenizer
    if mesh.rank == 0:
        print(resolved.describe(), flush=True)
    if is_preset(config.model):
        from ..job.runtime import BUILD_LOCK

        with BUILD_LOCK:  # seeds and draws the global RNG, shared by a process's threads
            full = build_model(config.model, resolved.size, config.seed, dtype)
        model = hf.parallelize(wrap(full) if wrap else full, mesh)
    elif ckpt is not None:
        from ..checkpoint import read_meta

        check_vocab(resolved, config_vocab(read_meta(ckpt)["model"]["config"]), config.model)
        if mesh.rank == 0:
            skipped = skipped_checkpoints(config.model, ckpt)
            also = f" (skipped the incomplete newer {', '.join(skipped)})" if skipped else ""
            print(f"loading checkpoint {ckpt}{also}", flush=True)
        model = load_checkpoint_model(ckpt, mesh, dtype)
    else:
        check_vocab(resolved, config_vocab(model_config(config.model, 0)), config.model)
        model = hf.from_pretrained(config.model, mesh, torch_dtype=dtype, wrap=wrap)
    if wrap and config.adapter:  # wrap is set exactly when --adapter is
        model = merge_adapter_dir(model, config.adapter)
    from ..hf.int8_model import quantize
    from ..layers.quantized import Int8WeightLinear, is_quantized
    from ..moe.quantized import quantized_experts

    if is_quantized(model):  # an int8 directory: its weights stay int8 (never dequantized)
        if mesh.rank == 0:
            print(f"{config.model}: int8 checkpoint, linears loaded as int8", flush=True)
    elif config.quantize == "int8":  # after any merge: the merged weights are quantized
        from ..job.runtime import rank_device

        quantize(model, mesh, device=rank_device(config.device))
        if mesh.rank == 0:
            n = sum(isinstance(m, Int8WeightLinear) for m in model.modules())
            e = len(quantized_experts(model))
            also = f" and {e} experts modules" if e else ""
            print(f"--quantize int8: {n} linears{also} quantized to int8 on load", flush=True)
    use_generation_config(model, ckpt or config.model)
    return model.eval(), tok


def use_generation_config(model, path: str) -> None:
    """Give ``model`` the ``generation_config.json`` in ``path`` (a HF directory or a
    checkpoint), as transformers' ``from_pretrained`` does; keep its own when there is none."""
    from ..checkpoint.assets import GENERATION_CONFIG

    if os.path.isfile(os.path.join(path, GENERATION_CONFIG)):
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)


def eos_ids(model, tokenizer) -> list[int]:
    """The ids that end a sequence: the model's generation config, else the tokenizer's."""
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = getattr(tokenizer, "eos_token_id", None)
    if ids is None:
        return []
    return [int(i) for i in (ids if isinstance(ids, (list, tuple)) else [ids])]


def draft_config(config: GenerateConfig) -> GenerateConfig:
    """The options that load ``--draft-model``: as ``--model``, without adapter, quantization
    or a draft of its own (same --tp, --dtype, --seed, --tokenizer)."""
    import dataclasses

    if config.draft_model is None:
        raise ValueError("draft_config: no --draft-model")
    return dataclasses.replace(
        config, model=config.draft_model, adapter=None, quantize="none", draft_model=None
    )


def check_draft(config: GenerateConfig, max_len: int) -> None:
    """UserError, before any weight is read, unless ``--draft-model`` can speculate for
    ``--model``: the same vocabulary size and tokenizer (both named otherwise) and
    ``--speculation-length`` fitting a slot of ``max_len`` positions."""
    from .speculative import check_speculation

    check_speculation(config.speculation_length, max_len)
    target, draft = _vocabulary(config), _vocabulary(draft_config(config))
    if target[0] != draft[0]:
        raise UserError(
            f"--draft-model {config.draft_model} has a vocabulary of {draft[0]} tokens but "
            f"--model {config.model} has {target[0]}: speculative decoding needs a draft with "
            "the same vocabulary and tokenizer"
        )
    if not _same_tokenizer(target[1].tokenizer, draft[1].tokenizer):
        raise UserError(
            f"--draft-model {config.draft_model} has another tokenizer than --model "
            f"{config.model}: draft {draft[1].describe()}; model {target[1].describe()}. "
            "Speculative decoding needs the same tokenizer (pass --tokenizer DIR to use one "
            "for both when they are the same)"
        )


def _vocabulary(config: GenerateConfig):
    """``(embedding rows, resolved tokenizer)`` of ``--model`` (a preset: the tokenizer's
    size), read from configs only."""
    from ..checkpoint import read_meta
    from ..job.presets import PRESETS, is_preset, model_config
    from ..job.tokenizer import config_vocab, resolve_tokenizer

    if not is_preset(config.model) and not os.path.exists(config.model):
        raise UserError(
            f"--model {config.model!r} is neither a preset ({', '.join(PRESETS)}) "
            "nor a local directory (a HuggingFace model or a neuron_tp checkpoint)"
        )
    ckpt = None if is_preset(config.model) else checkpoint_path(config.model)
    resolved = resolve_tokenizer(config.tokenizer, config.model, ckpt)
    if is_preset(config.model):
        return resolved.size, resolved
    if ckpt is not None:
        return config_vocab(read_meta(ckpt)["model"]["config"]), resolved
    return config_vocab(model_config(config.model, 0)), resolved


def _same_tokenizer(a, b) -> bool:
    """Whether two tokenizers map the same tokens to the same ids (byte-level: equal)."""
    if not (hasattr(a, "get_vocab") and hasattr(b, "get_vocab")):
        return type(a) is type(b)
    return a.get_vocab() == b.get_vocab()
