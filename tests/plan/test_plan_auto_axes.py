"""``neuron-tp train --plan auto`` may choose pipeline (pp) and context (cp) parallelism, but
only where the job's other options let ``neuron-tp train`` run them: every layout the auto
search can pick passes train's own option checks, and the axes it keeps at 1 say why. (No
tracing here: the layouts are enumerated, not predicted; the pick of a pp layout for the
70B / 4-node job is in test_plan_pp_cli.py, a tiny model's pp 1 in test_plan_cli.py's
``--plan auto`` runs.)"""

from __future__ import annotations

import json

import pytest
from transformers import GPT2Config, MistralConfig, MixtralConfig

from neuron_tp.cli.args import train_parser
from neuron_tp.job.config import TrainConfig
from neuron_tp.job.layout_rules import job_refusals
from neuron_tp.plan import layouts as plan_layouts
from neuron_tp.plan.auto import applied, auto_job, excluded_axes
from neuron_tp.plan.hardware import get_instance
from neuron_tp.plan.models import plan_config

LONG = 32768  # context parallelism is searched from plan_layouts.CP_MIN_SEQ tokens


def _config(*argv: str) -> TrainConfig:
    base = ["--plan", "auto", "--global-batch", "64", "--seq-len", str(LONG), "--bf16"]
    return TrainConfig.from_args(train_parser().parse_args([*base, *argv]))


def _auto_layouts(config: TrainConfig, model, monkeypatch) -> list[plan_layouts.Layout]:
    """The layouts ``--plan auto`` searches for ``config`` on 2 x trn1.32xlarge."""
    monkeypatch.setenv("WORLD_SIZE", "64")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    pins = {axis: 1 for axis in excluded_axes(config, model)}
    layouts, _ = plan_layouts.enumerate_layouts(auto_job(config), pins, model)
    return layouts


def _train_refusal(config: TrainConfig, model) -> str:
    """What train's option checks say about ``config`` (empty: accepted)."""
    return "; ".join(job_refusals(config, model_config=model))


@pytest.mark.parametrize("lora", [(), ("--lora-r", "8")])
def test_every_auto_layout_is_one_train_runs(monkeypatch, lora):
    """Llama-3.1-8B at 32k tokens on 64 ranks (full training or LoRA): the auto search holds
    pp > 1 and cp > 1 layouts, never the two together nor over 2d/3d tensor parallelism, and
    train accepts every one of them."""
    model = plan_config("llama-3.1-8b", LONG)
    config = _config("--model", "llama-3.1-8b", *lora)
    layouts = _auto_layouts(config, model, monkeypatch)
    assert any(lay.pp > 1 for lay in layouts)
    assert any(lay.cp > 1 for lay in layouts)
    seen = set()
    for lay in layouts:
        key = (lay.tp, lay.tp_mode, lay.pp, lay.pp_schedule, lay.virtual_stages, lay.cp)
        if key in seen:
            continue
        seen.add(key)
        planned = applied(config, lay)
        assert (planned.pipeline.pp, planned.context.cp) == (lay.pp, lay.cp)
        assert planned.pipeline.virtual_stages == lay.virtual_stages
        assert _train_refusal(planned, model) == "", lay


def _jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_excluded_axes_and_why(tmp_path):
    llama = plan_config("llama-3.1-8b", LONG)
    chat = _jsonl(tmp_path / "chat.jsonl", [{"prompt": "Q", "completion": "A"}])
    text = _jsonl(tmp_path / "text.jsonl", [{"text": "some text"}])
    assert excluded_axes(_config(), llama) == {}
    assert excluded_axes(_config("--data", text, "--eval-data", text), llama) == {}
    assert excluded_axes(_config("--lora-r", "8"), llama) == {}
    ep = excluded_axes(_config("--ep", "2"), llama)
    assert sorted(ep) == ["cp", "pp"] and all(v.startswith("--ep 2") for v in ep.values())
    assert excluded_axes(_config("--data", chat), llama) == {}  # packed rows cross the ring
    assert excluded_axes(_config("--eval-data", chat), llama) == {}
    windowed = excluded_axes(_config(), MistralConfig(sliding_window=4096))
    assert sorted(windowed) == ["cp", "pp"]  # stages build a plain causal mask
    assert f"sliding window of 4096 tokens, shorter than --seq-len {LONG}" in windowed["pp"]
    assert "sliding_window=4096 is not supported by ring attention" in windowed["cp"]
    wide = excluded_axes(_config(), MistralConfig(sliding_window=2 * LONG))
    assert list(wide) == ["cp"] and f"sliding_window={2 * LONG}" in wide["cp"]
    gpt2 = excluded_axes(_config(), GPT2Config())
    assert list(gpt2) == ["pp"] and "GPT2 is not one of them" in gpt2["pp"]
    assert excluded_axes(_config(), MixtralConfig()) == {}
    assert excluded_axes(_config(), MixtralConfig(output_router_logits=True)) == {}


def test_pp_with_2d_is_searched_cp_with_2d_left_out_with_trains_reason():
    job = plan_layouts.Job(get_instance("trn1.32xlarge"), 1, LONG, 32)
    llama = plan_config("llama-2-7b", LONG)
    staged, _ = plan_layouts.enumerate_layouts(
        job, {"pp": 2, "tp_mode": "2d"}, llama
    )  # train runs it
    assert staged and {(lay.pp, lay.tp_mode) for lay in staged} == {(2, "2d")}
    none, notes = plan_layouts.enumerate_layouts(job, {"cp": 2, "tp_mode": "2d"}, llama)
    assert none == [] and any("--cp 2 does not combine with --tp-mode 2d" in n for n in notes)
    both, _ = plan_layouts.enumerate_layouts(job, {"pp": 2, "cp": 2}, llama)  # stages around a ring
    assert both and {(lay.pp, lay.cp, lay.tp_mode) for lay in both} == {(2, 2, "1d")}
    free, _ = plan_layouts.enumerate_layouts(job, {}, llama)
    assert any(lay.pp > 1 and lay.cp > 1 for lay in free)
