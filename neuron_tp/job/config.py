"""The options of a training, generation or serving run as typed, frozen records.

The command-line parsers (:mod:`neuron_tp.cli.args`) stay the one home of option names,
defaults, help and validation; these records are what the rest of the code reads. Each field is
the parser's destination of one option (``--seq-len`` -> ``seq_len``), so ``config.seq_len``
reads like the option it came from. Built once at the entry point::

    config = TrainConfig.from_args(train_parser().parse_args(argv))

Imports nothing beyond the standard library.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TypeVar

_Config = TypeVar("_Config", bound="_CommonConfig")


@dataclass(frozen=True)
class _CommonConfig:
    """Options shared by ``neuron-tp train`` and ``neuron-tp generate``."""

    model: str  # a preset name or a local directory
    tp: int
    device: str  # "xla" or "cpu"
    tokenizer: str | None  # a directory or "bytes"; None: see job.tokenizer.resolve_tokenizer
    seed: int
    xla_cpu_devices: int  # 0: this process is one rank

    @classmethod
    def from_args(cls: type[_Config], args: argparse.Namespace | _Config) -> _Config:
        """The config of parsed options (returned unchanged when already one). A TypeError
        names any option the record lacks or misses, so the two cannot drift apart."""
        if isinstance(args, cls):
            return args
        return cls(**vars(args))

    def option_values(self) -> dict[str, object]:
        """Every option by its command-line name, sorted (``{"--seq-len": 128, ...}``): what
        the ranks of a job must agree on."""
        return {
            "--" + name.replace("_", "-"): getattr(self, name)
            for name in sorted(f.name for f in fields(self))
        }


@dataclass(frozen=True)
class TrainConfig(_CommonConfig):
    """``neuron-tp train`` options (see :func:`~neuron_tp.cli.args.train_parser`)."""

    tp_mode: str  # "1d", "2d" (tp = q*q) or "3d" (tp = q^3)
    sequence_parallel: bool
    data: str  # a .txt/.jsonl/.parquet/.arrow file or a directory of them
    seq_len: int
    loss_on: str  # "answers" (assistant turns / completions) or "all" (instruction data)
    packing: bool  # instruction data: several samples per row (False: padded rows)
    overlong: str  # "truncate" or "drop" a sample longer than seq_len
    data_cache: str | None  # a directory of tokenized rows (neuron_tp.job.data_cache); None: off
    micro_batch: int  # sequences per rank
    grad_accum: int
    steps: int  # optimizer steps (global, counting resumed ones)
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float  # 0: no clipping
    bf16: bool  # bf16 params/compute; fp32 masters + AdamW state (Zero1, sharded over dp)
    reduce_dtype: str  # "param" (sums in the tensors' dtype) or "fp32"
    activation_checkpointing: str  # "none", "full" or "selective" (neuron_tp.hf.recompute)
    log_every: int
    save_every: int  # 0: only at the end
    keep_last: int
    output_dir: str
    resume: str  # "auto", "none" or a checkpoint directory
    tensorboard: bool
    skip_nonfinite: bool
    zero1: bool  # ZeRO-1: AdamW state and fp32 masters sharded over dp (neuron_tp.optim.zero1)
    lora_r: int  # LoRA rank (peft); 0: train the whole model
    lora_alpha: float
    lora_dropout: float
    lora_target_modules: list[str]  # empty: peft's default for the model type
    plan: str  # "none" or "auto" (neuron_tp.plan chooses the layout options)
    global_batch: int  # --plan auto: sequences per optimizer step
    plan_instance: str  # --plan auto: the instance table entry
    eval_data: str | None = None  # evaluated every eval_every steps (neuron_tp.train.evaluate)
    eval_every: int = 0  # 0: no evaluation
    eval_batches: int = 0  # micro-batches per rank per evaluation; 0: the whole eval set
    attention: str = "sdpa"  # or "blockwise" (neuron_tp.hf.attention.use_blockwise_attention)
    attention_block: int = 512  # the blockwise attention's block size
    plan_calibration: str = ""  # --plan auto: measured figures (neuron-tp selftest --calibrate)
    ep: int = 1  # expert-parallel degree (MoE): blocks of ep dp ranks share the experts out

    @property
    def uses_zero1(self) -> bool:
        """The optimizer is a :class:`neuron_tp.optim.zero1.Zero1`: asked for, or the keeper of the
        fp32 master weights of a bf16 model."""
        return self.zero1 or self.bf16

    @property
    def model_dtype(self):
        """The model's parameter and compute dtype (bf16 with ``--bf16``, else fp32); the
        packed rows' attention mask is built in it too."""
        import torch

        return torch.bfloat16 if self.bf16 else torch.float32

    @property
    def mesh_reduce_dtype(self):
        """The mesh's ``reduce_dtype`` (a torch dtype or None) for ``--reduce-dtype``."""
        import torch

        return torch.float32 if self.reduce_dtype == "fp32" else None


@dataclass(frozen=True)
class GenerateConfig(_CommonConfig):
    """``neuron-tp generate`` options (see :func:`~neuron_tp.cli.args.generate_parser`)."""

    prompt: list[str]
    prompts_file: str | None
    max_new_tokens: int
    buckets: list[int]  # prompt length buckets, sorted
    do_sample: bool
    temperature: float
    top_k: int  # 0: no top-k filter
    dtype: str  # "float32" or "bfloat16"
    batch_buckets: list[int]  # batch sizes, sorted; more prompts run in several batches
    stop: list[str]  # stop strings (the text is cut before the first one)
    ignore_eos: bool  # always generate --max-new-tokens (benchmarks)
    adapter: str | None = None  # a PEFT (LoRA) adapter dir merged into --model on load


@dataclass(frozen=True)
class ServeConfig(_CommonConfig):
    """``neuron-tp serve`` options (see :func:`~neuron_tp.cli.args.serve_parser`)."""

    host: str
    port: int
    max_new_tokens: int  # the most a request may ask for (sets the cache length)
    buckets: list[int]  # prompt length buckets, sorted
    batch_buckets: list[int]  # batch sizes, sorted: concurrent requests share a batch
    batch_wait_ms: float  # ignored (continuous batching); kept so existing commands run
    dtype: str  # "float32" or "bfloat16"
    served_model_name: str | None  # None: --model
    warmup: str  # graphs captured before ready: "smallest" shapes or "all" buckets
    adapter: str | None = None  # a PEFT (LoRA) adapter dir merged into --model on load
    prefill_chunk: int = 256  # prompt tokens prefilled per step (longer prompts: several)
    max_queue: int = 256  # requests that may wait; more get 429
    request_timeout_s: float = 600.0  # admission to the last token; then 504 / a stream error
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    api_key: str | None = None  # None: $NEURON_TP_API_KEY, else no key asked

    @property
    def model_name(self) -> str:
        """The model id clients see (``/v1/models``, responses)."""
        return self.served_model_name or self.model

    def generate_config(self) -> GenerateConfig:
        """The equivalent ``neuron-tp generate`` options (for loading the model)."""
        shared = {
            f.name: getattr(self, f.name) for f in fields(GenerateConfig) if hasattr(self, f.name)
        }
        return GenerateConfig(
            **shared,
            prompt=[],
            prompts_file=None,
            do_sample=False,
            temperature=1.0,
            top_k=0,
            stop=[],
            ignore_eos=False,
        )
