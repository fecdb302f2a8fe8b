"""``neuron-tp train``'s options: :class:`TrainConfig` and its nested groups (optimizer,
evaluation, checkpoints, LoRA, preference tuning, the planner, pipeline and context
parallelism, ``--check``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .common_config import REPO_DATA, CommonConfig
from .options import group, names, non_negative, opt
from .options import positive as pos


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its schedule (warm-up, cosine decay to ``min_lr``), clipping."""

    lr: float = opt("--lr", 1e-3, type=pos(float))
    min_lr: float = opt("--min-lr", 1e-4, type=non_negative(float))
    warmup_steps: int = opt("--warmup-steps", 10, type=non_negative(int))
    weight_decay: float = opt("--weight-decay", 0.01, type=non_negative(float))
    max_grad_norm: float = opt(  # 0: no clipping
        "--max-grad-norm",
        1.0,
        "clip by the global norm across all shards (0 = off)",
        type=non_negative(float),
    )


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation during training (:mod:`neuron_tp.train.evaluate`)."""

    data: str | None = opt(
        "--eval-data",
        None,
        "a data file or directory (as --data) evaluated every --eval-every steps and at the "
        "last step (eval loss and perplexity over the label tokens, fixed order, split over "
        "the dp ranks)",
    )
    every: int = opt(  # 0: no evaluation
        "--eval-every", 0, "steps between evaluations", type=non_negative(int)
    )
    batches: int = opt(  # 0: the whole eval set
        "--eval-batches",
        0,
        "micro-batches per rank in one evaluation (0: the whole --eval-data)",
        type=non_negative(int),
    )


@dataclass(frozen=True)
class CheckpointConfig:
    """Where the run writes (checkpoints, metrics, adapters) and what it resumes from
    (:mod:`neuron_tp.train.checkpoint_policy`)."""

    save_every: int = opt("--save-every", 0, "0 = only at the end", type=non_negative(int))
    keep_last: int = opt(
        "--keep-last",
        2,
        "keep the newest N checkpoints (and always the one resumed from)",
        type=pos(int),
    )
    output_dir: str = opt("--output-dir", "runs/train")
    resume: str = opt(
        "--resume", "auto", "auto (newest complete checkpoint in --output-dir), none, or a path"
    )


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (peft) trained instead of the whole model (:mod:`.train.peft_wrap`)."""

    r: int = opt(  # 0: train the whole model
        "--lora-r",
        0,
        "train LoRA adapters of this rank (peft) instead of the whole model; 0: off",
        type=non_negative(int),
    )
    alpha: float = opt("--lora-alpha", 16.0, "LoRA scaling alpha", type=pos(float))
    dropout: float = opt("--lora-dropout", 0.0, type=non_negative(float))
    target_modules: list[str] = opt(  # empty: peft's default for the model type
        "--lora-target-modules",
        [],
        "comma-separated module names to adapt (default: peft's for the model type)",
        type=names,
    )


@dataclass(frozen=True)
class PreferenceConfig:
    """Preference optimisation on ``{prompt, chosen, rejected}`` pairs
    (:mod:`neuron_tp.train.preference`); ``lm``: next-token loss as before."""

    objective: str = opt(
        "--objective",
        "lm",
        "lm: next-token loss on the data (SFT / pre-training); dpo or orpo: preference "
        "optimisation on pairs {'prompt', 'chosen', 'rejected'} (strings or messages)",
        choices=("lm", "dpo", "orpo"),
    )
    beta: float = opt(
        "--beta",
        0.1,
        "DPO's beta (KL strength) or ORPO's lambda (odds-ratio weight)",
        type=pos(float),
    )
    dpo_loss: str = opt(
        "--dpo-loss",
        "sigmoid",
        "DPO loss: sigmoid (the paper's, with --label-smoothing: conservative DPO), ipo "
        "(on mean token log-probabilities) or hinge",
        choices=("sigmoid", "ipo", "hinge"),
    )
    label_smoothing: float = opt(
        "--label-smoothing",
        0.0,
        "DPO sigmoid loss: probability that a pair's preference is flipped (0 <= x < 0.5)",
        type=non_negative(float),
    )
    reference: str = opt(
        "--reference",
        "auto",
        "DPO's reference log-probabilities (the initial model's): adapters (the base model "
        "with the --lora-r adapters disabled, at each step), copy (a frozen sharded copy of "
        "the initial model forwarded at each step: no pass, no file), precompute (one pass "
        "over the pairs before training, stored in --output-dir); auto: adapters under "
        "--lora-r without --pp, else precompute",
        choices=("auto", "adapters", "copy", "precompute"),
    )


