"""Run by tests/train/test_train_guard.py in a fresh process: --skip-nonfinite on the XLA CPU
device, NaN gradients at step 3; prints the logged losses / skipped counts and the
compile counter after every step (JSON)."""

import json
import sys

import torch

from neuron_tp.backend.graphs import graph_counters
from neuron_tp.cli.args import train_parser
from neuron_tp.train.loop import train

out_dir, argv = sys.argv[1], sys.argv[2:]
per_step, scale = [], {}


def on_step(run):
    """From step 2 on, the gradient of one weight is multiplied by an uploaded factor: 1,
    except NaN at step 3 (data, not a graph change: the step graph stays the same)."""
    per_step.append(graph_counters()["compiles"])
    value = {1: 1.0, 2: float("nan"), 3: 1.0}.get(run.step)
    if value is not None:
        scale["t"] = torch.full((1,), value).to(run.device)
    if run.step == 1:
        p = run.model.get_parameter("model.layers.0.mlp.down_proj.weight")
        p.register_hook(lambda g: g * scale["t"])


summary = train(
    train_parser().parse_args([*argv, "--output-dir", out_dir]),
    on_step=on_step,
    printer=lambda *a, **k: None,
)
print(
    "JSON"
    + json.dumps(
        {"log": summary["log"], "compiles": per_step, "checkpoints": summary["checkpoints"]}
    )
)
