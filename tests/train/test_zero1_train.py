"""``neuron-tp train --zero1`` on gloo ranks: the same losses and gradient norms as the run
without it and as the unsharded reference (tp2 x dp2, SP, gradient accumulation). Its
checkpoints hold each (tp, dp) rank's own optimizer shard (``optim-tp*-dp*`` files, no dp
gather at save): they resume bit-identically at the same layout, at another dp degree with
and without --zero1, at another tp degree (tp2 x dp2 -> tp4), and consolidate to the same full
optimizer state as the plain run's; a checkpoint written without --zero1 resumes with it; with
--bf16 the fp32 masters survive a dp2 -> dp4 (and tp2 -> tp1) round trip bit-exactly.

The runs are the cases of two gloo launches (2 and 4 ranks, ``TWO`` and ``FOUR``); each test
reads its own case's outputs."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from neuron_tp.train.loop import train  # noqa: E402
from reference_train import reference_run  # noqa: E402
from train_cpu import losses as _losses  # noqa: E402
from train_cpu import quiet as _quiet  # noqa: E402
from train_cpu import train_args as _args  # noqa: E402

COMMON = ["--grad-accum", "2", "--steps", "12", "--save-every", "6"]
TWO, FOUR = ("dp2", "skip"), ("tp2_dp2", "dp4", "bf16")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("zero1_train"))


def _case(case: str, base: str) -> None:
    """Rank body of one case: its runs write under ``base``/``case``."""
    out = os.path.join(base, case)
    os.makedirs(out, exist_ok=True)
    if case == "dp4":  # resumes the dp2 case's step-6 checkpoint
        with open(os.path.join(base, "dp2", "u.json")) as f:
            return _dp4(out, json.load(f)["ckpts"][0])
    {"dp2": _dp2, "skip": _skip, "tp2_dp2": _tp2_dp2, "bf16": _bf16}[case](out)


def _outputs(case: str, base: str):
    """The output directory of ``case``, after its launch (the 2-rank one first: ``dp4``
    needs its checkpoint)."""
    with contextlib.suppress(AssertionError):  # its own test reports a failure
        gloo_dist.run_case(_case, "dp2", base, cases=TWO, world_size=2)
    if case in FOUR:
        gloo_dist.run_case(_case, case, base, cases=FOUR, world_size=4)
    else:
        gloo_dist.run_case(_case, case, base, cases=TWO, world_size=2)
    return pathlib.Path(base) / case


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
    # The ZeRO-1 step-6 checkpoint (dp-sharded) resumed at tp4 x dp1, with --zero1.
    base4 = ["--tp", "4", "--sequence-parallel", "--micro-batch", "4", *COMMON]
    z4 = train(
        _args(f"{tmp}/z4", *base4, "--zero1", "--resume", z["checkpoints"][0]),
        ntp.init_mesh(tp=4),
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
                    "z4": _losses(z4),
                    "z4_steps": [e["step"] for e in z4["log"]],
                    "z_ckpts": z["checkpoints"],
                    "p_ckpts": p["checkpoints"],
                },
                fh,
            )


def test_zero1_tp2_dp2_equals_plain_and_reference(base):
    tmp_path = _outputs("tp2_dp2", base)
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["z"] == pytest.approx(res["p"], rel=1e-5, abs=1e-6)
    assert res["z_norm"] == pytest.approx(res["p_norm"], rel=1e-5, abs=1e-6)
    ref_loss, ref_norm = reference_run(_args(tmp_path / "ref", "--micro-batch", "2", *COMMON), 4)
    assert res["z"] == pytest.approx(ref_loss, rel=2e-4, abs=2e-4)
    assert res["z_norm"] == pytest.approx(ref_norm, rel=2e-3, abs=2e-4)
    assert ref_loss[-1] < ref_loss[0] - 0.5
    assert res["pz_steps"] == list(range(7, 13))
    assert res["pz"] == pytest.approx(res["p"][6:], rel=1e-5, abs=1e-6)
    assert res["z4_steps"] == list(range(7, 13))
    assert res["z4"] == pytest.approx(res["z"][6:], rel=2e-4, abs=2e-4)
    _check_sharded_files(res["z_ckpts"][0], tp=2, dp=2)
    # Joined over dp, then over tp: the plain run's full optimizer state (fp32 tolerance).
    for zc, pc in zip(res["z_ckpts"], res["p_ckpts"]):
        got, want = ntp.checkpoint.full_optimizer_state(zc), ntp.checkpoint.full_optimizer_state(pc)
        assert set(got) == set(want) and all(set(got[n]) == set(want[n]) for n in want)
        for n, st in want.items():
            for k, v in st.items():
                torch.testing.assert_close(got[n][k], v, rtol=1e-3, atol=1e-6, msg=f"{n} {k}")


def _check_sharded_files(path: str, tp: int, dp: int) -> None:
    """A ZeRO-1 checkpoint: one optimizer file per (tp, dp) rank, none of its state in the
    model shards, the dp degree in the metadata."""
    from safetensors import safe_open

    meta = ntp.checkpoint.read_meta(path)
    assert meta["optimizer"]["dp_shards"] == dp and meta["format"] == "neuron_tp.checkpoint/3"
    files = sorted(f for f in os.listdir(path) if f.startswith(("optim-", "shard-")))
    optim = [f"optim-tp{t:05d}-dp{d:05d}.safetensors" for t in range(tp) for d in range(dp)]
    assert files == optim + [f"shard-tp{t:05d}.safetensors" for t in range(tp)]
    with safe_open(os.path.join(path, "shard-tp00000.safetensors"), "pt") as fh:
        assert not [k for k in fh.keys() if k.startswith("optim/")]


def _dp2(tmp: str) -> None:
    mesh = ntp.init_mesh(tp=1)  # dp 2
    u = train(_args(f"{tmp}/u", "--micro-batch", "2", *COMMON, "--zero1"), mesh, printer=_quiet)
    # Same layout: every rank loads its own shard file (no join), bit-identical continuation.
    again = ["--micro-batch", "2", *COMMON, "--zero1", "--resume", u["checkpoints"][0]]
    r = train(_args(f"{tmp}/r", *again), mesh, printer=_quiet)
    if mesh.rank == 0:
        with open(f"{tmp}/u.json", "w") as fh:
            json.dump({"u": _losses(u), "ckpts": u["checkpoints"], "r": _losses(r)}, fh)


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


def test_zero1_checkpoint_dp2_resumes_same_dp_exactly_and_at_dp4_with_and_without_zero1(base):
    u = json.loads((_outputs("dp2", base) / "u.json").read_text())
    assert [os.path.basename(c) for c in u["ckpts"]] == ["step-00000006", "step-00000012"]
    _check_sharded_files(u["ckpts"][0], tp=1, dp=2)
    assert u["r"] == u["u"][6:]  # bit-identical on CPU
    res = json.loads((_outputs("dp4", base) / "dp4.json").read_text())
    for name in ("zero1", "plain"):
        assert res[name + "_steps"] == list(range(7, 13)), name
        assert res[name] == pytest.approx(u["u"][6:], rel=1e-5, abs=1e-6), name


def _skip(tmp: str) -> None:
    from guarded_run import run_guarded as _run

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


def test_zero1_skip_nonfinite_equals_plain(base):
    res = json.loads((_outputs("skip", base) / "skip.json").read_text())
    z, p = res["zero1"], res["plain"]
    assert z["raised"] is None and z["ckpts"] == ["step-00000006"], z
    assert [e["skipped_steps"] for e in z["log"]] == [0, 0, 1, 1, 1, 1]
    assert [e["loss"] for e in z["log"]] == pytest.approx(
        [e["loss"] for e in p["log"]], rel=1e-5, abs=1e-6
    )


BF16 = ["--bf16", "--zero1", "--micro-batch", "2", "--steps", "4", "--save-every", "2"]


def _bf16(tmp: str) -> None:
    from neuron_tp import checkpoint
    from neuron_tp.checkpoint.reshard import assemble, to_hf
    from neuron_tp.train.loop import setup

    mesh = ntp.init_mesh(tp=2)  # tp2 x dp2, bf16 parameters with fp32 masters
    masters = {}

    def grab(run) -> None:  # the live masters at the saved step (an all-gather over dp)
        if run.step == 2:
            full = run.optimizer.full_state_dict()["params"]
            masters.update({n: e["master"].clone() for n, e in full.items()})

    a = train(_args(f"{tmp}/a", "--tp", "2", *BF16), mesh, printer=_quiet, on_step=grab)
    ckpt = a["checkpoints"][0]
    same = train(_args(f"{tmp}/same", "--tp", "2", *BF16, "--resume", ckpt), mesh, printer=_quiet)
    if mesh.dp_rank == 0:
        torch.save(masters, f"{tmp}/masters-tp{mesh.tp_rank}.pt")
    mesh4 = ntp.init_mesh(tp=1)  # dp 4: the same global batch
    dp4 = ["--tp", "1", *BF16[:2], "--micro-batch", "1", *BF16[4:]]
    run = setup(_args(f"{tmp}/b", *dp4), mesh4)
    checkpoint.load(ckpt, run.model, run.optimizer, run.schedule, mesh=mesh4)
    got = run.optimizer.full_state_dict()["params"]
    b = train(_args(f"{tmp}/b2", *dp4, "--resume", ckpt), mesh4, printer=_quiet)
    if mesh.rank == 0:
        meta = checkpoint.read_meta(ckpt)
        saved = [torch.load(f"{tmp}/masters-tp{t}.pt") for t in range(2)]
        exact, cast = [], []
        for n, p in run.model.named_parameters():
            rec = meta["params"][n]
            want = to_hf(assemble([s[n] for s in saved], rec["sharding"]), rec["hf"])
            m = got[n]["master"]
            exact.append(m.dtype == torch.float32 and torch.equal(m, want))
            cast.append(p.dtype == torch.bfloat16 and torch.equal(p.detach(), m.to(p.dtype)))
        with open(f"{tmp}/bf16.json", "w") as fh:
            json.dump(
                {
                    "a": _losses(a),
                    "same": _losses(same),
                    "b": _losses(b),
                    "b_steps": [e["step"] for e in b["log"]],
                    "exact": exact,
                    "cast": cast,
                },
                fh,
            )


def test_zero1_bf16_masters_survive_dp2_to_dp4_bit_exactly(base):
    res = json.loads((_outputs("bf16", base) / "bf16.json").read_text())
    assert res["exact"] and all(res["exact"]), "fp32 masters changed in the round trip"
    assert all(res["cast"]), "bf16 parameters are not their masters cast"
    assert res["same"] == res["a"][2:]  # same layout: bit-identical continuation
    assert res["b_steps"] == [3, 4]
    assert res["b"] == pytest.approx(res["a"][2:], rel=2e-2, abs=2e-2)
