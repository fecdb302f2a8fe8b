"""The context-parallel training runs executed on XLA CPU devices (one launch of 4 devices, see
tests/helpers/xla_dist.py), used by test_cp_train.py: cp 4 with LoRA, and packed
prompt/completion rows at cp 2 x tp 2 with SP and ZeRO-1; and the long-context recipe's command
line (examples/long-context/README.md: cp 2 x tp 2 with SP, ZeRO-1, blockwise attention, long
documents), read from that page (run on gloo ranks)."""

from __future__ import annotations

import os
import shlex

from xla_multi_train_cases import run_train

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE = os.path.join(REPO, "examples", "long-context", "README.md")
SFT_DATA = os.path.join(REPO, "examples", "sft", "prompt_completion.jsonl")

# seq 256: each of 2 cp ranks holds 128 tokens (chunks of 64 = one attention block)
CP = ["--micro-batch", "2", "--steps", "4", "--save-every", "0", "--seq-len", "256"]
CP += ["--attention-block", "32"]


def recipe_options() -> list[str]:
    """The train options of the recipe's XLA CPU command (without ``--xla-cpu-devices`` and
    ``--output-dir``; data paths made absolute), and its device count first."""
    with open(RECIPE) as f:
        lines = [line for line in f if line.startswith("neuron-tp train ")]
    assert len(lines) == 1, f"{RECIPE}: expected one `neuron-tp train` line, got {lines}"
    words = shlex.split(lines[0])[2:]
    out, devices, i = [], 0, 0
    while i < len(words):
        w, v = words[i], words[i + 1] if i + 1 < len(words) else None
        if w == "--xla-cpu-devices":
            devices, i = int(v), i + 2
        elif w == "--output-dir":
            i += 2
        elif w == "--data":
            out += [w, os.path.join(REPO, v)]
            i += 2
        else:
            out.append(w)
            i += 1
    return [str(devices), *out]


# packed prompt/completion rows at cp 2 x tp 2 (test_cp_train.py's gloo PACKED runs, without
# eval): one attention block per chunk, a small step graph (XLA:CPU ends a collective whose
# peer thread is still compiling after 10 s: the 2 busy cores make big compiles diverge)
# ZeRO-1 with its state cut over the 2 cp ranks (the recipe's layout)
PACKED = [*CP, "--cp", "2", "--sequence-parallel", "--data", SFT_DATA, "--steps", "2"]
PACKED += ["--seq-len", "128", "--attention-block", "32", "--zero1"]

LORA = ["--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules", "q_proj,v_proj,down_proj"]
# a ring of 4: chunks of 32 tokens (one attention block), 3 hops per layer
CP4_LORA = [*CP, "--cp", "4", *LORA]


def on_devices(case: str, base: str) -> object:
    if case == "packed":
        return run_train(2, os.path.join(base, "xla-packed"), PACKED, cp=2)
    assert case == "cp4-lora", case
    # its own output dir: a gloo run of the same options writes (and would resume) its own
    return run_train(1, os.path.join(base, f"xla-{case}"), CP4_LORA, cp=4)
