"""Checkpoint behaviour in one process (tp=1 mesh): round trip of model + AdamW + schedule +
RNG, refusal to overwrite, an interrupted save leaves the previous checkpoint as the newest
complete one, keep-last-N, mismatched model and damaged files give clear errors and modify
nothing, consolidate refuses a non-empty target; the CLI reports errors with exit status 2.
Integrity: a damaged tensor is refused by load and consolidate naming file and tensor, a
diverged (non-finite) model is never saved or consolidated, consolidate refuses an impossible
target before reading any shard, --keep-last spares protected checkpoints, a bad scheduler or
RNG state changes nothing; the output-dir lock and the resume plan on their own; a ZeRO-1
optimizer's own shard file round trip, and a damaged or missing one refused."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

import neuron_tp as ntp
from neuron_tp import checkpoint
from neuron_tp.cli.entry import main as cli_main
from neuron_tp.job.presets import build_model
from neuron_tp.optim.adamw import WarmupCosine, make_optimizer

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
    path = checkpoint.save(
        str(tmp_path), model, opt, sched, step=2, mesh=MESH, data_state={"position": 7}, keep_last=3
    )
    expect_torch, expect_py = torch.rand(3), random.random()
    assert os.path.basename(path) == "step-00000002" and checkpoint.latest(str(tmp_path)) == path
    files = sorted(os.listdir(path))
    assert files == [
        "meta.json",
        "rng-rank00000.json",
        "rng-rank00000.safetensors",
        "shard-tp00000.safetensors",
    ]
    meta = json.loads(open(os.path.join(path, "meta.json")).read())
    assert meta["mesh"]["tp"] == 1 and meta["model"]["config"]["model_type"] == "llama"
    assert set(meta["params"]) == set(_params(model))

    other, opt2, sched2 = _trained(seed=1, steps=1)
    meta = checkpoint.load(path, other, opt2, sched2, mesh=MESH)
    assert meta["step"] == 2 and meta["data_state"] == {"position": 7}
    for n, p in other.named_parameters():
        assert torch.equal(p, dict(model.named_parameters())[n]), n
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(
                opt2.state[p][key], opt.state[dict(model.named_parameters())[n]][key]
            )
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

    monkeypatch.setattr(os, "replace", killed)
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

    cfg = tf.LlamaConfig(
        vocab_size=257,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
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
    # a checkpoint saved without a tokenizer: config, a generation config derived from it
    files = ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(os.listdir(tmp_path / "o3")) == files
    import transformers as tf

    loaded = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "o3"))
    ids = torch.arange(12).view(2, 6)
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)
    assert cli_main(["bogus"]) == 2


def _damage(shard: str, key: str) -> None:
    """Flip one bit inside tensor ``key``'s bytes (the header stays valid)."""
    data = bytearray(open(shard, "rb").read())
    n = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + n])[key]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))


def _rng_now():
    return torch.get_rng_state(), random.getstate()


