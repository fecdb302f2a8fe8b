"""Persistent buffers through training checkpoints: a tiny GLM-4-MoE whose routers'
``e_score_correction_bias`` is not the default (and moves during the run, as an aux-loss-free
balancing rule would move it) trained at tp=2 on gloo ranks: the run cut at step 2 and resumed
has the uninterrupted run's losses; ``neuron-tp consolidate`` writes the bias, plain
transformers loads the model with it and its logits equal the sharded model's; generation from
the run directory (the checkpoint loaded into a model built from the config) gets it too."""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from moe_archs import build_moe  # noqa: E402
from neuron_tp.cli.args import train_parser  # noqa: E402

IDS = torch.tensor([[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]])
BIAS = "e_score_correction_bias"


def _args(model_dir: str, out: str, *extra: str):
    return train_parser().parse_args(
        ["--model", model_dir, "--tokenizer", "bytes", "--device", "cpu", "--tp", "2"]
        + ["--seq-len", "16", "--micro-batch", "1", "--steps", "4", "--lr", "1e-2"]
        + ["--warmup-steps", "1", "--log-every", "1", "--save-every", "2", "--output-dir", out]
        + list(extra)
    )


def _bump(run) -> None:
    """Move every router's correction bias after each step (same on every rank)."""
    for mod in run.model.modules():
        b = getattr(mod, BIAS, None)
        if isinstance(b, torch.Tensor):
            b.add_(torch.linspace(-0.3, 0.3, b.numel()).roll(run.step))


def _runs(model_dir: str, tmp: str) -> None:
    from neuron_tp.cli.args import generate_parser
    from neuron_tp.hf import full_logits
    from neuron_tp.infer.load import load_for_generation
    from neuron_tp.train.loop import train

    mesh = ntp.init_mesh(tp=2)
    quiet = lambda *a, **k: None  # noqa: E731
    final = {}

    def keep(run) -> None:
        _bump(run)
        final["model"] = run.model

    ref = train(_args(model_dir, f"{tmp}/ref"), mesh, printer=quiet, on_step=_bump)
    train(_args(model_dir, f"{tmp}/cut"), mesh, stop_at=2, printer=quiet, on_step=_bump)
    resumed = train(
        _args(model_dir, f"{tmp}/cut", "--resume", "auto"), mesh, printer=quiet, on_step=keep
    )
    model = final["model"].eval()
    with torch.no_grad(), full_logits(model):
        logits = model(IDS).logits[..., : model.config.vocab_size]
    gen = generate_parser().parse_args(["--device", "cpu", "--model", f"{tmp}/cut"])
    loaded, _ = load_for_generation(gen, mesh)
    with torch.no_grad():
        loaded_logits = loaded(IDS).logits[..., : model.config.vocab_size]
    biases = [b.tolist() for n, b in model.named_buffers() if n.endswith(BIAS)]
    if mesh.rank == 0:
        res = {
            "ref": {e["step"]: e["loss"] for e in ref["log"]},
            "resumed": {e["step"]: e["loss"] for e in resumed["log"]},
            "logits": logits.tolist(),
            "loaded_logits": loaded_logits.tolist(),
            "biases": biases,
        }
        with open(f"{tmp}/res.json", "w") as f:
            json.dump(res, f)


def test_correction_bias_survives_resume_and_consolidate(tmp_path):
    from neuron_tp.checkpoint.merge import consolidate

    start = build_moe("glm4_moe", vocab_size=257)
    start.save_pretrained(tmp_path / "model")
    gloo_dist.run(_runs, str(tmp_path / "model"), str(tmp_path), world_size=2)
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["resumed"] == {k: v for k, v in res["ref"].items() if int(k) > 2}, res
    out = consolidate(str(tmp_path / "cut"), str(tmp_path / "cons"))
    plain = tf.AutoModelForCausalLM.from_pretrained(out).eval()
    got = [b.tolist() for n, b in plain.named_buffers() if n.endswith(BIAS)]
    assert got == res["biases"]
    initial = [b.tolist() for n, b in start.named_buffers() if n.endswith(BIAS)]
    assert got != initial  # the bias moved during the run
    with torch.no_grad():
        logits = plain(IDS).logits
    want = torch.tensor(res["logits"])
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(res["loaded_logits"]), want, rtol=1e-4, atol=1e-4)
