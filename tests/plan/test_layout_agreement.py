"""The planner and ``neuron-tp train --check`` agree on every layout: for a grid of layouts
(world sizes 1-32 with odd ones, tp 1-16 in 1d / 1d + SP / 2d / 3d, pp with both schedules,
cp, ep, ZeRO-1 and LoRA beside them), each with everything pinned, the planner's enumeration
holds the layout exactly when ``train --check`` accepts it, and when both refuse, the
planner's notes carry the reason ``train --check`` prints first. Also the command itself:
``train --check`` exits 0 printing the layout's groups and ranks, or 2 listing every problem,
without a process group or a weight read."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
from transformers import GPT2Config, LlamaConfig

from neuron_tp.cli.args import train_parser
from neuron_tp.job.config import TrainConfig
from neuron_tp.plan import layouts as plan_layouts
from neuron_tp.plan.hardware import get_instance
from neuron_tp.train.check import check_job

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LLAMA = LlamaConfig(
    hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=16,
    num_key_value_heads=16, vocab_size=512, tie_word_embeddings=False,
)  # fmt: skip
GPT2 = GPT2Config(n_embd=256, n_layer=12, n_head=16, vocab_size=512)
SEQ = 64
MICRO, ACCUM = 4, 4


def _grid():
    modes = [("1d", False), ("1d", True), ("2d", False), ("3d", False)]
    pipes = [(1, "1f1b", 1), (2, "1f1b", 1), (3, "1f1b", 1), (2, "interleaved", 2)]
    for world, tp, (mode, sp), pipe, cp in itertools.product(
        (1, 2, 4, 6, 8, 12, 16, 32), (1, 2, 3, 4, 8, 9, 16), modes, pipes, (1, 2)
    ):
        if tp > world:
            continue
        yield world, tp, mode, sp, pipe, cp


def _config(world, tp, mode, sp, pipe, cp, *extra) -> TrainConfig:
    pp, sched, v = pipe
    argv = ["--model", "tiny-llama", "--tp", str(tp), "--tp-mode", mode, "--seq-len", str(SEQ)]
    argv += ["--micro-batch", str(MICRO), "--grad-accum", str(ACCUM), "--pp", str(pp)]
    argv += ["--pp-schedule", sched, "--virtual-stages", str(v), "--cp", str(cp)]
    argv += ["--world-size", str(world), *(["--sequence-parallel"] if sp else []), *extra]
    return TrainConfig.from_args(train_parser().parse_args(argv))


def _planner(config: TrainConfig, world: int, model) -> tuple[bool, list[str]]:
    """(the planner holds this layout, its notes) with every option of it pinned."""
    pins = {
        "tp": config.tp,
        "tp_mode": config.tp_mode,
        "sequence_parallel": config.sequence_parallel,
        "pp": config.pipeline.pp,
        "pp_schedule": config.pipeline.pp_schedule,
        "virtual_stages": config.pipeline.virtual_stages,
        "cp": config.context.cp,
        "micro_batch": config.micro_batch,
        "activation_checkpointing": "none",
    }
    degrees = config.tp * config.pipeline.pp * config.context.cp
    dp = max(1, world // degrees)
    job = plan_layouts.Job(get_instance("trn1.32xlarge"), 1, SEQ, dp * MICRO * ACCUM)
    job = plan_layouts.Job(
        job.instance,
        1,
        SEQ,
        job.global_batch,
        ranks_per_node=world,
        objective=config.preference.objective,
    )
    layouts, notes = plan_layouts.enumerate_layouts(job, pins, model)
    return bool(layouts), notes


def _train_check(config: TrainConfig, model) -> list[str]:
    """What ``train --check`` lists for this layout and model (the model config given)."""
    from neuron_tp.job.layout_rules import job_refusals

    return job_refusals(config, config.check.world_size, model)


@pytest.mark.parametrize(
    "model, objective", [(LLAMA, "lm"), (GPT2, "lm"), (LLAMA, "dpo")], ids=["llama", "gpt2", "dpo"]
)
def test_planner_and_train_check_agree_on_every_layout(model, objective):
    """``objective`` dpo: the layouts preference training runs (fewer: no pp with cp or
    with 2d / 3d)."""
    counts = {"both run": 0, "both refuse": 0}
    for world, tp, mode, sp, pipe, cp in _grid():
        config = _config(world, tp, mode, sp, pipe, cp, "--objective", objective)
        planned, notes = _planner(config, world, model)
        refused = _train_check(config, model)
        where = f"world {world} tp {tp} {mode} sp={sp} pp={pipe} cp={cp}"
        assert planned == (not refused), (where, refused, notes)
        if refused:
            assert any(refused[0] in n for n in notes), (where, refused[0], notes)
        counts["both refuse" if refused else "both run"] += 1
    print(model.model_type, counts)
    assert counts["both run"] > 40 and counts["both refuse"] > 400, counts


def test_check_command_prints_the_layout_or_every_problem(tmp_path, capsys):
    out = str(tmp_path / "out")
    ok = _config(8, 2, "1d", True, (2, "1f1b", 1), 1, "--output-dir", out, "--ep", "2")
    lines: list[str] = []
    assert check_job(ok, lines.append) == 0, lines
    text = "\n".join(lines)
    assert "world 8 = pp 2 x dp 2 x cp 1 x tp 2 (tp 1d, sequence parallel; ep 2" in text
    assert "pp groups: [0, 4], [1, 5], [2, 6], [3, 7]" in text
    assert "rank 5: stage 1 layers 1; data replica 0 of 2; tp shard 1 of 2" in text
    assert not os.path.exists(out)  # nothing written
    bad = _config(16, 4, "2d", True, (2, "interleaved", 3), 2, "--output-dir", "/dev/null/x")
    lines = []
    assert check_job(bad, lines.append) == 2
    problems = [line for line in lines if line.startswith("  - ")]
    assert len(problems) >= 4, lines  # every one of them, not the first
    assert any("--sequence-parallel is a --tp-mode 1d option" in p for p in problems)
    assert any("/dev/null is a file" in p for p in problems)


def test_check_command_exit_status(tmp_path):
    cmd = [sys.executable, "-m", "neuron_tp.cli", "train", "--check", "--world-size", "6"]
    cmd += ["--model", "tiny-llama", "--tp", "4", "--output-dir", str(tmp_path / "o")]
    env = {**os.environ, "PYTHONPATH": REPO}
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "tp=4 does not divide the world size 6; valid tp degrees: [1, 2, 3, 6]" in proc.stdout
