"""``neuron-tp train --bf16`` done right, on gloo ranks (tp2 x dp2, sequence parallel): bf16
parameters and compute with fp32 master weights and AdamW state (kept by ZeRO-1) and fp32
cross-rank sums (``--reduce-dtype fp32``) track the fp32 unsharded reference over 50 steps;
pure bf16 AdamW on the unsharded model (no masters) drifts further from it."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from neuron_tp.train.loop import train  # noqa: E402
from reference_train import reference_run  # noqa: E402
from train_cpu import losses as _losses  # noqa: E402
from train_cpu import quiet as _quiet  # noqa: E402
from train_cpu import train_args as _args  # noqa: E402

STEPS = ["--steps", "50", "--lr", "1e-3", "--min-lr", "1e-3", "--micro-batch", "2"]


def _bf16_tp2_dp2(tmp: str) -> None:
    mesh = ntp.init_mesh(tp=2, reduce_dtype=torch.float32)
    args = ["--tp", "2", "--sequence-parallel", "--bf16", "--reduce-dtype", "fp32", *STEPS]
    s = train(_args(f"{tmp}/bf16", *args), mesh, printer=_quiet)
    if mesh.rank == 0:
        with open(f"{tmp}/res.json", "w") as fh:
            json.dump({"losses": _losses(s)}, fh)


def test_bf16_with_masters_tracks_fp32_and_pure_bf16_drifts(tmp_path):
    gloo_dist.run(_bf16_tp2_dp2, str(tmp_path), world_size=4)
    master = json.loads((tmp_path / "res.json").read_text())["losses"]
    fp32, _ = reference_run(_args(tmp_path / "fp32", *STEPS), 4)
    pure, _ = reference_run(_args(tmp_path / "pure", *STEPS), 4, dtype=torch.bfloat16)
    assert len(master) == len(fp32) == len(pure) == 50
    assert fp32[-1] < fp32[0] - 1.0  # it learns

    def drift(losses: list[float]) -> float:  # mean |loss - fp32 loss| over the last 25 steps
        return sum(abs(a - b) for a, b in zip(losses[25:], fp32[25:])) / 25

    d_master, d_pure = drift(master), drift(pure)
    print(
        f"\n[bf16 train] mean |loss - fp32 loss|, steps 26-50: masters {d_master:.4f}, "
        f"pure bf16 {d_pure:.4f}"
    )
    assert d_master < 0.05 and d_master < d_pure / 2
