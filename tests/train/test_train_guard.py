"""The training entry point (two gloo ranks, tp=2) guarding its output and its numbers:

- a resume whose checkpoints would collide with later ones is refused before training,
  naming the step directories; --keep-last never deletes the checkpoint the run resumed from;
- an output dir that is a file, read-only, or unwritable on one rank only, or not the same
  directory on every rank (node-local paths): every rank raises before training;
- a second job on a held --output-dir fails naming the holder; a stale lock (dead pid) is taken
  over with a warning; the lock is gone after every run, failed or not;
- a non-finite grad norm (NaN gradients injected on rank 1 only) stops the run on every rank
  at the next checkpoint or log step, whichever is first, and nothing is saved after it; with
  --skip-nonfinite the step is skipped and the run equals an independent plain-torch reference
  that skips the same step, on the XLA device too (undone by device-side selects; no graph
  compiles after step 2)."""

from __future__ import annotations

import builtins
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import guarded_run  # noqa: E402
import xla_zygote  # noqa: E402
from guarded_run import guard_args as _args  # noqa: E402
from guarded_run import run_guarded as _run  # noqa: E402
from neuron_tp.checkpoint.outdir import LOCK_NAME, OutputLock  # noqa: E402
from neuron_tp.cli.args import train_parser  # noqa: E402


def _job(tmp: str) -> None:
    import neuron_tp as ntp

    mesh = ntp.init_mesh(tp=2)
    res = {}
    if mesh.rank == 0:
        open(f"{tmp}/afile", "w").write("a regular file")
    torch.distributed.barrier()
    # keep-last and resume: the sequence, then the protection of the resume source
    res["kl_first"] = _run(
        mesh, f"{tmp}/kl", "--steps", "6", "--save-every", "2", "--keep-last", "3"
    )
    torch.distributed.barrier()
    res["kl_collide"] = _run(
        mesh,
        f"{tmp}/kl",
        "--steps",
        "8",
        "--save-every",
        "1",
        "--keep-last",
        "3",
        "--resume",
        f"{tmp}/kl/checkpoints/step-00000002",
    )
    res["kp_first"] = _run(
        mesh, f"{tmp}/kp", "--steps", "4", "--save-every", "2", "--keep-last", "1"
    )
    torch.distributed.barrier()
    res["kp_resumed"] = _run(
        mesh, f"{tmp}/kp", "--steps", "7", "--save-every", "1", "--keep-last", "1"
    )
    # the output dir of another model; of other training data (refused unless --resume
    # names the checkpoint: then a warning)
    res["other_model"] = _run(
        mesh, f"{tmp}/kp", "--steps", "9", "--model", f"{tmp}/other", "--tokenizer", "bytes"
    )
    res["other_data"] = _run(mesh, f"{tmp}/kp", "--steps", "9", "--data", f"{tmp}/data2")
    notes = []
    res["other_data_named"] = _run(
        mesh,
        f"{tmp}/kp",
        "--steps",
        "8",
        "--data",
        f"{tmp}/data2",
        "--resume",
        f"{tmp}/kp/checkpoints/step-00000007",
        printer=lambda *a, **k: notes.append(" ".join(map(str, a))),
    )
    res["other_data_named"]["notes"] = notes
    # output directories that cannot work
    res["out_file"] = _run(mesh, f"{tmp}/afile", "--steps", "2")
    res["out_readonly"] = _run(mesh, "/sys/neuron-tp-test-out", "--steps", "2")
    real_open = builtins.open

    def no_write(path, *a, **k):  # rank 1 alone cannot write there (e.g. a node's mount)
        if ".write-test" in str(path):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    builtins.open = no_write if mesh.rank == 1 else real_open
    try:
        res["out_rank1"] = _run(mesh, f"{tmp}/r1", "--steps", "2")
    finally:
        builtins.open = real_open
    # the same --output-dir text naming a different directory on each rank (node-local disks)
    here = os.getcwd()
    os.makedirs(f"{tmp}/node{mesh.rank}", exist_ok=True)
    os.chdir(f"{tmp}/node{mesh.rank}")
    try:
        res["not_shared"] = _run(mesh, "out", "--steps", "2")
    finally:
        os.chdir(here)
    # locks: held by the live parent process; stale (dead pid on this host)
    res["locked"] = _run(mesh, f"{tmp}/locked", "--steps", "2")
    notes = []
    res["stale"] = _run(
        mesh,
        f"{tmp}/stale",
        "--steps",
        "2",
        printer=lambda *a, **k: notes.append(" ".join(map(str, a))),
    )
    res["stale"]["notes"] = notes
    # non-finite: stop at the step-4 checkpoint (not a log step), stop at a log step, skip
    res["nf_save"] = _run(
        mesh, f"{tmp}/nf1", "--steps", "8", "--save-every", "2", "--log-every", "3", poison_at=4
    )
    res["nf_log"] = _run(mesh, f"{tmp}/nf2", "--steps", "8", "--log-every", "3", poison_at=2)
    res["nf_skip"] = _run(mesh, f"{tmp}/nf3", "--steps", "6", "--skip-nonfinite", poison_at=3)
    with open(f"{tmp}/guard-{mesh.rank}.json", "w") as fh:
        json.dump(res, fh)


