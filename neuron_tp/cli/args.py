"""Command-line options of ``scripts/train.py`` / ``neuron-tp train``, of
``scripts/generate.py`` / ``neuron-tp generate`` and of ``neuron-tp serve`` (names are a
contract with the deployment templates). Imports nothing beyond the standard library."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

REPO_DATA = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data"
)


def positive(kind: type) -> Callable[[str], int | float]:
    """An argparse ``type``: ``kind(text)``, refused unless > 0 (also ``neuron-tp plan``'s)."""

    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    return parse


def _buckets(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"buckets must be comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"buckets must be positive integers, got {text!r}")
    return sorted(set(values))


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="tiny-llama",
        help="local HF model directory or a built-in preset (tiny-llama, tiny-gpt2, tiny-qwen3)",
    )
    p.add_argument("--tp", type=positive(int), default=1, help="tensor-parallel degree")
    p.add_argument(
        "--device",
        choices=("xla", "cpu"),
        default="xla",
        help="xla: NeuronCore when present, else the XLA CPU device; cpu: eager torch",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local HF tokenizer directory, or 'bytes' (byte-level); default: the --model "
        "directory's tokenizer, a checkpoint's recorded one, byte-level for a preset",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--xla-cpu-devices",
        type=_non_negative(int),
        default=0,
        metavar="N",
        help="run N ranks as XLA CPU devices of this one process (no torchrun): "
        "the graphs and collectives of an N-NeuronCore job, on a laptop",
    )


def train_parser() -> argparse.ArgumentParser:
    """Parser of the training script (dp = world size / tp)."""
    p = argparse.ArgumentParser(
        prog="neuron-tp train",
        allow_abbrev=False,
        description="Train a causal LM with TP (+SP) x DP.",
    )
    _common(p)
    p.add_argument(
        "--tp-mode",
        choices=("1d", "2d", "3d"),
        default="1d",
        help="layout of the tp ranks: 1d (Megatron), 2d (a q x q grid, --tp = q*q, Llama-"
        "family untied models) or 3d (a q x q x q cube, --tp = q^3); 2d/3d split the "
        "micro-batch over the grid (--micro-batch divisible by q / q*q)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="1d only")
    p.add_argument(
        "--ep",
        type=positive(int),
        default=1,
        help="expert parallelism for mixture-of-experts models: each block of --ep data-"
        "parallel ranks shares the experts out (E/ep each, still split over tp) and sends "
        "tokens to them by all-to-all; divides dp (world / tp) and the expert count",
    )
    p.add_argument(
        "--data",
        default=REPO_DATA,
        help="a .txt/.jsonl/.parquet/.arrow file or a directory of them; jsonl lines (table "
        "rows): {'text'}, {'messages'} or {'prompt', 'completion'} (one format per file; "
        "tables need pip install neuron_tp[data])",
    )
    p.add_argument("--seq-len", type=positive(int), default=128)
    p.add_argument(
        "--loss-on",
        choices=("answers", "all"),
        default="answers",
        help="instruction data: the loss on the assistant turns / completions only (answers) "
        "or on every token (all); raw text always trains on every token",
    )
    p.add_argument(
        "--no-packing",
        dest="packing",
        action="store_false",
        help="instruction data: one sample per row, padded (default: several samples per "
        "row, positions restarting and no attention across them)",
    )
    p.add_argument(
        "--overlong",
        choices=("truncate", "drop"),
        default="truncate",
        help="instruction data: a sample longer than --seq-len is cut to its first --seq-len "
        "tokens (truncate) or left out (drop); counted in the log",
    )
    p.add_argument(
        "--data-cache",
        default=None,
        metavar="DIR",
        help="tokenize --data once into DIR (memory-mapped rows keyed by the files, tokenizer "
        "and options; one writer per node, the other ranks read it); default: no cache",
    )
    p.add_argument("--micro-batch", type=positive(int), default=4, help="sequences per rank")
    p.add_argument("--grad-accum", type=positive(int), default=1)
    p.add_argument("--steps", type=positive(int), default=100, help="optimizer steps")
    p.add_argument("--lr", type=positive(float), default=1e-3)
    p.add_argument("--min-lr", type=_non_negative(float), default=1e-4)
    p.add_argument("--warmup-steps", type=_non_negative(int), default=10)
    p.add_argument("--weight-decay", type=_non_negative(float), default=0.01)
    p.add_argument(
        "--max-grad-norm",
        type=_non_negative(float),
        default=1.0,
        help="clip by the global norm across all shards (0 = off)",
    )
    p.add_argument(
        "--bf16",
        action="store_true",
        help="bfloat16 parameters and compute, fp32 master weights and AdamW state (kept by "
        "ZeRO-1, sharded over the data-parallel ranks: the same bytes on the wire as the "
        "gradient all-reduce)",
    )
    p.add_argument(
        "--reduce-dtype",
        choices=["param", "fp32"],
        default="param",
        help="dtype every cross-rank sum accumulates in (row-parallel outputs, sequence-"
        "parallel reduce-scatters, gradients): the tensors' own (param) or fp32 (more "
        "accurate for --bf16, twice the bytes of those collectives)",
    )
    p.add_argument(
        "--activation-checkpointing",
        choices=["none", "full", "selective"],
        default="none",
        help="recompute activations in backward: every decoder layer (full) or the attention "
        "core only (selective); saves activation memory for extra compute",
    )
    p.add_argument(
        "--attention",
        choices=["sdpa", "blockwise"],
        default="sdpa",
        help="attention core: the model's sdpa, or blockwise (online softmax over "
        "--attention-block key/value blocks, recomputed per query block in backward: memory "
        "O(seq * block) per head instead of the [heads, seq, seq] scores)",
    )
    p.add_argument("--attention-block", type=positive(int), default=512, metavar="N")
    p.add_argument("--log-every", type=positive(int), default=10)
    p.add_argument(
        "--eval-data",
        default=None,
        help="a data file or directory (as --data) evaluated every --eval-every steps and at the "
        "last step (eval loss and perplexity over the label tokens, fixed order, split over "
        "the dp ranks)",
    )
    p.add_argument(
        "--eval-every", type=_non_negative(int), default=0, help="steps between evaluations"
    )
    p.add_argument(
        "--eval-batches",
        type=_non_negative(int),
        default=0,
        help="micro-batches per rank in one evaluation (0: the whole --eval-data)",
    )
    p.add_argument("--save-every", type=_non_negative(int), default=0, help="0 = only at the end")
    p.add_argument(
        "--keep-last",
        type=positive(int),
        default=2,
        help="keep the newest N checkpoints (and always the one resumed from)",
    )
    p.add_argument("--output-dir", default="runs/train")
    p.add_argument(
        "--resume",
        default="auto",
        help="auto (newest complete checkpoint in --output-dir), none, or a path",
    )
    p.add_argument("--tensorboard", action="store_true", help="write TensorBoard scalars")
    p.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip (undo on the device) the update of a step whose loss or grad "
        "norm is NaN/inf instead of stopping the run; holds a copy of params "
        "and optimizer states during each step",
    )
    p.add_argument(
        "--zero1",
        action="store_true",
        help="ZeRO-1: shard the AdamW state and fp32 master weights over the data-parallel "
        "ranks (reduce-scatter + all-gather instead of the gradient all-reduce); at dp=1 "
        "plain AdamW with fp32 master weights; checkpoints load with or without it "
        "(always on with --bf16)",
    )
    p.add_argument(
        "--lora-r",
        type=_non_negative(int),
        default=0,
        help="train LoRA adapters of this rank (peft) instead of the whole model; 0: off",
    )
    p.add_argument("--lora-alpha", type=positive(float), default=16.0, help="LoRA scaling alpha")
    p.add_argument("--lora-dropout", type=_non_negative(float), default=0.0)
    p.add_argument(
        "--lora-target-modules",
        type=lambda t: [m for m in t.split(",") if m.strip()],
        default=[],
        help="comma-separated module names to adapt (default: peft's for the model type)",
    )
    p.add_argument(
        "--plan",
        choices=("none", "auto"),
        default="none",
        help="auto: run the layout `neuron-tp plan` recommends for this job (sets --tp, "
        "--tp-mode, --sequence-parallel, --micro-batch, --grad-accum, "
        "--activation-checkpointing, --zero1; needs --global-batch)",
    )
    p.add_argument(
        "--global-batch",
        type=_non_negative(int),
        default=0,
        help="--plan auto: sequences per optimizer step over all data-parallel ranks",
    )
    p.add_argument(
        "--plan-instance",
        default="trn1.32xlarge",
        help="--plan auto: the instance type whose NeuronCore figures the plan uses",
    )
    p.add_argument(
        "--plan-calibration",
        default="",
        metavar="PATH",
        help="--plan auto: measured figures from `neuron-tp selftest --calibrate PATH` instead "
        "of the instance's datasheet figures",
    )
    return p


def _shapes(p: argparse.ArgumentParser, batching: str) -> None:
    """The model-loading and graph-shape options of generate and serve: length and batch
    buckets, dtype, adapter."""
    p.add_argument(
        "--buckets",
        type=_buckets,
        default=_buckets("32,128,512"),
        help="comma-separated prompt length buckets",
    )
    p.add_argument(
        "--batch-buckets",
        type=_buckets,
        default=_buckets("1,2,4,8"),
        help=f"comma-separated batch sizes (graph shapes); {batching}",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--adapter",
        default=None,
        metavar="DIR",
        help="a PEFT LoRA adapter directory, merged into --model (a HF directory or preset) "
        "on load; a LoRA run's checkpoint needs none (its adapters are merged)",
    )


def generate_parser() -> argparse.ArgumentParser:
    """Parser of the generation script (tp ranks launched by torchrun)."""
    p = argparse.ArgumentParser(
        prog="neuron-tp generate",
        allow_abbrev=False,
        description="Sharded generation with static shapes.",
    )
    _common(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="one prompt per line")
    p.add_argument("--max-new-tokens", type=positive(int), default=32)
    _shapes(p, "more prompts run in several batches")
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=positive(float), default=1.0)
    p.add_argument("--top-k", type=_non_negative(int), default=0, help="0 = no top-k filter")
    p.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable): text ends before it"
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at EOS (always --max-new-tokens)"
    )
    return p