def test_checksums_refuse_damaged_tensors_and_nonfinite_models(tmp_path, capsys):
    model, opt, sched = _trained()
    path = checkpoint.save(str(tmp_path / "ck"), model, opt, sched, step=4, mesh=MESH)
    key = "model/model.layers.1.self_attn.o_proj.weight"
    shard = os.path.join(path, "shard-tp00000.safetensors")
    _damage(shard, key)
    fresh, opt2, sched2 = _trained(seed=3, steps=1)
    before, rng = _params(fresh), _rng_now()
    with pytest.raises(ValueError, match=f"shard-tp00000.safetensors: tensor '{key}' is damaged"):
        checkpoint.load(path, fresh, opt2, sched2, mesh=MESH)
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())
    assert sched2.step_count == 1 and torch.equal(_rng_now()[0], rng[0])
    assert cli_main(["consolidate", path, str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "shard-tp00000.safetensors" in err and key in err and "is damaged" in err
    assert not os.path.exists(tmp_path / "out")
    assert not os.path.exists(tmp_path / "out.tmp-consolidate")

    # a diverged model: save refuses on the spot, nothing is left behind
    with torch.no_grad():
        fresh.model.norm.weight[3] = float("inf")
    with pytest.raises(
        ValueError,
        match="saving step 5 failed on rank 0: parameter model.norm.weight holds non-finite",
    ):
        checkpoint.save(str(tmp_path / "ck"), fresh, opt2, sched2, step=5, mesh=MESH)
    assert sorted(os.listdir(tmp_path / "ck")) == ["step-00000004"]
    # ... and so does consolidate, for a checkpoint written before this check existed
    from safetensors.torch import load_file, save_file

    good = checkpoint.save(str(tmp_path / "ck2"), model, step=1, mesh=MESH)
    tensors = load_file(os.path.join(good, "shard-tp00000.safetensors"))
    tensors["model/model.norm.weight"][0] = float("nan")
    save_file(tensors, os.path.join(good, "shard-tp00000.safetensors"))  # no checksums
    meta = json.loads(open(os.path.join(good, "meta.json")).read())
    meta["format"] = "neuron_tp.checkpoint/1"
    open(os.path.join(good, "meta.json"), "w").write(json.dumps(meta))
    with pytest.raises(ValueError, match="model.norm.weight holds non-finite"):
        checkpoint.consolidate(good, str(tmp_path / "out2"))
    # ... and load (a resume would train on NaN), leaving the model as it was
    before = _params(fresh)
    with pytest.raises(ValueError, match="model.norm.weight holds non-finite values"):
        checkpoint.load(good, fresh, mesh=MESH)
    assert all(
        torch.equal(
            p,
            before[n],
        )
        for n, p in fresh.named_parameters()
    )


def test_consolidate_refuses_impossible_targets_before_reading(tmp_path, capsys):
    model, _, _ = _trained(steps=1)
    path = checkpoint.save(str(tmp_path / "ck"), model, step=1, mesh=MESH)
    os.remove(os.path.join(path, "shard-tp00000.safetensors"))  # reading it would fail
    (tmp_path / "afile").write_text("x")
    for target, text in (
        (tmp_path / "afile", "exists and is not a directory"),
        (tmp_path / "afile" / "out", "Not a directory"),
        ("/sys/neuron-tp-consolidate-test", "cannot write the consolidated"),
    ):
        assert cli_main(["consolidate", path, str(target)]) == 2
        err = capsys.readouterr().err
        assert text in err and "shard" not in err, (target, err)
    assert cli_main(["consolidate", path, str(tmp_path / "ok")]) == 2
    assert "shard-tp00000.safetensors: unreadable" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "ok.tmp-consolidate")


def test_keep_last_spares_protected_and_bad_states_change_nothing(tmp_path):
    model, opt, sched = _trained()
    root = str(tmp_path / "ck")
    first = checkpoint.save(root, model, opt, sched, step=1, mesh=MESH)
    for step in (2, 3, 4):
        checkpoint.save(root, model, opt, sched, step=step, mesh=MESH, keep_last=2, protect=[first])
    assert sorted(os.listdir(root)) == ["step-00000001", "step-00000003", "step-00000004"]
    for name, damage in (("sched", lambda m: m.update(scheduler={"warmup": 1})), ("rng", None)):
        path = os.path.join(root, "step-00000004")
        fresh, opt2, sched2 = _trained(seed=5, steps=1)
        before, rng, step_count = _params(fresh), _rng_now(), sched2.step_count
        moments = [opt2.state[p]["exp_avg"].clone() for p in fresh.parameters()]
        saved_meta = open(os.path.join(path, "meta.json")).read()
        saved_rng = open(os.path.join(path, "rng-rank00000.json")).read()
        if damage:
            meta = json.loads(saved_meta)
            damage(meta)
            open(os.path.join(path, "meta.json"), "w").write(json.dumps(meta))
        else:
            open(os.path.join(path, "rng-rank00000.json"), "w").write('{"python": [3]}')
        with pytest.raises(ValueError, match="scheduler state|unreadable RNG state"):
            checkpoint.load(path, fresh, opt2, sched2, mesh=MESH)
        assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters()), name
        assert sched2.step_count == step_count, name
        assert all(
            torch.equal(opt2.state[p]["exp_avg"], m) for p, m in zip(fresh.parameters(), moments)
        ), name
        assert torch.equal(_rng_now()[0], rng[0]) and _rng_now()[1] == rng[1], name
        open(os.path.join(path, "meta.json"), "w").write(saved_meta)
        open(os.path.join(path, "rng-rank00000.json"), "w").write(saved_rng)


