"""LoRA adapters for generation, merged on load: a LoRA run's checkpoint (its record says how,
:mod:`neuron_tp.hf.lora_files`) or a PEFT adapter directory (``--adapter DIR``) on a base
model. The unsharded model is wrapped by peft (adapter weights empty), sharded with its
adapters, the adapters are filled with this rank's slices and folded into the sharded base
weights (:func:`neuron_tp.hf.lora.merge_adapters`): the full model is never built."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..hf.lora_files import read_adapter_config


def peft_wrap(model: nn.Module, config) -> nn.Module:
    """``get_peft_model(model, config)`` with the adapter weights zeros on the CPU (the same on
    every rank): for adapters that are loaded afterwards."""
    from peft import get_peft_model

    from ..hf.lora import materialize_adapters, refuse_parallelized
    from ..job.runtime import BUILD_LOCK

    refuse_parallelized(model)
    # Ranks may be threads of one process: one peft wrap at a time (it draws an init from the
    # global RNG; not low_cpu_mem_usage: peft's meta-init patches a class for the process).
    with BUILD_LOCK:
        wrapped = get_peft_model(model, config)
        materialize_adapters(wrapped)
    return wrapped


def adapter_wrap(adapter_dir: str) -> Callable[[nn.Module], nn.Module]:
    """The wrap of a base model for the adapter in ``adapter_dir`` (before it is sharded)."""
    config = read_adapter_config(adapter_dir)
    return lambda model: peft_wrap(model, config)


def merge_adapter_dir(model: nn.Module, adapter_dir: str) -> nn.Module:
    """Load ``adapter_dir`` into a parallelized PeftModel (each rank its slices) and fold it
    into the base weights; returns the plain, still parallelized, model."""
    from ..hf.lora import load_adapter, merge_adapters

    load_adapter(model, adapter_dir)
    return merge_adapters(model)
