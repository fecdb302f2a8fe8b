"""The training loop on instruction data (prompt/completion, the loss on the completions,
padded rows) vs plain transformers on the unsharded model trained on the same batches with the
step's loss the mean over all its loss tokens (tests/helpers/reference_train.py): tp2 x dp2
with gradient accumulation on 4 gloo ranks, tp 2 on 2 XLA CPU devices."""

from __future__ import annotations

import json
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import xla_multi_train_cases as cases  # noqa: E402

import gloo_dist  # noqa: E402
import xla_dist  # noqa: E402
from neuron_tp.cli.args import train_parser  # noqa: E402
from neuron_tp.train.loop import train  # noqa: E402
from reference_train import reference_run  # noqa: E402


def _data(path) -> str:
    """Prompts of random length, completions of random length: micro-batches hold different
    numbers of loss tokens (a mean of per-micro-batch means would differ from the step's)."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(40):
            word = "".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 14)))
            f.write(json.dumps({"prompt": f"reverse {word}:", "completion": word[::-1]}) + "\n")
    return str(path)


SFT = ["--seq-len", "32", "--no-packing", "--steps", "4", "--save-every", "0"]


def _args(tmp, *extra):
    return train_parser().parse_args(
        [
            *("--device", "cpu", "--log-every", "1", "--warmup-steps", "2", "--lr", "3e-3"),
            *("--data", f"{tmp}/pc.jsonl", "--output-dir", f"{tmp}/out", *SFT, *extra),
        ]
    )


def _ranks(tmp: str, extra: list[str]) -> None:
    import neuron_tp as ntp

    mesh = ntp.init_mesh(tp=2)
    s = train(_args(tmp, "--tp", "2", *extra), mesh, printer=print)
    if mesh.rank == 0:
        with open(f"{tmp}/losses.json", "w") as f:
            json.dump([e["loss"] for e in s["log"]], f)


def test_tp2_dp2_instruction_losses_equal_plain_transformers(tmp_path):
    _data(tmp_path / "pc.jsonl")
    extra = ["--micro-batch", "1", "--grad-accum", "2"]
    gloo_dist.run(_ranks, str(tmp_path), extra, world_size=4)
    losses = json.load(open(tmp_path / "losses.json"))
    ref, _ = reference_run(_args(tmp_path, *extra), 2)
    assert losses == pytest.approx(ref, rel=2e-4, abs=2e-4)


def test_tp2_instruction_on_two_xla_devices(tmp_path):
    data = _data(tmp_path / "pc.jsonl")
    extra = [*SFT, "--data", data, "--micro-batch", "2"]
    res = xla_dist.run(cases.run_train, 2, str(tmp_path / "xla"), extra, None, devices=2)
    ref, _ = reference_run(cases.args_for(str(tmp_path / "ref"), "--tp", "2", *extra), 2)
    assert [e["loss"] for e in res[0]["log"]] == pytest.approx(ref, rel=2e-4, abs=2e-4)
    assert res[0]["per_step"][-1]["compiles"] == res[0]["per_step"][1]["compiles"]  # one graph
