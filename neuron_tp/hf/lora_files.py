"""LoRA (peft) weights outside a live model: the record a checkpoint of a LoRA run keeps, the
merged plain weights (``W + scaling * B A``, what peft's ``merge_and_unload`` computes) and the
PEFT adapter directory, from full tensors read offline (``neuron-tp consolidate``).

The record (``meta["model"]["lora"]`` of a checkpoint, made by
:func:`neuron_tp.hf.lora.lora_record` from the live model) holds the adapter's ``LoraConfig``,
peft's own ``scaling`` of every adapted module (rsLoRA, rank and alpha patterns included) and
the key of every LoRA parameter in peft's adapter file, so nothing here re-derives peft's rules.
"""

from __future__ import annotations

import os

import torch

from ..errors import UserError

SAFETENSORS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def plain_name(name: str) -> str:
    """The name a parameter of a ``PeftModel`` has in the plain transformers model (PeftModel
    prefix and ``base_layer`` of a wrapped projection removed)."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def read_adapter_config(adapter_dir: str, what: str | None = None):
    """The ``LoraConfig`` of PEFT adapter directory ``adapter_dir`` (``what``: how errors name
    it, default ``--adapter DIR``); UserError when it is not one, or not a LoRA adapter."""
    from peft import PeftConfig, PeftType

    what = what or f"--adapter {adapter_dir!r}"
    if not os.path.isfile(os.path.join(adapter_dir, CONFIG)):
        raise UserError(
            f"{what}: no {CONFIG} there; give a PEFT adapter directory (e.g. a LoRA run's "
            "OUTPUT_DIR/adapter, or `neuron-tp consolidate --adapter-only` output)"
        )
    try:
        config = PeftConfig.from_pretrained(adapter_dir)
    except Exception as e:  # noqa: BLE001 - an unreadable config is the user's input
        raise UserError(f"{what}: {CONFIG} cannot be read: {e}") from e
    if config.peft_type != PeftType.LORA:
        raise UserError(f"{what}: a {config.peft_type} adapter; LoRA only")
    return config


def config_from_record(record: dict):
    """The ``peft.LoraConfig`` a record holds."""
    from peft import PeftConfig

    return PeftConfig.from_peft_type(**record["config"])


def write_adapter_dir(out_dir: str, config, state: dict[str, torch.Tensor]) -> None:
    """Write peft's adapter format: ``adapter_config.json`` (``config`` saved for inference)
    and ``adapter_model.safetensors`` (``state``: tensors under peft's adapter-file keys)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    before = config.inference_mode
    config.inference_mode = True
    try:
        config.save_pretrained(out_dir)
    finally:
        config.inference_mode = before
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        os.path.join(out_dir, SAFETENSORS),
        metadata={"format": "pt"},
    )


def adapter_state(tensors: dict[str, torch.Tensor], record: dict) -> dict[str, torch.Tensor]:
    """The adapter file's tensors (peft's keys) from full HF-layout tensors of a PeftModel."""
    return {key: tensors[name] for name, key in record["keys"].items()}


def merged_state(tensors: dict[str, torch.Tensor], record: dict) -> dict[str, torch.Tensor]:
    """The plain model's tensors (transformers' names, no LoRA keys) from full HF-layout
    tensors of a PeftModel: each adapted weight becomes ``W + scaling * B A`` as peft merges it
    (``transpose(B @ A, fan_in_fan_out) * scaling``, in float32 for half-precision adapters and
    cast back, added to the weight in the promoted dtype and rounded to the weight's)."""
    adapter = record["adapter"]
    fan_in_fan_out = bool(record["config"].get("fan_in_fan_out"))
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if "lora_" not in name:
            out[plain_name(name)] = t
    for module, scaling in record["scaling"].items():
        weight = f"{module}.weight"
        a = tensors[f"{PEFT_PREFIX}{module}.lora_A.{adapter}.weight"]
        b = tensors[f"{PEFT_PREFIX}{module}.lora_B.{adapter}.weight"]
        if weight not in out:
            raise UserError(f"LoRA module {module}: no base weight {weight} in the checkpoint")
        w = out[weight]
        half = b.dtype in (torch.float16, torch.bfloat16)
        delta = (b.float() @ a.float()) if half else b @ a
        delta = (delta.T if fan_in_fan_out else delta) * scaling
        out[weight] = (w + delta.to(b.dtype)).to(w.dtype)
    return out


def checkpoint_lora(meta: dict, path: str) -> dict | None:
    """The LoRA record of a checkpoint's metadata (None: a model without adapters);
    UserError for a checkpoint of a PeftModel saved without one (by an older neuron_tp)."""
    model = meta.get("model") or {}
    record = model.get("lora")
    if record is None and str(model.get("class")).startswith("Peft"):
        raise UserError(
            f"{path}: a checkpoint of {model['class']} without LoRA settings (saved by an "
            "older neuron_tp); use the adapter the run wrote at its end instead: "
            "neuron-tp generate --model BASE --adapter OUTPUT_DIR/adapter"
        )
    return record
