"""The blockwise-attention training runs executed on 2 XLA CPU devices (one launch, see
tests/helpers/xla_dist.py), used by test_blockwise_train.py."""

from __future__ import annotations

import os

from xla_multi_train_cases import run_train

# seq 40: not a multiple of the block (16), padded inside the attention
BLOCKWISE = ["--micro-batch", "2", "--steps", "4", "--save-every", "0", "--seq-len", "40"]
BLOCKWISE += ["--attention", "blockwise", "--attention-block", "16"]
CASES = {"tp2": [], "tp2-sp": ["--sequence-parallel"]}


def on_two(case: str, base: str) -> object:
    return run_train(2, os.path.join(base, case), BLOCKWISE + CASES[case])
