"""Training on gloo ranks vs an independent single-process reference (plain transformers +
torch AdamW/LambdaLR/clip_grad_norm_): TP=2 with and without SP on 2 ranks, TP2 x DP2 with
SP and gradient accumulation on 4 ranks; kill-and-resume equality; resume at another tp
degree (tp2 x dp2 -> tp4); tp=2 checkpoints loaded into the unsharded model and consolidated
into a directory plain transformers loads with the same logits; neuron_tp.blocks checkpoints
(packed QKV segments) resharded to tp=1."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from neuron_tp import checkpoint  # noqa: E402
from neuron_tp.train.loop import train  # noqa: E402
from reference_train import reference_run  # noqa: E402
from train_cpu import losses as _losses  # noqa: E402
from train_cpu import quiet as _quiet  # noqa: E402
from train_cpu import train_args as _args  # noqa: E402


def _two_ranks(tmp: str) -> None:
    from transformers import AutoModelForCausalLM

    from neuron_tp.hf import full_logits
    from neuron_tp.job.presets import build_model

    mesh = ntp.init_mesh(tp=2)
    res, runs = {}, {}
    base = ["--tp", "2", "--micro-batch", "2", "--steps", "16"]
    for name, extra in (("tp2", []), ("tp2_sp", ["--sequence-parallel"])):
        s = train(
            _args(f"{tmp}/{name}", *base, "--save-every", "8", *extra),
            mesh,
            printer=_quiet,
            on_step=lambda run, name=name: runs.__setitem__(name, run),
        )
        res[name] = {
            "loss": _losses(s),
            "norm": [e["grad_norm"] for e in s["log"]],
            "ckpts": s["checkpoints"],
        }
    # "Kill" after the step-8 checkpoint, then resume (auto) in a new run.
    first = train(
        _args(f"{tmp}/killed", *base, "--save-every", "8"), mesh, stop_at=8, printer=_quiet
    )
    again = train(_args(f"{tmp}/killed", *base, "--save-every", "8"), mesh, printer=_quiet)
    res["killed"] = {
        "first": _losses(first),
        "resumed": _losses(again),
        "resumed_steps": [e["step"] for e in again["log"]],
    }

    # The trained tp=2 model's full logits vs the unsharded model loaded from its checkpoint
    # (resharded from the files) and vs the consolidated directory read by transformers.
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(3))
    model = runs["tp2"].model.eval()
    with full_logits(model), torch.no_grad():
        sharded = model(input_ids=ids).logits
    final = res["tp2"]["ckpts"][-1]
    local = ntp.Mesh(1, 0)
    if mesh.rank == 0:
        plain = build_model("tiny-llama", 257, seed=123)
        before = {n: p.clone() for n, p in plain.named_parameters()}
        meta = checkpoint.load(final, plain, mesh=local, restore_rng=False)
        changed = sum(not torch.equal(before[n], p) for n, p in plain.named_parameters())
        with torch.no_grad():
            unsharded = plain.eval()(input_ids=ids).logits
        out = checkpoint.consolidate(f"{tmp}/tp2", f"{tmp}/consolidated")  # picks the newest
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            consolidated = hf(input_ids=ids).logits
        res["load_tp1"] = {
            "step": meta["step"],
            "changed": changed,
            "n_params": len(before),
            "diff_unsharded": (unsharded - sharded).abs().max().item(),
            "diff_consolidated": (consolidated - sharded).abs().max().item(),
        }

    # A damaged shard that only rank 1 reads: both ranks raise (no rank left waiting) and
    # the model is untouched.
    if mesh.rank == 0:
        import shutil

        shutil.copytree(final, f"{tmp}/damaged")
        shard = f"{tmp}/damaged/shard-tp00001.safetensors"
        data = open(shard, "rb").read()
        open(shard, "wb").write(data[:100])
    torch.distributed.barrier()
    before = {n: p.clone() for n, p in model.named_parameters()}
    try:
        checkpoint.load(f"{tmp}/damaged", model, mesh=mesh)
        res[f"damaged_{mesh.rank}"] = "loaded"
    except ValueError as e:
        res[f"damaged_{mesh.rank}"] = str(e)
    res[f"damaged_untouched_{mesh.rank}"] = all(
        torch.equal(before[n], p) for n, p in model.named_parameters()
    )
    with open(f"{tmp}/damaged-{mesh.rank}.json", "w") as fh:
        json.dump({k: v for k, v in res.items() if k.startswith("damaged")}, fh)

    # neuron_tp.blocks (not HF): packed QKV segments and padded-free shards, reshard to tp=1.
    torch.manual_seed(5)
    block = ntp.blocks.TransformerBlock(12, 2, ffn=22, mesh=mesh, sequence_parallel=True)
    checkpoint.save(f"{tmp}/blocks", block, step=1, mesh=mesh)
    full = ntp.gather_params(block, mesh)
    if mesh.rank == 0:
        torch.manual_seed(6)
        single = ntp.blocks.TransformerBlock(12, 2, ffn=22, mesh=local)
        checkpoint.load(f"{tmp}/blocks/step-00000001", single, mesh=local)
        res["blocks_diff"] = max(
            (full[n] - p).abs().max().item() for n, p in single.named_parameters()
        )
        with open(f"{tmp}/two.json", "w") as fh:
            json.dump(res, fh)


def test_two_ranks_tp2_vs_reference_resume_reshard_consolidate(tmp_path):
    gloo_dist.run(_two_ranks, str(tmp_path), world_size=2)
    res = json.loads((tmp_path / "two.json").read_text())
    ref_loss, ref_norm = reference_run(
        _args(tmp_path / "ref", "--micro-batch", "2", "--steps", "16"), 2
    )
    for name in ("tp2", "tp2_sp"):
        assert res[name]["loss"] == pytest.approx(ref_loss, rel=2e-4, abs=2e-4), name
        assert res[name]["norm"] == pytest.approx(ref_norm, rel=2e-3, abs=2e-4), name
    assert ref_loss[-1] < ref_loss[0] - 0.5  # and it learns
    k = res["killed"]
    assert k["first"] == res["tp2"]["loss"][:8]
    assert k["resumed_steps"] == list(range(9, 17))
    assert k["resumed"] == res["tp2"]["loss"][8:]  # bit-identical continuation on CPU
    assert res["load_tp1"]["step"] == 16
    assert res["load_tp1"]["changed"] == res["load_tp1"]["n_params"]
    assert res["load_tp1"]["diff_unsharded"] < 1e-4
    assert res["load_tp1"]["diff_consolidated"] < 1e-4
    assert res["blocks_diff"] == 0.0
    r1 = json.loads((tmp_path / "damaged-1.json").read_text())
    assert "shard-tp00001" in r1["damaged_1"] and r1["damaged_untouched_1"]
    assert "failed on rank 1" in res["damaged_0"] and "shard-tp00001" in res["damaged_0"]
    assert res["damaged_untouched_0"]


def _four_ranks(tmp: str) -> None:
    mesh = ntp.init_mesh(tp=2)  # tp2 x dp2
    common = ["--sequence-parallel", "--grad-accum", "2", "--steps", "12", "--save-every", "6"]
    a = train(_args(f"{tmp}/a", "--tp", "2", "--micro-batch", "1", *common), mesh, printer=_quiet)
    mesh4 = ntp.init_mesh(tp=4)  # the same job restarted at another tp degree (dp 1)
    b = train(
        _args(
            f"{tmp}/b", "--tp", "4", "--micro-batch", "2", *common, "--resume", a["checkpoints"][0]
        ),
        mesh4,
        printer=_quiet,
    )
    if mesh.rank == 0:
        with open(f"{tmp}/four.json", "w") as fh:
            json.dump(
                {
                    "a": _losses(a),
                    "b": _losses(b),
                    "b_steps": [e["step"] for e in b["log"]],
                    "a_ckpts": a["checkpoints"],
                },
                fh,
            )


def test_four_ranks_tp2_dp2_vs_reference_and_resume_at_tp4(tmp_path):
    gloo_dist.run(_four_ranks, str(tmp_path), world_size=4)
    res = json.loads((tmp_path / "four.json").read_text())
    ref_loss, _ = reference_run(
        _args(tmp_path / "ref", "--micro-batch", "1", "--steps", "12", "--grad-accum", "2"), 2
    )
    assert res["a"] == pytest.approx(ref_loss, rel=2e-4, abs=2e-4)
    assert ref_loss[-1] < ref_loss[0] - 0.5
    assert res["b_steps"] == list(range(7, 13))
    assert res["b"] == pytest.approx(res["a"][6:], rel=2e-4, abs=2e-4)
    assert [os.path.basename(c) for c in res["a_ckpts"]] == ["step-00000006", "step-00000012"]
