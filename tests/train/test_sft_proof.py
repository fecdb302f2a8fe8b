"""Loss masking proven by training: prompts of random letters (nothing can predict them) with a
learnable completion. The floor is the eval loss those letters force once they are in the loss:
the entropy of the letters times their share of the loss tokens, both counted on the eval
batches themselves. Trained on the completions (the default) the eval loss falls far below that
floor; with ``--loss-on all`` it cannot. Both runs also evaluate at their last step (not a
multiple of ``--eval-every``), and ``metrics.jsonl`` holds that value. One process, the tiny
preset on the CPU: a few seconds."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch

import neuron_tp as ntp
from neuron_tp.cli.args import train_parser
from neuron_tp.hf.packing import IGNORE_INDEX, model_inputs
from neuron_tp.job.data import ByteTokenizer
from neuron_tp.job.sft_data import load_data
from neuron_tp.train.loop import train

LETTERS = "abcdefgh"
SEQ, MICRO, STEPS, EVERY = 64, 4, 30, 20


def _write(path, n: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            prompt = "".join(rng.choice(LETTERS) for _ in range(rng.randint(10, 20)))
            f.write(json.dumps({"prompt": prompt + "=", "completion": "ok"}) + "\n")
    return str(path)


def floor_of(eval_file: str) -> float:
    """Entropy (nats) of the random letters among the eval targets x their share of the loss
    tokens, on the eval batches with ``--loss-on all`` (the tokens the loss averages over)."""
    data = load_data(eval_file, ByteTokenizer(), SEQ, MICRO, loss_on="all", shuffle=False)
    letters = set(ByteTokenizer().encode(LETTERS))
    targets = []
    for _ in range(data.batches_per_epoch):
        labels = model_inputs(data.next_batch())["labels"][:, 1:]
        targets += [int(t) for t in labels[labels != IGNORE_INDEX]]
    counts = Counter(t for t in targets if t in letters)
    n = sum(counts.values())
    entropy = -sum(c / n * math.log(c / n) for c in counts.values())
    return entropy * n / len(targets)


def _run(tmp_path, loss_on: str) -> dict:
    args = train_parser().parse_args(
        [
            *("--device", "cpu", "--model", "tiny-llama", "--seq-len", str(SEQ)),
            *("--micro-batch", str(MICRO), "--steps", str(STEPS), "--lr", "1e-2"),
            *("--warmup-steps", "2", "--log-every", "10", "--save-every", "0"),
            *("--data", str(tmp_path / "train.jsonl"), "--loss-on", loss_on),
            *("--eval-data", str(tmp_path / "eval.jsonl"), "--eval-every", str(EVERY)),
            *("--output-dir", str(tmp_path / loss_on)),
        ]
    )
    return train(args, mesh=ntp.Mesh(1, 0), printer=print)


def test_eval_loss_falls_below_what_random_prompts_allow(tmp_path):
    _write(tmp_path / "train.jsonl", 200, seed=1)
    floor = floor_of(_write(tmp_path / "eval.jsonl", 32, seed=2))
    assert 1.0 < floor < math.log(len(LETTERS))  # most loss tokens are random letters
    final = {}
    for loss_on in ("answers", "all"):
        log = _run(tmp_path, loss_on)["log"]
        evals = [e for e in log if "eval_loss" in e]
        assert [e["step"] for e in evals] == [EVERY, STEPS]  # the last step is evaluated too
        with open(tmp_path / loss_on / "metrics.jsonl") as f:
            last = [json.loads(line) for line in f][-1]
        assert last["step"] == STEPS and last["eval_loss"] == evals[-1]["eval_loss"]
        final[loss_on] = last["eval_loss"]
    print(f"floor {floor:.3f}, eval loss: answers {final['answers']:.4f}, all {final['all']:.4f}")
    assert final["answers"] < floor / 10, "masking on: only the learnable answers are scored"
    assert final["all"] > floor, "--loss-on all scores the random prompt letters too"


def test_floor_is_the_entropy_share(tmp_path):
    """The floor's arithmetic on a file whose counts are known."""
    path = tmp_path / "e.jsonl"
    path.write_text(json.dumps({"prompt": "ab" * 4, "completion": "k"}) + "\n" * 1)
    path.write_text(path.read_text() * 64)
    # per sample: 10 tokens (8 letters, "k", EOS), 9 targets (the first token is never
    # predicted), 7 of them letters: 3 a, 4 b
    p = 3 / 7
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert floor_of(str(path)) == pytest.approx(entropy * 7 / 9, rel=1e-6)


def test_bf16_run_builds_the_packed_mask_in_bf16(tmp_path):
    """Under --bf16 the training step and the evaluation both hand the model a bf16 mask (a
    forward pre-hook records the mask of every forward after the first step)."""
    _write(tmp_path / "train.jsonl", 40, seed=3)
    _write(tmp_path / "eval.jsonl", 24, seed=4)
    seen: list[tuple[bool, torch.dtype]] = []

    def record(module, args, kwargs):
        seen.append((module.training, kwargs["attention_mask"].dtype))

    def on_step(run):
        if run.step == 1:
            run.model.register_forward_pre_hook(record, with_kwargs=True)

    args = train_parser().parse_args(
        [
            *("--device", "cpu", "--model", "tiny-llama", "--seq-len", str(SEQ), "--bf16"),
            *("--micro-batch", "2", "--steps", "3", "--log-every", "1", "--save-every", "0"),
            *("--data", str(tmp_path / "train.jsonl"), "--eval-every", "2"),
            *("--eval-data", str(tmp_path / "eval.jsonl"), "--eval-batches", "1"),
            *("--output-dir", str(tmp_path / "out")),
        ]
    )
    s = train(args, mesh=ntp.Mesh(1, 0), printer=print, on_step=on_step)
    assert all(math.isfinite(e["loss"]) for e in s["log"])
    # steps 2 and 3 (one micro-batch each), an evaluation after each (step 2, the last step)
    assert sorted(set(seen)) == [(False, torch.bfloat16), (True, torch.bfloat16)]
    assert len(seen) == 4
