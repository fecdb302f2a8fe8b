"""The context-parallel training runs executed on XLA CPU devices (one launch per device
count, see tests/helpers/xla_dist.py), used by test_cp_train.py."""

from __future__ import annotations

import os

from xla_multi_train_cases import run_train

# seq 256: each of 2 cp ranks holds 128 tokens (chunks of 64 = one attention block)
CP = ["--micro-batch", "2", "--steps", "4", "--save-every", "0", "--seq-len", "256"]
CP += ["--attention-block", "32"]
CASES = {"cp2": (1, []), "cp2-tp2-sp": (2, ["--sequence-parallel"])}


def on_devices(case: str, base: str) -> object:
    tp, extra = CASES[case]
    out = os.path.join(base, case)
    return run_train(tp, out, [*CP, "--cp", "2", *extra], cp=2)
