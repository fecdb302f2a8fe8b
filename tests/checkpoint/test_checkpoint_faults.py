"""Checkpoint save and load under faults on ONE rank of two (gloo), each way the issue lists:
disk full (SafetensorError) / fsync failing / non-finite parameters on rank 1, a non-JSON
``extra`` / the rename / makedirs / rmtree of a leftover failing on rank 0, an unwritable
root; a damaged RNG file, a damaged tensor and an unexpected exception type on rank 1 while
loading. Every rank must raise promptly ``"saving step N failed on rank R: ..."`` (or
``loading ...``), nothing may be committed (the earlier checkpoint byte-identical, no leftover
directory), and a failed load leaves model, optimizer, scheduler and RNG untouched everywhere.
All cases run in one spawned two-rank job."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402

SAVE_CASES = {  # name: (failing rank, text the error must carry)
    "disk_full_r1": (1, "No space left on device"),
    "fsync_r1": (1, "Input/output error"),
    "nonfinite_r1": (1, "non-finite"),
    "extra_not_json_r0": (0, "not JSON serializable"),
    "replace_r0": (0, "Input/output error"),
    "makedirs_r0": (0, "Permission denied"),
    "rmtree_leftover_r0": (0, "Operation not permitted"),
    "root_under_file": (0, "Not a directory"),
}
LOAD_CASES = {
    "rng_damaged_r1": (1, "rng-rank00001"),
    "tensor_damaged_r1": (1, "is damaged"),
    "keyerror_r1": (1, "KeyError"),
}


@contextlib.contextmanager
def patched(obj, name: str, fn, active: bool):
    """Replace ``obj.name`` by ``fn`` when ``active`` (a fault on this rank only)."""
    old = getattr(obj, name)
    if active:
        setattr(obj, name, fn)
    try:
        yield
    finally:
        setattr(obj, name, old)


def _raiser(exc):
    def fn(*a, **k):
        raise exc

    return fn


def _digest(path: str) -> dict:
    out = {}
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                out[os.path.relpath(os.path.join(d, f), path)] = hashlib.sha1(fh.read()).hexdigest()
    return out


def _attempt(fn) -> dict:
    t0 = time.perf_counter()
    try:
        fn()
        res = {"raised": None}
    except Exception as e:  # noqa: BLE001 - recorded for the parent to check
        res = {"raised": type(e).__name__, "msg": str(e)}
    res["seconds"] = time.perf_counter() - t0
    return res


def _save_fault(name: str, rank: int, root: str, save) -> dict:
    import safetensors
    import safetensors.torch as st

    if name == "rmtree_leftover_r0" and rank == 0:
        os.makedirs(os.path.join(root, ".tmp-step-00000002"))
    faults = {
        "disk_full_r1": (
            st,
            "save_file",
            _raiser(
                safetensors.SafetensorError(
                    "Error while serializing: I/O error: No space left on device (os error 28)"
                )
            ),
        ),
        "fsync_r1": (os, "fsync", _raiser(OSError(errno.EIO, "Input/output error"))),
        "replace_r0": (os, "replace", _raiser(OSError(errno.EIO, "Input/output error"))),
        "makedirs_r0": (
            os,
            "makedirs",
            _raiser(PermissionError(errno.EACCES, "Permission denied")),
        ),
        "rmtree_leftover_r0": (
            shutil,
            "rmtree",
            _raiser(PermissionError(errno.EPERM, "Operation not permitted")),
        ),
    }
    obj, attr, fn = faults.get(name, (os, "getcwd", None))
    active = fn is not None and rank == SAVE_CASES[name][0]
    with patched(obj, attr, fn, active):
        return _attempt(save)


def _case_save(tmp: str, res: dict, mesh, model, opt, sched) -> None:
    from neuron_tp import checkpoint

    for name in SAVE_CASES:
        root = f"{tmp}/{name}"
        checkpoint.save(root, model, opt, sched, step=1, mesh=mesh)
        before = _digest(root)
        torch.distributed.barrier()
        extra = {"x": object()} if name == "extra_not_json_r0" else None
        target = f"{tmp}/afile/ck" if name == "root_under_file" else root
        if name == "nonfinite_r1" and mesh.rank == 1:
            saved = next(model.parameters()).detach().clone()
            with torch.no_grad():
                next(model.parameters())[0].fill_(float("nan"))
        out = _save_fault(
            name,
            mesh.rank,
            root,
            lambda: checkpoint.save(target, model, opt, sched, step=2, mesh=mesh, extra=extra),
        )
        if name == "nonfinite_r1" and mesh.rank == 1:
            with torch.no_grad():
                next(model.parameters()).copy_(saved)
        torch.distributed.barrier()
        out["listing"] = sorted(os.listdir(root))
        out["step1_intact"] = _digest(root) == before
        res[name] = out
    # and then the same save succeeds (the leftovers of failures are no obstacle)
    root = f"{tmp}/rmtree_leftover_r0"
    res["after"] = _attempt(lambda: checkpoint.save(root, model, opt, sched, step=2, mesh=mesh))
    res["after"]["listing"] = sorted(os.listdir(root))


def _state(model, opt, sched) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optim": {
            n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()
        },
        "sched": sched.step_count,
        "rng": torch.get_rng_state(),
        "py": random.getstate(),
    }


def _same(a: dict, b: dict) -> bool:
    return (
        all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        and all(
            torch.equal(a["optim"][n][k], b["optim"][n][k])
            for n in a["optim"]
            for k in a["optim"][n]
        )
        and a["sched"] == b["sched"]
        and torch.equal(a["rng"], b["rng"])
        and a["py"] == b["py"]
    )


def _case_load(tmp: str, res: dict, mesh, model, opt, sched, step) -> None:
    from neuron_tp import checkpoint
    from neuron_tp.checkpoint import reader

    for name in LOAD_CASES:
        path = checkpoint.save(f"{tmp}/load-{name}", model, opt, sched, step=5, mesh=mesh)
        if mesh.rank == 1 and name == "rng_damaged_r1":
            with open(f"{path}/rng-rank00001.json", "w") as fh:
                fh.write('{"python": [3, [1, 2')
        if mesh.rank == 0 and name == "tensor_damaged_r1":
            f = f"{path}/shard-tp00001.safetensors"
            data = bytearray(open(f, "rb").read())
            n = int.from_bytes(data[:8], "little")
            start = json.loads(data[8 : 8 + n])["model/model.layers.1.mlp.down_proj.weight"][
                "data_offsets"
            ][0]
            data[8 + n + start + 4] ^= 0x40
            open(f, "wb").write(bytes(data))
        step()  # the live state moves on: a load that modified anything would show
        torch.distributed.barrier()
        before = _state(model, opt, sched)
        fault = name == "keyerror_r1" and mesh.rank == 1
        with patched(reader.Shards, "get", _raiser(KeyError("simulated")), fault):
            out = _attempt(lambda: checkpoint.load(path, model, opt, sched, mesh=mesh))
        out["untouched"] = _same(before, _state(model, opt, sched))
        res["load_" + name] = out
    # a clean load really modifies (the check above is not vacuous)
    path = checkpoint.save(f"{tmp}/load-ok", model, opt, sched, step=6, mesh=mesh)
    before = _state(model, opt, sched)
    step()
    checkpoint.load(path, model, opt, sched, mesh=mesh)
    res["load_ok_restores"] = _same(before, _state(model, opt, sched))


def _faults(tmp: str) -> None:
    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.job.presets import build_model
    from neuron_tp.optim.adamw import WarmupCosine, make_optimizer

    mesh = ntp.init_mesh(tp=2)
    if mesh.rank == 0:
        open(f"{tmp}/afile", "w").write("a regular file")
    model = build_model("tiny-llama", 257, 0)
    hf.parallelize(model, mesh, parallel_loss=True)
    opt = make_optimizer(model, 1e-3, 0.1, torch.device("cpu"))
    sched = WarmupCosine(opt, 1e-3, 1e-4, 2, 10)
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))

    def step():
        sched.apply()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        torch.rand(1)
        random.random()

    step()
    res = {}
    _case_save(tmp, res, mesh, model, opt, sched)
    _case_load(tmp, res, mesh, model, opt, sched, step)
    with open(f"{tmp}/faults-{mesh.rank}.json", "w") as fh:
        json.dump(res, fh)


def test_save_and_load_faults_on_one_rank(tmp_path):
    gloo_dist.run(_faults, str(tmp_path), world_size=2, timeout=120)
    ranks = [json.loads((tmp_path / f"faults-{r}.json").read_text()) for r in (0, 1)]
    for name, (bad, text) in SAVE_CASES.items():
        for r, res in enumerate(ranks):
            out = res[name]
            assert out["raised"] == "CheckpointError", (name, r, out)
            assert out["msg"].startswith(f"saving step 2 failed on rank {bad}: "), (name, r, out)
            assert text in out["msg"], (name, r, out)
            assert out["seconds"] < 30, (name, r, out)
            # nothing committed, no leftover (but the pre-existing one rmtree failed to remove)
            left = [
                d
                for d in out["listing"]
                if not (name == "rmtree_leftover_r0" and d == ".tmp-step-00000002")
            ]
            assert left == ["step-00000001"], (name, r, out)
            assert out["step1_intact"], (name, r)
    for res in ranks:
        assert res["after"]["raised"] is None, res["after"]
        assert res["after"]["listing"] == ["step-00000001", "step-00000002"]
    for name, (bad, text) in LOAD_CASES.items():
        for r, res in enumerate(ranks):
            out = res["load_" + name]
            assert out["raised"] == "CheckpointError", (name, r, out)
            assert f"failed on rank {bad}: " in out["msg"] and text in out["msg"], (name, r, out)
            assert out["seconds"] < 30 and out["untouched"], (name, r, out)
    assert "model.layers.1.mlp.down_proj.weight" in ranks[1]["load_tensor_damaged_r1"]["msg"]
    assert "shard-tp00001.safetensors" in ranks[0]["load_tensor_damaged_r1"]["msg"]
    assert ranks[0]["load_ok_restores"] and ranks[1]["load_ok_restores"]
