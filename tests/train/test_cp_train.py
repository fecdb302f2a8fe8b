"""``neuron-tp train --cp 2`` (context parallelism, ring attention) on gloo ranks and XLA CPU
devices: step by step the losses and grad norms of the independent unsharded reference
(transformers' sdpa on the full sequence, one process), alone and with --tp 2 and sequence
parallelism (on 4 XLA CPU devices: cp 2 x tp 2 with SP, no compile after the second step);
a --cp 2 checkpoint resumes at --cp 1; refusals naming what works."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import xla_cp_cases as cases  # noqa: E402
from xla_multi_train_cases import args_for  # noqa: E402

import gloo_dist  # noqa: E402
import xla_dist  # noqa: E402
from neuron_tp.errors import UserError  # noqa: E402
from neuron_tp.job.config import TrainConfig  # noqa: E402
from neuron_tp.parallel.mesh import Mesh  # noqa: E402
from neuron_tp.train.loop import _check_cp  # noqa: E402
from reference_train import reference_run  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cp_train"))


@pytest.fixture(scope="module")
def ref(base) -> tuple[list[float], list[float]]:
    return reference_run(args_for(f"{base}/ref", *cases.CP), global_micro_batch=2)


def _check(log, ref, steps=slice(None)):
    losses, norms = ref
    torch.testing.assert_close([e["loss"] for e in log], losses[steps], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close([e["grad_norm"] for e in log], norms[steps], rtol=2e-3, atol=1e-5)


def _gloo(base: str, tp: int, extra: tuple) -> None:
    from neuron_tp.train.loop import train

    mesh = gloo_dist.shared_mesh(tp, cp=2)
    args = args_for(f"{base}/gloo-{tp}", "--tp", str(tp), "--cp", "2", *cases.CP, *extra)
    args.device = "cpu"
    s = train(args, mesh, printer=lambda *a, **k: None)
    if mesh.rank == 0:
        torch.save(s["log"], f"{base}/gloo-{tp}.pt")


@pytest.mark.parametrize("tp", [1, 2])
def test_cp2_trains_like_one_rank_on_gloo(base, ref, tp):
    extra = ("--sequence-parallel",) if tp > 1 else ()
    gloo_dist.run(_gloo, base, tp, extra, world_size=2 * tp)
    _check(torch.load(f"{base}/gloo-{tp}.pt"), ref)


@pytest.fixture(scope="module")
def on_xla4(base) -> xla_dist.Cases:
    return xla_dist.run_cases(cases.on_devices, ["cp2-tp2-sp"], base, devices=4)


def test_cp2_tp2_sp_trains_like_one_rank_on_xla(on_xla4, ref):
    got = on_xla4.get("cp2-tp2-sp")
    _check(got[0]["log"], ref)
    compiles = [p["compiles"] // 4 for p in got[0]["per_step"]]  # process-wide / 4 ranks
    assert compiles[1:] == [compiles[1]] * (len(compiles) - 1), compiles


def _save_cp2(out: str) -> None:
    from neuron_tp.train.loop import train

    mesh = gloo_dist.shared_mesh(1, cp=2)
    args = args_for(out, "--cp", "2", *cases.CP)
    args.device, args.save_every, args.steps = "cpu", 2, 2
    train(args, mesh, printer=lambda *a, **k: None)


def _resume_cp1(out: str, log_path: str) -> None:
    from neuron_tp.train.loop import train

    args = args_for(out, *cases.CP)
    args.device, args.resume = "cpu", "auto"
    s = train(args, gloo_dist.shared_mesh(1), printer=lambda *a, **k: None)
    torch.save(s["log"], log_path)


def test_cp2_checkpoint_resumes_at_cp1(base, ref):
    out = f"{base}/resume"
    gloo_dist.run(_save_cp2, out, world_size=2)
    gloo_dist.run(_resume_cp1, out, f"{base}/resume.pt", world_size=1)
    _check(torch.load(f"{base}/resume.pt"), ref, slice(2, None))


def _config(*extra: str) -> TrainConfig:
    return TrainConfig.from_args(args_for("/tmp/unused", *extra))


def test_refusals_name_what_works():
    with pytest.raises(UserError, match="multiple of 2 x cp = 4"):
        _check_cp(_config("--cp", "2", "--seq-len", "250"))
    with pytest.raises(UserError, match="multiple of 16"):
        _check_cp(_config("--cp", "2", "--tp", "4", "--seq-len", "260", "--sequence-parallel"))
    with pytest.raises(UserError, match="--zero1.*it works with --tp"):
        _check_cp(_config("--cp", "2", "--seq-len", "256", "--zero1"))
    with pytest.raises(UserError, match="pp x cp must divide 3"):
        Mesh(6, 0, tp=2, cp=2)
