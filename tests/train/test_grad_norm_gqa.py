"""The global gradient norm counts every distinct element once when kv heads are replicated
(GQA/MQA with tp > num_key_value_heads): tp 4 and 8 with 1 and 2 kv heads against the
unsharded model's norm, and a tp=4 training run with clipping active against the independent
reference step by step (gloo ranks)."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from reference_train import reference_run  # noqa: E402


def _norms(tp: int, heads: int) -> None:
    import transformers as tf

    mesh = ntp.init_mesh(tp=tp)
    for kv in (1, 2):
        cfg = tf.LlamaConfig(
            vocab_size=37,
            hidden_size=4 * heads,
            intermediate_size=2 * tp,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=kv,
        )
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        ref = tf.AutoModelForCausalLM.from_config(cfg)
        model = ntp.parallelize(copy.deepcopy(ref), mesh, parallel_loss=True)
        ids = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(1))
        ref(input_ids=ids, labels=ids).loss.backward()
        model(input_ids=ids, labels=ids).loss.backward()
        want = torch.sqrt(sum(p.grad.pow(2).sum() for p in ref.parameters()))
        got = ntp.global_grad_norm(model, mesh)
        torch.testing.assert_close(
            got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"tp={tp} kv={kv} grad norm: {m}"
        )
        clipped = ntp.clip_grad_norm_(model, 0.5 * want.item(), mesh)
        torch.testing.assert_close(clipped, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(
            ntp.global_grad_norm(model, mesh), 0.5 * want, rtol=1e-4, atol=1e-6
        )


@pytest.mark.parametrize("tp,heads", [(4, 4), (8, 8)])
def test_grad_norm_with_replicated_kv_heads(tp, heads):
    gloo_dist.run(_norms, tp, heads, world_size=tp)


def _train_tp4(out: str, result: str) -> None:
    from neuron_tp.cli.args import train_parser
    from neuron_tp.train.loop import train

    mesh = ntp.init_mesh(tp=4)  # tiny-llama: 4 heads, 2 kv heads -> each kv head on 2 ranks
    args = train_parser().parse_args(
        [
            "--device",
            "cpu",
            "--tp",
            "4",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--steps",
            "8",
            "--log-every",
            "1",
            "--lr",
            "3e-3",
            "--warmup-steps",
            "2",
            "--max-grad-norm",
            "0.5",
            "--output-dir",
            out,
            "--save-every",
            "0",
        ]
    )
    s = train(args, mesh, printer=lambda *a, **k: None)
    if mesh.rank == 0:
        torch.save(
            {
                "loss": [e["loss"] for e in s["log"]],
                "norm": [e["grad_norm"] for e in s["log"]],
                "args": args,
            },
            result,
        )


def test_training_with_clipping_tp4_matches_reference(tmp_path):
    gloo_dist.run(_train_tp4, str(tmp_path / "run"), str(tmp_path / "res.pt"), world_size=4)
    res = torch.load(tmp_path / "res.pt", weights_only=False)
    losses, norms = reference_run(res["args"], global_micro_batch=2)
    assert min(norms) > 0.5, f"clipping must be active at every step: norms {norms}"
    torch.testing.assert_close(res["norm"], norms, rtol=2e-3, atol=1e-5)
    torch.testing.assert_close(res["loss"], losses, rtol=2e-4, atol=2e-4)
