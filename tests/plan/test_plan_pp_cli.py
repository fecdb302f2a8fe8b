"""``neuron-tp plan`` with pipeline and context parallelism in the search: the job issue 35
measured as impossible (Llama-2-70B, 4 x trn1.32xlarge, seq 4096, global batch 256) now gets a
pipeline layout that fits, and so does ``neuron-tp train --plan auto`` for that job (train
accepts the layout); refusals name what works."""

from __future__ import annotations

import json

import pytest

from neuron_tp.cli.plan import plan_command


def _plan(capsys, *argv: str) -> tuple[int, str, str]:
    code = plan_command(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_llama2_70b_on_4_nodes_gets_a_pipeline_layout(capsys, monkeypatch):
    """Issue 35's command (tp 32 + SP pinned to keep the test's traces few; the unpinned
    plan's pick is in docs/plan.md), then the same job as ``--plan auto`` plans it (the
    traces shared): its training options have pp > 1, and train's checks accept them."""
    code, out, _ = _plan(
        capsys,
        *("--model", "llama-2-70b", "--nodes", "4", "--seq-len", "4096"),
        *("--global-batch", "256", "--json", "--top", "0", "--tp", "32", "--sequence-parallel"),
    )
    assert code == 0, out[-2000:]
    plan = json.loads(out)
    rec = plan["recommended"]
    lay = rec["layout"]
    assert rec["fits"] and lay["pp"] > 1, rec
    assert lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == 128
    args = rec["train_args"]
    assert args[args.index("--pp") + 1] == str(lay["pp"])
    # every pp = 1 layout is out of memory: that is why pp is recommended
    flat = [c for c in plan["candidates"] if c["layout"]["pp"] == 1]
    assert flat and not any(c["fits"] for c in flat)
    # the peak is the worst stage: a first stage (most in flight) or a last one (LM head)
    assert rec["peak_stage"] in (0, lay["pp"] - 1)
    assert rec["step_seconds"]["bubble"] > 0
    _auto_picks_the_pipeline(monkeypatch)


def _auto_picks_the_pipeline(monkeypatch) -> None:
    from neuron_tp.cli.args import train_parser
    from neuron_tp.job.config import TrainConfig
    from neuron_tp.job.layout_rules import job_refusals
    from neuron_tp.plan.auto import applied, auto_job, excluded_axes
    from neuron_tp.plan.models import plan_config
    from neuron_tp.plan.search import make_plan

    monkeypatch.setenv("WORLD_SIZE", "128")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    argv = ["--plan", "auto", "--model", "llama-2-70b", "--seq-len", "4096", "--bf16"]
    config = TrainConfig.from_args(train_parser().parse_args([*argv, "--global-batch", "256"]))
    model = plan_config(config.model, config.seq_len)
    assert excluded_axes(config, model) == {}  # pp and cp both open to the plan
    plan = make_plan(model, auto_job(config), tp=32, sequence_parallel=True)
    planned = applied(config, plan.recommended.layout)
    assert planned.pipeline.pp > 1 and planned.tp == 32 and planned.sequence_parallel
    dp = 128 // (planned.pipeline.pp * planned.tp)
    assert planned.micro_batch * planned.grad_accum * dp == 256
    assert job_refusals(planned, 128, model) == []  # train runs it


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pp", "3"], "--pp 3: pp=3 x virtual stages 1 does not divide the 2 layers"),
        (["--pp", "2", "--global-batch", "1"], "no micro-batch split gives 2 or more"),
        (["--cp", "2", "--attention", "sdpa"], "--cp > 1 runs blockwise attention"),
        (["--pp", "2", "--virtual-stages", "2"], "does not divide the 2 layers"),
    ],
)
def test_pipeline_pins_are_refused_before_tracing(capsys, argv, message):
    base = ["--model", "tiny-llama", "--instance", "trn1.2xlarge", "--seq-len", "64"]
    if "--global-batch" not in argv:
        base += ["--global-batch", "8"]
    code, _, err = _plan(capsys, *base, *argv)
    assert code == 2 and message in err, err
