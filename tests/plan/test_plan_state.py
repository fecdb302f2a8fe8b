"""``neuron_tp.plan.state_bytes`` (predicted from a meta-device model sharded for a virtual
rank) against the bytes a real job holds: gloo ranks, tp=2 x dp=2, ``neuron-tp train`` with
plain AdamW, ``--zero1`` and ``--bf16``: parameters and gradients exactly, optimizer state and
fp32 masters within 10% (Zero1's per-parameter padding, AdamW's step counters)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402

LEVERS = {"adamw": [], "zero1": ["--zero1"], "bf16": ["--bf16"]}


def _measure(tmp: str) -> None:
    from neuron_tp.train.loop import train
    from train_cpu import quiet as _quiet
    from train_cpu import train_args as _args

    mesh = ntp.init_mesh(tp=2)
    out = {}
    for name, extra in LEVERS.items():
        runs = []
        args = _args(f"{tmp}/{name}", "--tp", "2", "--micro-batch", "1", "--steps", "1", *extra)
        train(args, mesh=mesh, printer=_quiet, on_step=runs.append)
        run = runs[-1]
        params = list({id(p): p for p in run.model.parameters()}.values())
        run.model.zero_grad(set_to_none=True)
        ids = torch.randint(0, 256, (1, 32))
        run.model(input_ids=ids, labels=ids).loss.backward()
        opt = run.optimizer
        if hasattr(opt, "state_bytes"):  # Zero1: moments + persistent fp32 masters
            opt_bytes = opt.state_bytes()
        else:
            opt_bytes = sum(
                t.numel() * t.element_size()
                for st in opt.state.values()
                for t in st.values()
                if torch.is_tensor(t)
            )
        out[name] = {
            "params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(
                p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None
            ),
            "optimizer+masters": opt_bytes,
        }
    with open(f"{tmp}/measured-{mesh.rank}.json", "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    gloo_dist.run(_measure, str(tmp), world_size=4)
    return [json.loads((tmp / f"measured-{r}.json").read_text()) for r in range(4)]


@pytest.mark.parametrize("lever", list(LEVERS))
def test_predicted_state_bytes_match_a_real_job(measured, lever):
    from neuron_tp.job.presets import model_config
    from neuron_tp.plan import state_bytes

    cfg = model_config("tiny-llama", 257)
    for rank, got in enumerate(measured):
        tp_rank = rank % 2  # world rank = dp * tp + tp_rank
        want = state_bytes(
            cfg, tp=2, dp=2, rank=tp_rank, bf16=lever == "bf16", zero1=lever == "zero1"
        )
        assert got[lever]["params"] == want.params, (rank, lever)
        assert got[lever]["grads"] == want.grads, (rank, lever)
        predicted = want.optimizer + want.masters
        assert abs(got[lever]["optimizer+masters"] - predicted) <= 0.1 * predicted, (
            rank,
            lever,
            got[lever],
            want,
        )
