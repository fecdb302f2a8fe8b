"""End to end through the shell: ``scripts/compile_and_train.sh 2 ...`` on two CPU ranks
(torchrun, gloo, TP=2), with a stand-in ``neuron_parallel_compile`` that does what the real
tool does to the trial run (sets NEURON_EXTRACT_GRAPHS_ONLY=1, runs the command): the trial
writes nothing, the real run logs a decreasing loss and writes a checkpoint, and
``neuron-tp consolidate`` turns it into a directory transformers loads."""

from __future__ import annotations

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_compile_and_train_script_then_consolidate(tmp_path):
    fake = tmp_path / "bin" / "neuron_parallel_compile"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nexport NEURON_EXTRACT_GRAPHS_ONLY=1\nexec "$@"\n')
    fake.chmod(0o755)
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "OMP_NUM_THREADS": "1",
        "PATH": f"{fake.parent}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
    }
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            os.path.join(REPO, "scripts", "compile_and_train.sh"),
            "2",
            "--device",
            "cpu",
            "--tp",
            "2",
            "--steps",
            "16",
            "--log-every",
            "4",
            "--seq-len",
            "64",
            "--lr",
            "3e-3",
            "--output-dir",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    trial, real = proc.stdout.split("== train:")
    assert "NEURON_EXTRACT_GRAPHS_ONLY" in trial and "step 3/3 traced" in trial
    assert "loss" not in trial
    losses = [float(x) for x in re.findall(r"\| loss ([0-9.]+) \|", real)]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.3, real
    assert os.listdir(out / "checkpoints") == ["step-00000016"]
    assert "resumed" not in real  # the trial left nothing to resume from
    cons = subprocess.run(
        [sys.executable, "-m", "neuron_tp.cli", "consolidate", str(out), str(tmp_path / "hf")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert cons.returncode == 0, cons.stderr
    # a byte-level preset run: no tokenizer files, a generation config derived from the config
    files = ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path / "hf")) == files
