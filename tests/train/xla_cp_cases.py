"""The context-parallel training runs executed on XLA CPU devices (one launch per device
count, see tests/helpers/xla_dist.py), used by test_cp_train.py: the long-context recipe's
command line (examples/long-context/README.md: cp 2 x tp 2 with SP, ZeRO-1, blockwise
attention, long documents), read from that page; and packed prompt/completion rows."""

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
PACKED = [*CP, "--cp", "2", "--sequence-parallel", "--data", SFT_DATA, "--steps", "2"]
PACKED += ["--seq-len", "128", "--attention-block", "32"]


# the recipe's layout on the XLA devices at seq 512 and 3 steps (the gloo tier runs its exact
# command): chunks of one attention block, a step graph a quarter the size (see PACKED)
RECIPE_XLA = ["--seq-len", "512", "--steps", "3", "--save-every", "0"]


def on_devices(case: str, base: str) -> object:
    if case == "packed":
        return run_train(2, os.path.join(base, "xla-packed"), PACKED, cp=2)
    assert case == "recipe", case
    _, *options = recipe_options()
    # its own output dir: the gloo run of the same case writes (and would resume) {base}/recipe
    return run_train(2, os.path.join(base, f"xla-{case}"), [*options, *RECIPE_XLA], cp=2)
