"""``neuron-tp plan --objective dpo --reference ...``: the memory of DPO's reference per core
against an independent count: the bytes of the parameters a tp=2 gloo rank holds after
sharding the tiny Llama with ``neuron_tp.hf.parallelize`` (``--reference copy`` holds exactly
one more such set), two fp32 per pair of a rank's data (``precompute``), nothing for
``adapters``; a pair is two rows (the activations of ``--micro-batch 1`` pairs are those of
2 sequences); ``copy`` under ``--pp`` is refused, as train refuses it."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402

SEQ, PAIRS = 64, 10
PLAN = ["--model", "tiny-llama", "--instance", "trn1.2xlarge", "--seq-len", str(SEQ)]
PLAN += ["--global-batch", "4", "--tp", "2", "--tp-mode", "1d", "--no-sequence-parallel"]
PLAN += ["--activation-checkpointing", "none", "--pp", "1", "--cp", "1", "--attention", "sdpa"]
PLAN += ["--fp32", "--no-zero1", "--json", "--top", "0"]


def _count(out: str) -> None:
    """Rank body: this rank's parameter bytes of the sharded model (each tensor once)."""
    import torch
    from transformers import LlamaForCausalLM

    import neuron_tp
    from neuron_tp import hf
    from neuron_tp.plan.models import plan_config

    mesh = neuron_tp.init_mesh(tp=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(plan_config("tiny-llama", SEQ))
    hf.parallelize(model, mesh, parallel_loss=True)
    unique = {id(p): p for p in model.parameters()}.values()
    count = sum(p.numel() * p.element_size() for p in unique)
    with open(f"{out}/rank-{mesh.rank}.json", "w") as f:
        json.dump(count, f)


@pytest.fixture(scope="module")
def counted(tmp_path_factory) -> list[int]:
    out = tmp_path_factory.mktemp("reference")
    gloo_dist.run(_count, str(out), world_size=2)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def _plan(capsys, *extra: str) -> dict:
    from neuron_tp.cli.plan import plan_command

    code = plan_command([*PLAN, *extra])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _memory(plan: dict, micro_batch: int) -> dict:
    (cand,) = [c for c in plan["candidates"] if c["layout"]["micro_batch"] == micro_batch]
    return cand["memory_bytes"]


def test_reference_memory_against_the_sharded_model(capsys, counted):
    assert counted[0] == counted[1]  # tp ranks hold the same bytes (even shards)
    lm = _plan(capsys)
    plans = {
        kind: _plan(capsys, "--objective", "dpo", "--reference", kind, "--pairs", str(PAIRS))
        for kind in ("adapters", "copy", "precompute")
    }
    copy = _memory(plans["copy"], 1)
    assert copy["params"] == counted[0]  # the policy's weights, as the planner counts them
    assert copy["reference"] == counted[0]  # and one more set
    assert _memory(plans["precompute"], 1)["reference"] == 2 * 4 * PAIRS  # dp 1: every pair
    assert _memory(plans["adapters"], 1)["reference"] == 0
    for kind, plan in plans.items():  # a pair is two rows: 1 pair = 2 sequences' activations
        mem = _memory(plan, 1)
        assert mem["activations"] == _memory(lm, 2)["activations"] > _memory(lm, 1)["activations"]
        others = mem["total"] - mem["reference"]
        assert others == _memory(lm, 2)["total"], kind
    assert plans["copy"]["job"]["reference"] == "copy"
    assert "--reference" in plans["copy"]["recommended"]["train_args"]
    auto = _plan(capsys, "--objective", "dpo")  # auto: precompute (full fine-tuning)
    assert auto["job"]["reference"] == "precompute"
    assert _memory(auto, 1)["reference"] == 2 * 4 * 4  # one global batch of pairs


def test_copy_with_pipeline_refused(capsys):
    from neuron_tp.cli.plan import plan_command

    argv = list(PLAN)
    argv[argv.index("--pp") + 1] = "2"
    argv[argv.index("--tp") + 1] = "1"
    code = plan_command([*argv, "--objective", "dpo", "--reference", "copy"])
    err = capsys.readouterr().err
    assert code == 2 and "--reference copy does not combine with --pp 2" in err, err