def serve_parser() -> argparse.ArgumentParser:
    """Parser of ``neuron-tp serve`` (tp ranks launched by torchrun; rank 0 serves HTTP)."""
    p = argparse.ArgumentParser(
        prog="neuron-tp serve",
        allow_abbrev=False,
        description="An OpenAI-compatible HTTP server for sharded generation.",
    )
    _common(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=_non_negative(int), default=8000, help="HTTP port")
    p.add_argument(
        "--max-new-tokens",
        type=positive(int),
        default=256,
        help="the largest max_tokens a request may ask for (sets the KV cache length)",
    )
    _shapes(
        p,
        "the largest is the number of decode slots (requests generating at once); decode "
        "graphs exist for each",
    )
    p.add_argument(
        "--prefill-chunk",
        type=positive(int),
        default=256,
        help="prompt tokens prefilled per step (capped to the largest --buckets): a longer "
        "prompt is prefilled over several steps, between the running requests' tokens",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=_non_negative(float),
        default=5.0,
        help="ignored: a request joins the running batch at the next step (kept so existing "
        "commands run)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="the model id clients use (default: --model)"
    )
    p.add_argument(
        "--warmup",
        choices=("smallest", "all"),
        default="smallest",
        help="graphs captured (compiled) before /ready: the smallest batch and prompt shape, "
        "or every batch x prompt bucket (no compile while serving, except for new top_k)",
    )
    p.add_argument(
        "--max-queue",
        type=positive(int),
        default=256,
        help="requests that may wait to run; more get 429 with Retry-After",
    )
    p.add_argument(
        "--request-timeout-s",
        type=positive(float),
        default=600.0,
        help="a request not finished this long after it arrived is cancelled (504, or an "
        "error event ending its stream)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=positive(int),
        default=4 * 1024 * 1024,
        help="larger request bodies get 413 (default 4 MiB)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="every path but /health, /ready and /metrics needs 'Authorization: Bearer KEY' "
        "(else 401); default: $NEURON_TP_API_KEY, unset = no key",
    )
    return p