def test_output_lock_and_resume_plan(tmp_path, monkeypatch):
    import socket
    import subprocess
    import time

    from neuron_tp.checkpoint.outdir import LOCK_NAME, OutputLock, check_resume_plan

    lock_file = tmp_path / LOCK_NAME
    a = OutputLock(str(tmp_path))
    assert a.acquire() is None
    record = json.loads(lock_file.read_text())
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    with pytest.raises(ValueError, match=f"in use by another job: .* held by pid {os.getpid()}"):
        OutputLock(str(tmp_path)).acquire()
    a.release()
    assert not lock_file.exists()

    def holder(**kw):
        lock_file.write_text(
            json.dumps(
                {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "started": "then",
                    "token": "other",
                    **kw,
                }
            )
        )

    child = subprocess.Popen(["sleep", "30"])
    try:
        cases = [  # (holder record, mtime age in s, taken over?)
            ({"pid": child.pid}, 0, False),  # a live job on this host
            ({"pid": child.pid, "proc_start": "1"}, 0, True),  # its pid now another process
            ({"pid": child.pid, "boot_id": "another-boot"}, 0, True),  # rebooted since
            ({"host": "elsewhere", "pid": 1}, 0, False),  # another host, heartbeat fresh
            ({"host": "elsewhere", "pid": 1}, 3600, True),  # another host, no heartbeat
            ({}, 0, True),  # our pid, not our token
            ({"host": "elsewhere", "pid": 1, "run_id": "job-a"}, 0, True),  # restarted job
            ({"host": "elsewhere", "pid": 1, "run_id": "job-b"}, 0, False),  # another job
        ]
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
        for rec, age, taken in cases:
            holder(**rec)
            if age:
                os.utime(lock_file, (time.time() - age, time.time() - age))
            b = OutputLock(str(tmp_path), stale_after=900)
            if taken:
                with pytest.warns(RuntimeWarning, match="took over the stale lock"):
                    assert "took over" in b.acquire()
                assert json.loads(lock_file.read_text())["token"] == b.token
                b.release()
            else:
                with pytest.raises(ValueError, match="is held by pid"):
                    b.acquire()
                assert json.loads(lock_file.read_text())["token"] == "other", rec
    finally:
        child.kill()
        child.wait()
    lock_file.write_text("")  # being written by its creator, or damaged: never taken silently
    with pytest.raises(ValueError, match="unreadable"):
        OutputLock(str(tmp_path)).acquire()

    root = str(tmp_path / "ck")
    for s in (2, 4, 6):
        os.makedirs(os.path.join(root, f"step-{s:08d}"))
    check_resume_plan(root, "x/step-00000006", 6, 10, 2)  # resuming the newest
    check_resume_plan(root, "x/step-00000002", 8, 8, 1)  # nothing left to train
    with pytest.raises(ValueError, match="would write step-00000004, step-00000006 again"):
        check_resume_plan(root, "x/step-00000002", 2, 8, 1)
    with pytest.raises(ValueError, match="later checkpoints: step-00000004, step-00000006"):
        check_resume_plan(root, "x/step-00000002", 2, 9, 5)  # no collision, still mixing


def test_save_fsyncs_every_file_and_the_directory_before_the_rename(tmp_path, monkeypatch):
    model, opt, sched = _trained(steps=1)
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    root = str(tmp_path / "ck")
    path = checkpoint.save(root, model, opt, sched, step=1, mesh=MESH)
    monkeypatch.undo()
    tmp = os.path.join(root, ".tmp-step-00000001")
    at = events.index(("replace", tmp))
    synced = {p for kind, p in events[:at] if kind == "fsync"}
    assert {os.path.join(tmp, f) for f in os.listdir(path)} | {tmp} <= synced, events
    assert ("fsync", root) in events[at:]  # and the rename itself made durable


def test_zero1_shard_files_round_trip_and_damage(tmp_path):
    """A ZeRO-1 run (dp=1) saves its optimizer shard to optim-tp00000-dp00000 (not into the
    model shard); it loads back into Zero1 and plain AdamW; a damaged or missing shard file is
    refused naming it, with nothing modified."""
    from neuron_tp.checkpoint.zero1_files import optim_file

    def zero_trained(seed, steps):
        model = build_model("tiny-llama", 257, seed)
        opt = make_optimizer(model, 1e-3, 0.1, torch.device("cpu"), zero1_mesh=MESH)
        ids = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(seed))
        for _ in range(steps):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = zero_trained(0, 2)
    path = checkpoint.save(str(tmp_path), model, opt, step=2, mesh=MESH)
    assert os.path.exists(optim_file(path, 0, 0))
    assert checkpoint.read_meta(path)["optimizer"]["dp_shards"] == 1
    want = opt.full_state_dict()["params"]
    fresh, opt2 = zero_trained(1, 1)
    checkpoint.load(path, fresh, opt2, mesh=MESH)
    for n, e in opt2.full_state_dict()["params"].items():
        for k, v in e["state"].items():
            assert torch.equal(v, want[n]["state"][k]), (n, k)
    plain, popt, _ = _trained(seed=1, steps=1)
    checkpoint.load(path, plain, popt, mesh=MESH)
    for n, p in plain.named_parameters():
        assert torch.equal(popt.state[p]["exp_avg"], want[n]["state"]["exp_avg"]), n

    key = "optim/model.norm.weight/exp_avg"
    _damage(optim_file(path, 0, 0), key)
    fresh, opt2 = zero_trained(3, 1)
    before = _params(fresh)
    moments = {n: e["state"]["exp_avg"] for n, e in opt2.full_state_dict()["params"].items()}
    with pytest.raises(ValueError, match=f"optim-tp00000-dp00000.safetensors: tensor '{key}'"):
        checkpoint.load(path, fresh, opt2, mesh=MESH)
    os.remove(optim_file(path, 0, 0))
    with pytest.raises(ValueError, match="optim-tp00000-dp00000.safetensors: unreadable"):
        checkpoint.load(path, fresh, opt2, mesh=MESH)
    assert all(torch.equal(p, before[n]) for n, p in fresh.named_parameters())
    for n, e in opt2.full_state_dict()["params"].items():
        assert torch.equal(e["state"]["exp_avg"], moments[n]), n
