#!/usr/bin/env python
"""Sharded generation with static shapes: ``torchrun --nproc_per_node=TP scripts/generate.py
--tp TP --model DIR --prompt ...`` (see ``--help``). Same options as ``neuron-tp generate``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from neuron_tp.cli.entry import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
