"""``neuron-tp train --zero1`` on gloo ranks: the same losses and gradient norms as the run
without it and as the unsharded reference (tp2 x dp2, SP, gradient accumulation); its
checkpoints (per-parameter, full over dp) resume at another dp degree with and without
--zero1, and a checkpoint written without it resumes with it."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import neuron_tp as ntp  # noqa: E402
from neuron_tp.train.loop import train  # noqa: E402
from reference_train import reference_run  # noqa: E402
from test_train_dist import _args, _losses, _quiet, gloo_dist  # noqa: E402

COMMON = ["--grad-accum", "2", "--steps", "12", "--save-every", "6"]


def _norms(summary) -> list[float]:
    return [e["grad_norm"] for e in summary["log"]]


def _tp2_dp2(tmp: str) -> None:
    mesh = ntp.init_mesh(tp=2)  # tp2 x dp2
    base = ["--tp", "2", "--sequence-parallel", "--micro-batch", "2", *COMMON]
    z = train(_args(f"{tmp}/z", *base, "--zero1"), mesh, printer=_quiet)
    p = train(_args(f"{tmp}/p", *base), mesh, printer=_quiet)
    # The plain run's step-6 checkpoint resumed with --zero1 (load_full_state_dict).
    pz = train(
        _args(f"{tmp}/pz", *base, "--zero1", "--resume", p["checkpoints"][0]),
        mesh,
        printer=_quiet,
    )
    if mesh.rank == 0:
        with open(f"{tmp}/res.json", "w") as fh:
            json.dump(
                {
                    "z": _losses(z),
                    "z_norm": _norms(z),
                    "p": _losses(p),
                    "p_norm": _norms(p),
                    "pz": _losses(pz),
                    "pz_steps": [e["step"] for e in pz["log"]],
                },
                fh,
            )


def test_zero1_tp2_dp2_equals_plain_and_reference(tmp_path):
    gloo_dist.run(_tp2_dp2, str(tmp_path), world_size=4)
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["z"] == pytest.approx(res["p"], rel=1e-5, abs=1e-6)
    assert res["z_norm"] == pytest.approx(res["p_norm"], rel=1e-5, abs=1e-6)
    ref_loss, ref_norm = reference_run(_args(tmp_path / "ref", "--micro-batch", "2", *COMMON), 4)
    assert res["z"] == pytest.approx(ref_loss, rel=2e-4, abs=2e-4)
    assert res["z_norm"] == pytest.approx(ref_norm, rel=2e-3, abs=2e-4)
    assert ref_loss[-1] < ref_loss[0] - 0.5
    assert res["pz_steps"] == list(range(7, 13))
    assert res["pz"] == pytest.approx(res["p"][6:], rel=1e-5, abs=1e-6)


def _dp2(tmp: str) -> None:
    mesh = ntp.init_mesh(tp=1)  # dp 2
    u = train(_args(f"{tmp}/u", "--micro-batch", "2", *COMMON, "--zero1"), mesh, printer=_quiet)
    if mesh.rank == 0:
        with open(f"{tmp}/u.json", "w") as fh:
            json.dump({"u": _losses(u), "ckpts": u["checkpoints"]}, fh)


def _dp4(tmp: str, ckpt: str) -> None:
    mesh = ntp.init_mesh(tp=1)  # dp 4: half the micro-batch, the same global batch
    res = {}
    for name, extra in (("zero1", ["--zero1"]), ("plain", [])):
        s = train(
            _args(f"{tmp}/{name}", "--micro-batch", "1", *COMMON, "--resume", ckpt, *extra),
            mesh,
            printer=_quiet,
        )
        res[name] = _losses(s)
        res[name + "_steps"] = [e["step"] for e in s["log"]]
    if mesh.rank == 0:
        with open(f"{tmp}/dp4.json", "w") as fh:
            json.dump(res, fh)


def test_zero1_checkpoint_dp2_resumes_at_dp4_with_and_without_zero1(tmp_path):
    gloo_dist.run(_dp2, str(tmp_path), world_size=2)
    u = json.loads((tmp_path / "u.json").read_text())
    assert [os.path.basename(c) for c in u["ckpts"]] == ["step-00000006", "step-00000012"]
    gloo_dist.run(_dp4, str(tmp_path), u["ckpts"][0], world_size=4)
    res = json.loads((tmp_path / "dp4.json").read_text())
    for name in ("zero1", "plain"):
        assert res[name + "_steps"] == list(range(7, 13)), name
        assert res[name] == pytest.approx(u["u"][6:], rel=1e-5, abs=1e-6), name


def _skip(tmp: str) -> None:
    from test_train_guard import _run

    mesh = ntp.init_mesh(tp=1)  # dp 2; NaN gradients on rank 1 at step 3
    res = {
        name: _run(
            mesh,
            f"{tmp}/{name}",
            "--tp",
            "1",
            "--steps",
            "6",
            "--skip-nonfinite",
            *extra,
            poison_at=3,
        )
        for name, extra in (("zero1", ["--zero1"]), ("plain", []))
    }
    if mesh.rank == 0:
        with open(f"{tmp}/skip.json", "w") as fh:
            json.dump(res, fh)


def test_zero1_skip_nonfinite_equals_plain(tmp_path):
    gloo_dist.run(_skip, str(tmp_path), world_size=2)
    res = json.loads((tmp_path / "skip.json").read_text())
    z, p = res["zero1"], res["plain"]
    assert z["raised"] is None and z["ckpts"] == ["step-00000006"], z
    assert [e["skipped_steps"] for e in z["log"]] == [0, 0, 1, 1, 1, 1]
    assert [e["loss"] for e in z["log"]] == pytest.approx(
        [e["loss"] for e in p["log"]], rel=1e-5, abs=1e-6
    )
