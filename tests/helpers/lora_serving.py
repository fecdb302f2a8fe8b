"""PEFT adapters for the multi-LoRA serving tests: random LoRA weights on a tiny base model
saved as PEFT directories (different ranks, alphas, rsLoRA and target subsets), and their
reference: peft's merged model (``merge_and_unload``) in plain transformers."""

from __future__ import annotations

import copy
import os

import torch

V = 257
BASE = "tiny-llama"
# (rank, alpha, rsLoRA, target modules) of each test adapter
SPECS = {
    "alpha": (
        8,
        16,
        False,
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "beta": (4, 8, True, ["q_proj", "v_proj", "down_proj"]),
    "gamma": (2, 4, False, ["o_proj", "up_proj"]),
}


def base_model(name: str = BASE):
    """The tiny base model (tests/infer/engine_cases.py's)."""
    from neuron_tp.job.presets import build_model

    return build_model(name, V, 4).eval()


def write_adapter(root: str, name: str, seed: int, base=None) -> str:
    """A PEFT adapter directory ``root/name`` of ``SPECS[name]`` with random weights large
    enough to change the tokens; returns its path."""
    from peft import LoraConfig, get_peft_model

    r, alpha, rs, targets = SPECS[name]
    model = get_peft_model(
        copy.deepcopy(base if base is not None else base_model()),
        LoraConfig(r=r, lora_alpha=alpha, use_rslora=rs, target_modules=targets),
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    path = os.path.join(root, name)
    model.save_pretrained(path)
    return path


def merged(path: str, base=None):
    """peft's merged model of the adapter in ``path`` (transformers, unsharded)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(
        copy.deepcopy(base if base is not None else base_model()), path
    )
    return model.merge_and_unload().eval()


def foreign_adapter(root: str) -> str:
    """A PEFT adapter on the base model's LM head (no LoRA-capable projection of the sharded
    model: its vocabulary-parallel head gathers its output); returns its path."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(base_model(), LoraConfig(r=2, target_modules=["lm_head"]))
    path = os.path.join(root, "foreign")
    model.save_pretrained(path, save_embedding_layers=False)
    return path
