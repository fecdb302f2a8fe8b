"""The training loop on instruction data (prompt/completion, the loss on the completions,
padded rows) at tp 2 on gloo ranks vs plain transformers on the unsharded model trained on the
same batches (tests/helpers/reference_train.py)."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
from neuron_tp.cli.args import train_parser  # noqa: E402
from neuron_tp.train.loop import train  # noqa: E402
from reference_train import reference_run  # noqa: E402


def _data(path) -> str:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(40):
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 12)))
            f.write(json.dumps({"prompt": f"reverse {word}:", "completion": word[::-1]}) + "\n")
    return str(path)


def _args(tmp, *extra):
    return train_parser().parse_args(
        [
            *("--device", "cpu", "--seq-len", "32", "--micro-batch", "2", "--steps", "5"),
            *("--log-every", "1", "--warmup-steps", "2", "--lr", "3e-3"),
            *("--data", f"{tmp}/pc.jsonl", "--output-dir", f"{tmp}/out", *extra),
        ]
    )


def _ranks(tmp: str) -> None:
    import neuron_tp as ntp

    mesh = ntp.init_mesh(tp=2)
    s = train(_args(tmp, "--tp", "2", "--no-packing"), mesh, printer=print)
    if mesh.rank == 0:
        with open(f"{tmp}/losses.json", "w") as f:
            json.dump([e["loss"] for e in s["log"]], f)


def test_tp2_instruction_losses_equal_plain_transformers(tmp_path):
    _data(tmp_path / "pc.jsonl")
    gloo_dist.run(_ranks, str(tmp_path), world_size=2)
    losses = json.load(open(tmp_path / "losses.json"))
    ref, _ = reference_run(_args(tmp_path, "--no-packing"), 2)
    assert losses == pytest.approx(ref, rel=2e-4, abs=2e-4)