@dataclass(frozen=True)
class PlanConfig:
    """``--plan auto``: the planner chooses the layout options (:mod:`neuron_tp.plan.auto`)."""

    mode: str = opt(
        "--plan",
        "none",
        "auto: run the layout `neuron-tp plan` recommends for this job (sets --tp, "
        "--tp-mode, --sequence-parallel, --micro-batch, --grad-accum, "
        "--activation-checkpointing, --zero1, --attention, and --pp (with --pp-schedule, "
        "--virtual-stages) / --cp where the job's other options allow them; needs "
        "--global-batch)",
        choices=("none", "auto"),
    )
    global_batch: int = opt(
        "--global-batch",
        0,
        "--plan auto: sequences per optimizer step over all data-parallel ranks",
        type=non_negative(int),
    )
    instance: str = opt(
        "--plan-instance",
        "trn1.32xlarge",
        "--plan auto: the instance type whose NeuronCore figures the plan uses",
    )
    calibration: str = opt(
        "--plan-calibration",
        "",
        "--plan auto: measured figures from `neuron-tp selftest --calibrate PATH` instead "
        "of the instance's datasheet figures",
        metavar="PATH",
    )


# The parallel axes beyond tp x dp that ``--plan auto`` may choose (each only where the job's
# other options allow it: :func:`neuron_tp.plan.auto.excluded_axes`).
AUTO_PLAN_AXES: frozenset[str] = frozenset({"pp", "cp"})


@dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism: the decoder layers cut into ``pp`` stages (pp outermost in the
    mesh: world = pp x dp x cp x tp); a step's micro-batches (--micro-batch x --grad-accum)
    flow through them."""

    TITLE: ClassVar[str] = "pipeline parallelism"

    pp: int = opt(
        "--pp",
        1,
        "pipeline stages: the decoder layers split into --pp consecutive stages (the "
        "embedding on the first, the final norm, LM head and loss on the last); must "
        "divide the layers and the world size / (tp x cp), and --grad-accum >= --pp",
        type=pos(int),
    )
    pp_schedule: str = opt(
        "--pp-schedule",
        "1f1b",
        "1f1b (bubble (pp-1)/(m+pp-1) of a step of m micro-batches, up to pp micro-batches "
        "of activations held on the first stage) or interleaved (--virtual-stages chunks "
        "per rank: bubble (pp-1)/(v*m+pp-1), a little more activation memory)",
        choices=("1f1b", "interleaved"),
    )
    virtual_stages: int = opt(
        "--virtual-stages",
        1,
        "--pp-schedule interleaved: model chunks per pipeline rank (layers divisible by "
        "pp x virtual-stages)",
        type=pos(int),
        metavar="V",
    )


@dataclass(frozen=True)
class ContextConfig:
    """Context parallelism: each rank of a ``cp`` ring holds 1/cp of every sequence; keys and
    values travel around the ring (blockwise attention)."""

    TITLE: ClassVar[str] = "context parallelism"

    cp: int = opt(
        "--cp",
        1,
        "context-parallel degree: every sequence split over --cp ranks (2 x cp load-"
        "balanced chunks: --seq-len divisible by 2 x cp), K/V passed around the ring; "
        "parameters replicated over cp (gradients reduce over dp x cp); Llama-family "
        "models (ring attention over blockwise tiles); packed rows masked by segment ids",
        type=pos(int),
    )


@dataclass(frozen=True)
class CheckConfig:
    """``train --check``: validate the whole job and print its layout, then exit."""

    TITLE: ClassVar[str] = "checking a job before launching it"

    enabled: bool = opt(
        "--check",
        False,
        "validate the job without starting a process group or reading weights (model "
        "config, layout, data, output dir), print the layout (ranks per axis, groups, what "
        "each rank holds) and exit 0, or 2 with every problem",
        action="store_true",
    )
    world_size: int = opt(
        "--world-size",
        0,
        "--check: the job's world size (default: $WORLD_SIZE, else pp x cp x tp x ep)",
        type=non_negative(int),
        metavar="N",
    )


@dataclass(frozen=True)
class TrainConfig(CommonConfig):
    """``neuron-tp train`` options (dp = world size / tp)."""

    PROG: ClassVar[str] = "neuron-tp train"
    DESCRIPTION: ClassVar[str] = "Train a causal LM with TP (+SP) x DP."

    tp_mode: str = opt(  # "1d", "2d" (tp = q*q) or "3d" (tp = q^3)
        "--tp-mode",
        "1d",
        "layout of the tp ranks: 1d (Megatron), 2d (a q x q grid, --tp = q*q, Llama-"
        "family untied models) or 3d (a q x q x q cube, --tp = q^3); 2d/3d split the "
        "micro-batch over the grid (--micro-batch divisible by q / q*q)",
        choices=("1d", "2d", "3d"),
    )
    sequence_parallel: bool = opt("--sequence-parallel", False, "1d only", action="store_true")
    ep: int = opt(  # expert-parallel degree (MoE): blocks of ep dp ranks share the experts out
        "--ep",
        1,
        "expert parallelism for mixture-of-experts models: each block of --ep data-"
        "parallel ranks shares the experts out (E/ep each, still split over tp) and sends "
        "tokens to them by all-to-all; divides dp (world / tp) and the expert count",
        type=pos(int),
    )
    data: str = opt(
        "--data",
        REPO_DATA,
        "a .txt/.jsonl/.parquet/.arrow file or a directory of them; jsonl lines (table "
        "rows): {'text'}, {'messages'} or {'prompt', 'completion'} (one format per file; "
        "tables need pip install neuron_tp[data])",
    )
    seq_len: int = opt("--seq-len", 128, type=pos(int))
    loss_on: str = opt(  # "answers" (assistant turns / completions) or "all"
        "--loss-on",
        "answers",
        "instruction data: the loss on the assistant turns / completions only (answers) "
        "or on every token (all); raw text always trains on every token",
        choices=("answers", "all"),
    )
    packing: bool = opt(  # instruction data: several samples per row (False: padded rows)
        "--no-packing",
        True,
        "instruction data: one sample per row, padded (default: several samples per "
        "row, positions restarting and no attention across them)",
        dest="packing",
        action="store_false",
    )
    overlong: str = opt(
        "--overlong",
        "truncate",
        "instruction data: a sample longer than --seq-len is cut to its first --seq-len "
        "tokens (truncate) or left out (drop); counted in the log",
        choices=("truncate", "drop"),
    )
    data_cache: str | None = opt(  # tokenized rows (neuron_tp.job.data_cache); None: off
        "--data-cache",
        None,
        "tokenize --data once into DIR (memory-mapped rows keyed by the files, tokenizer "
        "and options; one writer per node, the other ranks read it); default: no cache",
        metavar="DIR",
    )
    micro_batch: int = opt("--micro-batch", 4, "sequences per rank", type=pos(int))
    grad_accum: int = opt("--grad-accum", 1, type=pos(int))
    steps: int = opt(  # global, counting resumed ones
        "--steps", 100, "optimizer steps", type=pos(int)
    )
    optim: OptimConfig = group(OptimConfig)
    bf16: bool = opt(  # fp32 masters + AdamW state (Zero1, sharded over dp)
        "--bf16",
        False,
        "bfloat16 parameters and compute, fp32 master weights and AdamW state (kept by "
        "ZeRO-1, sharded over the data-parallel ranks: the same bytes on the wire as the "
        "gradient all-reduce)",
        action="store_true",
    )
    reduce_dtype: str = opt(
        "--reduce-dtype",
        "param",
        "dtype every cross-rank sum accumulates in (row-parallel outputs, sequence-"
        "parallel reduce-scatters, gradients): the tensors' own (param) or fp32 (more "
        "accurate for --bf16, twice the bytes of those collectives)",
        choices=["param", "fp32"],
    )
    activation_checkpointing: str = opt(  # neuron_tp.hf.recompute
        "--activation-checkpointing",
        "none",
        "recompute activations in backward: every decoder layer (full) or the attention "
        "core only (selective); saves activation memory for extra compute",
        choices=["none", "full", "selective"],
    )
    attention: str = opt(  # neuron_tp.hf.attention.use_blockwise_attention
        "--attention",
        "sdpa",
        "attention core: the model's sdpa, or blockwise (online softmax over "
        "--attention-block key/value blocks, recomputed per query block in backward: memory "
        "O(seq * block) per head instead of the [heads, seq, seq] scores)",
        choices=["sdpa", "blockwise"],
    )
    attention_block: int = opt("--attention-block", 512, type=pos(int), metavar="N")
    log_every: int = opt("--log-every", 10, type=pos(int))
    eval: EvalConfig = group(EvalConfig)
    checkpoint: CheckpointConfig = group(CheckpointConfig)
    tensorboard: bool = opt(
        "--tensorboard", False, "write TensorBoard scalars", action="store_true"
    )
    skip_nonfinite: bool = opt(
        "--skip-nonfinite",
        False,
        "skip (undo on the device) the update of a step whose loss or grad "
        "norm is NaN/inf instead of stopping the run; holds a copy of params "
        "and optimizer states during each step",
        action="store_true",
    )
    zero1: bool = opt(  # AdamW state and fp32 masters sharded over dp (neuron_tp.optim.zero1)
        "--zero1",
        False,
        "ZeRO-1: shard the AdamW state and fp32 master weights over the data-parallel "
        "ranks (reduce-scatter + all-gather instead of the gradient all-reduce); at dp=1 "
        "plain AdamW with fp32 master weights; checkpoints load with or without it "
        "(always on with --bf16)",
        action="store_true",
    )
    lora: LoraConfig = group(LoraConfig)
    preference: PreferenceConfig = group(PreferenceConfig)
    pipeline: PipelineConfig = group(PipelineConfig)
    context: ContextConfig = group(ContextConfig)
    plan: PlanConfig = group(PlanConfig)
    check: CheckConfig = group(CheckConfig)

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
