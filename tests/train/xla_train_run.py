"""Run by tests/train/test_train_xla.py in a fresh process: train the tiny preset on the XLA
CPU device and print (as JSON) the compile / host-transfer counters after every step, the
logged losses, the checkpoints written and the graph hashes in the persistent XLA cache."""

import json
import os
import sys

out_dir, cache_dir = sys.argv[1], sys.argv[2]
os.environ["XLA_PERSISTENT_CACHE_PATH"] = cache_dir
os.environ["XLA_PERSISTENT_CACHE_READ_ONLY"] = "0"

from neuron_tp.backend.graphs import graph_counters  # noqa: E402
from neuron_tp.cli.args import train_parser  # noqa: E402
from neuron_tp.train.loop import train  # noqa: E402

args = train_parser().parse_args(
    [
        "--device",
        "xla",
        "--steps",
        "20",
        "--log-every",
        "5",
        "--save-every",
        "10",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--grad-accum",
        "2",
        "--output-dir",
        out_dir,
        "--warmup-steps",
        "3",
        "--min-lr",
        "0",
        "--lr",
        "3e-3",
    ]
)
per_step = []
summary = train(args, on_step=lambda run: per_step.append({"step": run.step, **graph_counters()}))
print(
    "JSON"
    + json.dumps(
        {
            "per_step": per_step,
            "log": summary["log"],
            "checkpoints": summary["checkpoints"],
            "graphs": sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else [],
            "compiles": summary["compiles"],
        }
    )
)
