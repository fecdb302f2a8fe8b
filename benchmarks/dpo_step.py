"""DPO step time over SFT step time on the same pairs, for each reference option, and the
reference's memory, side by side in one run of ``neuron-tp train`` (one CPU process, tp 1).

SFT trains on the pairs' chosen completions (``{"prompt", "completion"}``, padded rows of
``--seq-len``, loss on the completion): one row per pair. DPO trains on both rows of each
pair and takes the reference's log-probabilities from a pass before training
(``precompute``), a frozen copy forwarded at each step (``copy``) or, under LoRA, the policy
with its adapters off (``adapters``); LoRA rows compare with SFT under the same adapters. The
model is a Llama (hidden 256, 4 layers) saved to a temporary HF directory. Reported: the
fastest step after ``--warmup`` (the least disturbed by other processes on the CPU; the
median beside it), its ratio to the SFT step of the same
fine-tuning, the reference's bytes as held (the copy's parameters, the stored tensor) and as
``neuron-tp plan`` predicts them.

    .venv/bin/python benchmarks/dpo_step.py [--steps 12 --seq-len 128 --micro-batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUBJECTS = ["cats", "rain", "tea", "maps", "owls", "snow", "jazz", "bread"]
# (name, fine-tuning, objective options)
RUNS = [
    ("SFT", "full", ["--no-packing"]),
    ("DPO precompute", "full", ["--objective", "dpo", "--reference", "precompute"]),
    ("DPO copy", "full", ["--objective", "dpo", "--reference", "copy"]),
    ("SFT", "LoRA", ["--no-packing"]),
    ("DPO adapters", "LoRA", ["--objective", "dpo", "--reference", "adapters"]),
    ("DPO copy", "LoRA", ["--objective", "dpo", "--reference", "copy"]),
]


def _write_data(out: str, pairs: int) -> tuple[str, str]:
    """``pairs.jsonl`` and the SFT rows of their chosen completions (``sft.jsonl``)."""
    with open(f"{out}/pairs.jsonl", "w") as p, open(f"{out}/sft.jsonl", "w") as s:
        for i in range(pairs):
            subject = SUBJECTS[i % len(SUBJECTS)]
            prompt = f"Tell me about {subject}, in a few words (number {i}).\n"
            good = f"{subject} are a fine subject; here is why: " + "yes " * (4 + i % 5)
            bad = "No." + " no" * (i % 3)
            p.write(json.dumps({"prompt": prompt, "chosen": good, "rejected": bad}) + "\n")
            s.write(json.dumps({"prompt": prompt, "completion": good}) + "\n")
    return f"{out}/pairs.jsonl", f"{out}/sft.jsonl"


def _reference_bytes(run) -> int:
    """Bytes of the reference the run holds: the copy's parameters or the stored tensor."""
    if run.reference_model is not None:
        unique = {id(p): p for p in run.reference_model.parameters()}.values()
        return sum(p.numel() * p.element_size() for p in unique)
    if run.reference is not None:
        return run.reference.numel() * run.reference.element_size()
    return 0


def _one(args, model: str, data: dict, options: list[str], lora: bool, out: str) -> dict:
    from neuron_tp.cli.args import train_parser
    from neuron_tp.train.loop import train

    dpo = "--objective" in options
    argv = ["--device", "cpu", "--model", model, "--tokenizer", "bytes", "--tp", "1"]
    argv += ["--data", data["pairs" if dpo else "sft"], "--seq-len", str(args.seq_len)]
    argv += ["--micro-batch", str(args.micro_batch), "--steps", str(args.steps)]
    argv += ["--log-every", "1000", "--save-every", "0", "--output-dir", out, *options]
    argv += ["--lora-r", "16", "--lora-alpha", "32"] if lora else []
    marks: list[float] = []
    runs: list = []

    def on_step(run):
        marks.append(time.perf_counter())
        runs[:] = [run]

    start = time.perf_counter()
    train(train_parser().parse_args(argv), printer=lambda *a, **k: None, on_step=on_step)
    steps = [b - a for a, b in zip(marks, marks[1:], strict=False)][args.warmup :]
    run = runs[0]
    return {
        "ms_step": 1e3 * min(steps),
        "ms_median": 1e3 * statistics.median(steps),
        "before_first_step_s": marks[0] - start,
        "reference_bytes": _reference_bytes(run),
        "pairs": len(run.data.rows["input_ids"]),
        "base_bytes": sum(  # the model without LoRA adapters
            p.numel() * p.element_size()
            for n, p in run.model.named_parameters()
            if "lora_" not in n
        ),
    }


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n} B"


def _predicted(kind: str, params: int, pairs: int) -> int:
    from neuron_tp.plan.predict import reference_bytes

    return reference_bytes(kind, params, pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=257,
        max_position_embeddings=1024,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(f"{tmp}/model")
        pairs, sft = _write_data(tmp, args.pairs)
        for i, (name, tuning, options) in enumerate(RUNS):
            got = _one(args, f"{tmp}/model", {"pairs": pairs, "sft": sft}, options,
                       tuning == "LoRA", f"{tmp}/out-{i}")  # fmt: skip
            rows.append((name, tuning, options, got))
    print(
        f"Llama hidden 256 x 4 layers, 1 CPU process (1 thread), seq {args.seq_len}, "
        f"{args.micro_batch} pairs per step ({args.pairs} pairs); fastest (median) ms/step "
        f"after {args.warmup} steps; DPO / SFT: the ratio to the SFT step of the same fine-tuning "
        "(SFT: one row per pair, the chosen completion)"
    )
    print("| run | fine-tuning | ms/step | DPO / SFT | before step 1 s | reference held | "
          "planner's reference |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    sft_ms = {tuning: got["ms_step"] for name, tuning, _, got in rows if name == "SFT"}
    for name, tuning, options, got in rows:
        ratio = got["ms_step"] / sft_ms[tuning]
        kind = options[options.index("--reference") + 1] if "--reference" in options else ""
        held = predicted = "-"
        if kind:
            held = _size(got["reference_bytes"])
            base = got["base_bytes"] if kind == "copy" else 0
            predicted = _size(_predicted(kind, base, got["pairs"]))
        print(
            f"| {name} | {tuning} | {got['ms_step']:.1f} ({got['ms_median']:.1f}) | {ratio:.2f}x | "
            f"{got['before_first_step_s']:.1f} | {held} | {predicted} |"
        )


if __name__ == "__main__":
    main()