def _reference(args, skip_step: int | None) -> list[float]:
    """Plain transformers + torch AdamW / LambdaLR / clip_grad_norm_ on one process, the
    optimizer update of ``skip_step`` left out (data and schedule move on)."""
    from neuron_tp.job.data import ByteTokenizer, PackedData
    from neuron_tp.job.presets import build_model
    from reference_train import lr_factor

    model = build_model(args.model, ByteTokenizer.vocab_size, args.seed).train()
    data = PackedData(
        args.data,
        ByteTokenizer(),
        args.seq_len,
        args.micro_batch,
        dp_size=1,
        dp_rank=0,
        seed=args.seed,
    )
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for p in model.parameters() if p.dim() >= 2],
                "weight_decay": args.weight_decay,
            },
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=args.lr,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.lr, args.min_lr, args.warmup_steps, args.steps)
    )
    losses = []
    for step in range(1, args.steps + 1):
        ids = data.next_batch()["input_ids"]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if step != skip_step:
            opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_resume_plan_output_dir_lock_and_nonfinite(tmp_path):
    held = OutputLock(str(tmp_path / "locked"))
    os.makedirs(tmp_path / "locked")
    held.acquire()
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.makedirs(tmp_path / "stale")
    (tmp_path / "stale" / LOCK_NAME).write_text(
        json.dumps(
            {"pid": dead.pid, "host": socket.gethostname(), "started": "earlier", "token": "old"}
        )
    )
    from transformers import AutoModelForCausalLM

    from neuron_tp.job.presets import model_config

    other = model_config("tiny-llama", 257)
    other.intermediate_size *= 2
    AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path / "other")
    (tmp_path / "data2").mkdir()
    (tmp_path / "data2" / "x.txt").write_text("other words for another run. " * 200)
    try:
        gloo_dist.run(_job, str(tmp_path), world_size=2, timeout=180)
    finally:
        held.release()
    r0, r1 = (json.loads((tmp_path / f"guard-{r}.json").read_text()) for r in (0, 1))
    for res in (r0, r1):
        # every run let go of its lock (the parent still holds "locked"); rank 0 releases it
        assert [n for n, case in r0.items() if case["lock_left"]] == ["locked"]
        # the sequence: refused before training, nothing deleted or written
        assert res["kl_first"]["ckpts"] == ["step-00000002", "step-00000004", "step-00000006"]
        c = res["kl_collide"]
        assert c["raised"] == "CheckpointError" and c["steps"] == [], c
        assert "step-00000004, step-00000006" in c["msg"] and "--resume auto" in c["msg"], c
        assert c["listing"] == ["step-00000002", "step-00000004", "step-00000006"]
        # --keep-last 1 kept the resume source step-4 next to the newest
        assert res["kp_first"]["listing"] == ["step-00000004"]
        assert res["kp_first"]["ckpts"] == ["step-00000004"]  # the summary lists what exists
        assert res["kp_resumed"]["steps"] == [5, 6, 7]
        assert res["kp_resumed"]["listing"] == ["step-00000004", "step-00000007"]
        o = res["other_model"]
        assert o["raised"] == "CheckpointError" and o["steps"] == [], o  # a UserError
        assert "kp holds checkpoints of another model than --model" in o["msg"], o
        assert "new --output-dir" in o["msg"] and "mlp.gate_proj.weight" in o["msg"], o
        d = res["other_data"]
        assert d["raised"] == "CheckpointError" and d["steps"] == [], d
        assert "the training data changed since" in d["msg"], d
        assert "pass --resume " + f"{tmp_path}/kp/checkpoints/step-00000007" in d["msg"], d
        assert res["other_data_named"]["steps"] == [8], res["other_data_named"]
        for name, text in (
            ("out_file", "failed on every rank: /tmp/"),
            ("out_file", "afile is a file, not a directory"),
            ("out_readonly", "cannot create /sys/neuron-tp-test-out"),
            ("out_rank1", "failed on rank 1: cannot write into"),
            ("not_shared", "is shared failed on rank 1: this rank does not see rank 0's lock"),
            ("locked", f"held by pid {os.getpid()} on host {socket.gethostname()}"),
        ):
            assert res[name]["raised"] == "CheckpointError", (name, res[name])
            assert text in res[name]["msg"] and res[name]["steps"] == [], (name, res[name])
            assert res[name]["seconds"] < 60, (name, res[name])
        assert res["stale"]["raised"] is None and res["stale"]["steps"] == [1, 2]
        # non-finite: stopped on every rank, the checkpoint of the bad step never written
        s = res["nf_save"]
        assert s["raised"] == "NonFiniteError" and "at step 4" in s["msg"], s
        assert s["steps"] == [1, 2, 3, 4] and s["listing"] == ["step-00000002"], s
        s = res["nf_log"]
        assert s["raised"] == "NonFiniteError" and "at step 2" in s["msg"], s
        assert "up to step 3" in s["msg"], s  # seen at the step-3 log, before on_step(3)
        assert s["steps"] == [1, 2] and s["listing"] == [], s
    assert any(
        "took over the stale lock" in n and f"pid {dead.pid}" in n for n in r0["stale"]["notes"]
    ), r0["stale"]["notes"]
    assert any(
        "warning: resuming" in n and "with other training data" in n
        for n in r0["other_data_named"]["notes"]
    ), r0["other_data_named"]["notes"]
    skip = r0["nf_skip"]
    assert skip["raised"] is None and skip["ckpts"] == ["step-00000006"], skip
    assert [e["skipped_steps"] for e in skip["log"]] == [0, 0, 1, 1, 1, 1]
    assert r1["nf_skip"]["log"] == skip["log"] or [e["loss"] for e in r1["nf_skip"]["log"]] == [
        e["loss"] for e in skip["log"]
    ]
    args = _args(tmp_path / "ref", "--steps", "6")
    ref = _reference(args, skip_step=3)
    losses = [e["loss"] for e in skip["log"]]
    assert losses == pytest.approx(ref, rel=2e-4, abs=2e-4)
    assert losses[3:] != pytest.approx(_reference(args, None)[3:], rel=2e-4, abs=2e-4)


def test_skip_nonfinite_on_the_xla_device(tmp_path):
    argv = ["--device", "xla", *guarded_run.SCHEDULE, "--steps", "6", "--skip-nonfinite"]
    here = os.path.dirname(__file__)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": os.path.dirname(os.path.dirname(here))}
    proc = xla_zygote.python(
        [os.path.join(here, "xla_guard_run.py"), str(tmp_path / "out"), *argv], env, 300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))[4:])
    assert [e["skipped_steps"] for e in res["log"]] == [0, 0, 1, 1, 1, 1]
    assert res["compiles"][1:] == [res["compiles"][1]] * 5, res["compiles"]
    ref = _reference(train_parser().parse_args(argv), skip_step=3)
    assert [e["loss"] for e in res["log"]] == pytest.approx(ref, rel=2e-4, abs=2e-4)
    assert [os.path.basename(c) for c in res["checkpoints"]] == ["step-00000006"]
