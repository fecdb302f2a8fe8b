"""Checkpoint behaviour in one process (tp=1 mesh): round trip of model + AdamW + schedule +
RNG, refusal to overwrite, an interrupted save leaves the previous checkpoint as the newest
complete one, keep-last-N, mismatched model and damaged files give clear errors and modify
nothing, consolidate refuses a non-empty target; the CLI reports errors with exit status 2."""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

import neuron_tp as ntp
from neuron_tp import checkpoint
from neuron_tp.cli import main as cli_main
from neuron_tp.train.loop import WarmupCosine, make_optimizer
from neuron_tp.train.presets import build_model

MESH = ntp.Mesh(1, 0)


def _trained(seed=0, steps=2):
    model = build_model("tiny-llama", 257, seed)
    opt = make_optimizer(model, 1e-3, 0.1, torch.device("cpu"))
    sched = WarmupCosine(opt, 1e-3, 1e-4, 2, 10)
    ids = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(seed))
    for _ in range(steps):
        sched.apply()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_round_trip_and_rng(tmp_path):
    model, opt, sched = _trained()
    torch.manual_seed(11)
    random.seed(12)
    path = checkpoint.save(str(tmp_path), model, opt, sched, step=2, mesh=MESH,
                           data_state={"position": 7}, keep_last=3)
    expect_torch, expect_py = torch.rand(3), random.random()
    assert os.path.basename(path) == "step-00000002" and checkpoint.latest(str(tmp_path)) == path
    files = sorted(os.listdir(path))
    assert files == ["meta.json", "rng-rank00000.json", "rng-rank00000.safetensors",
                     "shard-tp00000.safetensors"]
    meta = json.loads(open(os.path.join(path, "meta.json")).read())
    assert meta["mesh"]["tp"] == 1 and meta["model"]["config"]["model_type"] == "llama"
    assert set(meta["params"]) == set(_params(model))

    other, opt2, sched2 = _trained(seed=1, steps=1)
    meta = checkpoint.load(path, other, opt2, sched2, mesh=MESH)
    assert meta["step"] == 2 and meta["data_state"] == {"position": 7}
    for n, p in other.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n]), n
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt2.state[p][key],
                               opt.state[dict(model.named_parameters())[n]][key])
    assert sched2.step_count == sched.step_count == 2
    assert torch.equal(torch.rand(3), expect_torch) and random.random() == expect_py


def test_refusals_interrupted_save_and_keep_last(tmp_path, monkeypatch):
    model, opt, sched = _trained()
    root = str(tmp_path / "ck")
    first = checkpoint.save(root, model, opt, sched, step=1, mesh=MESH, keep_last=2)
    with pytest.raises(ValueError, match="already exists"):
        checkpoint.save(root, model, opt, sched, step=1, mesh=MESH)
    before = open(os.path.join(first, "shard-tp00000.safetensors"), "rb").read()

    def killed(*a):  # the job dies after writing every file, before the rename
        raise KeyboardInterrupt
    monkeypatch.setattr(checkpoint.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(root, model, opt, sched, step=2, mesh=MESH)
    monkeypatch.undo()
    assert os.path.isdir(os.path.join(root, ".tmp-step-00000002"))
    assert checkpoint.latest(root) == first
    assert open(os.path.join(first, "shard-tp00000.safetensors"), "rb").read() == before
    for step in (2, 3, 4):  # the leftover temporary directory of step 2 is replaced
        checkpoint.save(root, model, opt, sched, step=step, mesh=MESH, keep_last=2)
    assert sorted(os.listdir(root)) == ["step-00000003", "step-00000004"]


def test_mismatch_and_damaged_files_modify_nothing(tmp_path):
    model, opt, sched = _trained()
    path = checkpoint.save(str(tmp_path), model, opt, sched, step=5, mesh=MESH)
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=160,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    wrong = tf.AutoModelForCausalLM.from_config(cfg)
    before = _params(wrong)
    with pytest.raises(ValueError, match="does not match the model"):
        checkpoint.load(path, wrong, mesh=MESH)
    assert all(torch.equal(p, before[n]) for n, p in wrong.named_parameters())

    fresh, opt2, _ = _trained(seed=3, steps=1)
    before = _params(fresh)
    shard = os.path.join(path, "shard-tp00000.safetensors")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) // 2])  # truncated file
    with pytest.raises(ValueError, match="shard|unreadable|missing"):
        checkpoint.load(path, fresh, opt2, mesh=MESH)
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())
    with pytest.raises(ValueError, match="not a neuron_tp checkpoint"):
        checkpoint.load(str(tmp_path / "nothing"), fresh, mesh=MESH)
    open(os.path.join(path, "meta.json"), "w").write("{broken")
    with pytest.raises(ValueError, match="unreadable checkpoint metadata"):
        checkpoint.read_meta(path)


def test_consolidate_cli_refuses_non_empty_target(tmp_path, capsys):
    model, opt, sched = _trained()
    checkpoint.save(str(tmp_path / "run" / "checkpoints"), model, opt, sched, step=3, mesh=MESH)
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    assert cli_main(["consolidate", str(tmp_path / "run"), str(target)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert os.listdir(target) == ["keep.txt"]
    assert cli_main(["consolidate", str(tmp_path / "nope"), str(tmp_path / "o2")]) == 2
    assert cli_main(["consolidate", str(tmp_path / "run"), str(tmp_path / "o3")]) == 0
    assert sorted(os.listdir(tmp_path / "o3")) == ["config.json", "model.safetensors"]
    import transformers as tf
    loaded = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "o3"))
    ids = torch.arange(12).view(2, 6)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits,
                              atol=1e-6)
    assert cli_main(["bogus"]) == 2
