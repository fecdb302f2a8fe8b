"""``neuron-tp train --attention blockwise`` at tp 2 (with and without sequence parallelism)
on two XLA CPU devices and on gloo ranks: step by step the losses and grad norms of the
independent unsharded reference, which runs transformers' sdpa; on XLA no compile after the
second step (the blocks are static: one step graph)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import xla_blockwise_cases as cases  # noqa: E402
from xla_multi_train_cases import args_for  # noqa: E402

import gloo_dist  # noqa: E402
import xla_dist  # noqa: E402
from reference_train import reference_run  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("blockwise_train"))


@pytest.fixture(scope="module")
def two(base) -> xla_dist.Cases:
    return xla_dist.run_cases(cases.on_two, list(cases.CASES), base, devices=2)


@pytest.fixture(scope="module")
def sdpa_ref(base) -> tuple[list[float], list[float]]:
    args = args_for(f"{base}/ref", "--tp", "2", *cases.BLOCKWISE)
    return reference_run(args, global_micro_batch=2)


def _check(log, ref):
    losses, norms = ref
    torch.testing.assert_close([e["loss"] for e in log], losses, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close([e["grad_norm"] for e in log], norms, rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("case", list(cases.CASES))
def test_blockwise_trains_like_sdpa_on_xla(two, sdpa_ref, case):
    got = two.get(case)
    _check(got[0]["log"], sdpa_ref)
    compiles = [p["compiles"] // 2 for p in got[0]["per_step"]]  # process-wide / 2 ranks
    assert compiles[1:] == [compiles[1]] * (len(compiles) - 1), compiles


def _gloo(base: str) -> None:
    from neuron_tp.train.loop import train

    mesh = gloo_dist.shared_mesh(2)
    args = args_for(f"{base}/gloo", "--tp", "2", *cases.BLOCKWISE, "--sequence-parallel")
    args.device = "cpu"
    s = train(args, mesh, printer=lambda *a, **k: None)
    if mesh.rank == 0:
        torch.save(s["log"], f"{base}/gloo.pt")


def test_blockwise_trains_like_sdpa_on_gloo(base, sdpa_ref):
    gloo_dist.run(_gloo, base, world_size=2)
    _check(torch.load(f"{base}/gloo.pt"), sdpa_ref)
