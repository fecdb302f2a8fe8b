#!/usr/bin/env python
"""Train a causal LM with TP (+SP) x DP: ``torchrun --nproc_per_node=N scripts/train.py ...``
(see ``--help``). Same options as ``neuron-tp train``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from neuron_tp.cli.entry import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
