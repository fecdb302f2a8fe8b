"""End to end with a tiny Mixtral directory written by plain transformers (experts stored per
expert, router aux loss on): the training job at tp=2 on gloo ranks (each rank reads its expert
slices), ``neuron-tp consolidate`` to a directory plain transformers loads with the trained
weights, and generation from the run and from the consolidated directory (same tokens)."""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers as tf

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "helpers"))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from neuron_tp.cli.args import generate_parser, train_parser  # noqa: E402

PROMPTS = [[72, 101, 108], [84, 104, 101, 32]]


def _train_tp2(model_dir: str, out: str) -> None:
    from neuron_tp.train.loop import train

    mesh = ntp.init_mesh(tp=2)
    args = train_parser().parse_args(
        ["--model", model_dir, "--tokenizer", "bytes", "--device", "cpu", "--tp", "2"]
        + ["--seq-len", "32", "--micro-batch", "2", "--steps", "4", "--lr", "1e-2"]
        + ["--warmup-steps", "1", "--output-dir", out]
    )
    log = train(args, mesh, printer=lambda *a, **k: None)["log"]
    if mesh.rank == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump([r["loss"] for r in log if "loss" in r], f)


def _generate(path: str, *extra: str) -> list[list[int]]:
    from neuron_tp.infer.load import load_for_generation
    from neuron_tp.infer.static_generator import generate

    args = generate_parser().parse_args(["--device", "cpu", "--model", path, *extra])
    model, _ = load_for_generation(args, ntp.Mesh(1, 0))
    return generate(model, PROMPTS, 6, [16])


def test_train_consolidate_generate_tiny_mixtral(tmp_path):
    from neuron_tp.checkpoint.merge import consolidate

    cfg = tf.MixtralConfig(
        vocab_size=257,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
    )
    torch.manual_seed(0)
    start = tf.AutoModelForCausalLM.from_config(cfg)
    start.save_pretrained(tmp_path / "model")
    run = tmp_path / "run"
    gloo_dist.run(_train_tp2, str(tmp_path / "model"), str(run), world_size=2)
    losses = json.loads((run / "losses.json").read_text())
    assert len(losses) >= 1 and all(x == x for x in losses), losses
    out = consolidate(str(run), str(tmp_path / "cons"))
    trained = tf.AutoModelForCausalLM.from_pretrained(out)
    moved = trained.model.layers[0].mlp.experts.gate_up_proj
    assert not torch.equal(moved, start.model.layers[0].mlp.experts.gate_up_proj), "not trained"
    assert _generate(str(run)) == _generate(out, "--tokenizer", "bytes")
