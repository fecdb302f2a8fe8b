"""The layer-level example (scripts/demo_tiny_gpt.py) trains: TP=2 + SP on two gloo ranks."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_tiny_gpt_loss_goes_down():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(ROOT / "scripts" / "demo_tiny_gpt.py"),
            "--tp",
            "2",
            "--sequence-parallel",
            "--steps",
            "10",
            "--hidden",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out.stdout)]
    assert len(losses) == 3, out.stdout  # steps 1, 5, 10
    assert losses[-1] < losses[0] - 0.5, losses
