"""``neuron-tp train --lora-r R``: fine-tune LoRA adapters (the ``peft`` library) of a model,
base weights frozen. The model is wrapped by ``peft.get_peft_model`` before it is sharded
(:mod:`neuron_tp.hf.lora`); the adapters are saved in PEFT's format at the end of the run."""

from __future__ import annotations

import os

from torch import nn

from ..errors import UserError
from ..job.config import TrainConfig

ADAPTER_DIR = "adapter"  # under --output-dir: adapter_model.safetensors + adapter_config.json


def lora_config(config: TrainConfig):
    """The ``peft.LoraConfig`` of the options (targets: peft's default for the model type
    when ``--lora-target-modules`` is not given)."""
    from peft import LoraConfig

    return LoraConfig(
        r=config.lora.r,
        lora_alpha=config.lora.alpha,  # type: ignore[arg-type]  # peft says int; floats work
        lora_dropout=config.lora.dropout,
        target_modules=config.lora.target_modules or None,
        task_type="CAUSAL_LM",
    )


def wrap(model: nn.Module, config: TrainConfig) -> nn.Module:
    """``get_peft_model(model, lora_config(config))`` with the adapters initialised as peft
    does but from ``--seed`` alone (a forked RNG: the same adapters on every rank, for a
    model built whole or on the meta device, whatever was drawn before); on a meta-device
    model (read slice by slice later) the adapter weights are created on the CPU."""
    import torch
    from peft import get_peft_model
    from peft.tuners.lora import LoraLayer

    from ..hf.lora import refuse_parallelized

    refuse_parallelized(model)
    cfg = lora_config(config)
    try:
        peft_model = get_peft_model(model, cfg)
    except ValueError as e:  # e.g. a fused MoE experts module, or a name that matches nothing
        from ..hf.lora_targets import valid_targets

        raise UserError(
            f"--lora-target-modules {','.join(config.lora.target_modules) or '(default)'}: "
            f"{' '.join(str(e).split())}; LoRA targets this model supports under tensor "
            f"parallelism: {','.join(valid_targets(model, None))}"
        ) from None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        for mod in peft_model.modules():
            if isinstance(mod, LoraLayer):
                for name in mod.active_adapters:
                    if mod.lora_A[name].weight.is_meta:
                        mod.lora_A[name].to_empty(device="cpu")
                        mod.lora_B[name].to_empty(device="cpu")
                    mod.reset_lora_parameters(name, cfg.init_lora_weights)
    return peft_model


def trainable_summary(model: nn.Module) -> dict[str, int]:
    """Parameters of this rank: trainable and all (element counts)."""
    params = list({id(p): p for p in model.parameters()}.values())
    return {
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "total": sum(p.numel() for p in params),
    }


def save(model: nn.Module, output_dir: str, mesh) -> str:
    """Write the adapters in PEFT's format to ``output_dir/adapter`` (rank 0 writes)."""
    from ..hf.lora import save_adapter

    out = os.path.join(output_dir, ADAPTER_DIR)
    save_adapter(model, out, mesh)
    return out


def frozen_check(model: nn.Module) -> None:
    """Only adapter weights train (a guard against a wrapper that left a base weight on)."""
    bad = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    if bad:
        raise ValueError(f"LoRA run with trainable non-adapter parameters: {bad[:3]}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("LoRA run without trainable parameters: check --lora-target-modules")
