"""The models of a training run: the policy (built from ``--seed`` or loaded, with LoRA
adapters when asked, sharded over the mesh) and, for ``--reference copy``, a frozen copy of
the initial model built by the same path (:func:`reference_copy`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from ..hf.attention import use_blockwise_attention
from ..hf.context_parallel import context_parallel
from ..job.config import TrainConfig
from ..job.presets import build_model, is_preset
from ..job.runtime import BUILD_LOCK
from ..parallel.mesh import Mesh
from ..parallel.sharding import move_to
from . import peft_wrap as lora


def sharded_model(config: TrainConfig, mesh: Mesh, vocab: int, cut: Callable | None = None):
    """The model of this rank, built (a preset, from ``--seed``) or loaded (each rank reads
    its slices), with LoRA adapters when asked, sharded over ``mesh``, then ``cut`` (in place:
    a pipeline stage; for a loaded model before any weight is read); a failure on any rank,
    or replicas that differ, raises on every rank."""
    from .. import hf
    from ..parallel import agreement

    dtype = torch.bfloat16 if config.bf16 else torch.float32
    model: Any = None
    error: Exception | None = None
    try:
        # Seeding and drawing the global RNG (shared by a process's threads) under one lock:
        # a thread seeding while another draws its init would give the ranks other weights.
        with BUILD_LOCK:
            torch.manual_seed(config.seed)
            # presets: built whole, then sharded; a local HF directory: from_pretrained (any
            # tp_mode) reads only this rank's slices / blocks of every tensor
            if is_preset(config.model):
                model = build_model(config.model, vocab, config.seed, dtype)
                if config.lora.r:  # adapters from --seed, then sharded
                    model = lora.wrap(model, config)
        if is_preset(config.model):
            hf.parallelize(
                model,
                mesh,
                sequence_parallel=config.sequence_parallel,
                parallel_loss=mesh.tp_size > 1,
            )
            if cut is not None:  # built whole: the same weights as at pp 1
                cut(model)
        else:
            model = hf.from_pretrained(
                config.model,
                mesh,
                sequence_parallel=config.sequence_parallel,
                parallel_loss=mesh.tp_size > 1,
                torch_dtype=dtype,
                wrap=seeded_lora_wrap(config) if config.lora.r else None,
                cut=cut,
            )
        if config.lora.r:
            lora.frozen_check(model)
    except Exception as e:  # noqa: BLE001 - re-raised on this rank by the check below
        error = e
    # Same shard on data-parallel replicas, same replicated parameters everywhere.
    agreement.check_model_replicas(model, mesh, error=error, what="neuron-tp train")
    return model


def seeded_lora_wrap(config: TrainConfig):
    """``wrap`` for ``from_pretrained``: LoRA adapters from ``--seed`` (under the build lock:
    ranks may be threads sharing the global RNG)."""

    def wrap(model):
        with BUILD_LOCK:
            return lora.wrap(model, config)

    return wrap


def attention(model, config: TrainConfig, mesh: Mesh) -> None:
    """The attention of ``--attention`` and ``--cp`` (ring attention; cp 1: unchanged)."""
    if config.attention == "blockwise":
        use_blockwise_attention(model, config.attention_block)
    context_parallel(model, mesh, config.attention_block)


def reference_copy(config: TrainConfig, mesh: Mesh, vocab: int, device) -> torch.nn.Module:
    """DPO's ``--reference copy``: the initial model (from ``--seed`` or ``--model``, never a
    checkpoint: on resume too it is the model training started from) without adapters,
    sharded as the policy, on ``device``, frozen (no gradient, eval mode; no optimizer holds
    it)."""
    base = replace(config, lora=replace(config.lora, r=0))
    model = sharded_model(base, mesh, vocab)
    attention(model, config, mesh)
    move_to(model, device).eval()
    model.requires_grad_(False)
    return model
