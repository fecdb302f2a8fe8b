"""``neuron-tp plan --calibration PATH`` (and ``train --plan auto --plan-calibration PATH``): the
measured figures of ``neuron-tp selftest --calibrate`` replace the datasheet's, predictions move
as neuron_tp/plan/calibration.py documents, and the output says so."""

from __future__ import annotations

import json

import pytest

from neuron_tp.cli.args import train_parser
from neuron_tp.cli.plan import plan_command
from neuron_tp.job.config import TrainConfig
from neuron_tp.plan.auto import apply_plan
from neuron_tp.plan.calibration import FORMAT, describe, load_calibration
from neuron_tp.plan.hardware import get_instance

JOB = ("--model", "tiny-llama", "--instance", "trn1.2xlarge", "--seq-len", "64")
JOB += ("--global-batch", "8", "--top", "0")
PINNED = ("--tp", "2", "--tp-mode", "1d", "--no-sequence-parallel")  # fewer layouts to trace
PINNED += ("--activation-checkpointing", "none")


def _write(path, **figures) -> str:
    path.write_text(json.dumps({"format": FORMAT, "measured_on": "test", **figures}))
    return str(path)


def _plan(capsys, *argv):
    code = plan_command([*JOB, *PINNED, *argv])
    out = capsys.readouterr().out
    return code, out


def test_calibration_replaces_the_datasheet_figures(capsys, tmp_path):
    inst = get_instance("trn1.2xlarge")
    link, lat, flops = inst.link_bandwidth_per_core / 3, inst.collective_latency * 4, 20e12
    cal = _write(
        tmp_path / "cal.json",
        link_bandwidth_per_core=link,
        collective_latency_s=lat,
        bf16_flops_per_core=flops,
        network_bandwidth_per_node=None,
    )
    code, base = _plan(capsys, "--json")
    code2, measured = _plan(capsys, "--json", "--calibration", cal)
    assert code == code2 == 0
    base, measured = json.loads(base), json.loads(measured)
    assert measured["assumptions"]["efficiency"] == 1.0  # the measured rate is an achieved one
    assert measured["assumptions"]["collective_latency_s"] == lat
    assert any("calibrated from" in n and "datasheet" in n for n in measured["notes"])
    same = {json.dumps(c["layout"]): c for c in base["candidates"] if "step_seconds" in c}
    compared = 0
    for c in measured["candidates"]:
        b = same.get(json.dumps(c["layout"]))
        if b is None or "step_seconds" not in c:
            continue
        t, tb = c["step_seconds"], b["step_seconds"]
        # compute: FLOPs / (efficiency x peak): 0.5 x datasheet peak before, 1.0 x measured now
        want = tb["compute"] * (0.5 * inst.peak_flops_per_core) / flops
        assert t["compute"] == pytest.approx(want, rel=1e-9)
        # a slower link and a larger latency: the tp collectives take longer
        assert t["tp_comm"] > tb["tp_comm"]
        assert c["memory_bytes"] == b["memory_bytes"]  # memory does not depend on it
        compared += 1
    assert compared >= 3


def test_the_note_names_each_measured_figure_and_the_datasheets(tmp_path):
    cal = _write(tmp_path / "cal.json", collective_latency_s=1e-3, bf16_flops_per_core=2e13)
    note = describe(get_instance("trn1.2xlarge"), load_calibration(cal))
    assert note == (
        f"calibrated from {cal} (measured on test): collective_latency 1000 us (datasheet "
        "50 us); peak_flops_per_core 20.00 TFLOP/s (datasheet 95.00 TFLOP/s)"
    )


def test_a_bad_calibration_file_is_refused(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"link_bandwidth_per_core": 1}))
    assert plan_command([*JOB, "--calibration", str(bad)]) == 2
    assert "not a calibration file" in capsys.readouterr().err
    neg = _write(tmp_path / "neg.json", bf16_flops_per_core=-1)
    assert plan_command([*JOB, "--calibration", neg]) == 2
    assert "bf16_flops_per_core must be a positive number, got -1" in capsys.readouterr().err


def test_train_plan_auto_uses_the_calibration(tmp_path, monkeypatch):
    """The job ``--plan auto`` plans has the measured figures (the search itself, the same
    as ``neuron-tp plan``'s, is replaced by a recorder: it is tested above and in
    test_plan_cli.py)."""
    import neuron_tp.plan.search as search

    monkeypatch.setenv("NEURON_TP_CACHE", str(tmp_path / "cache"))
    planned = []

    def record(config, job, **pins):
        planned.append(job)
        return search.Plan(job, [], "recorded", 0.0, 0)

    monkeypatch.setattr(search, "make_plan", record)
    link = get_instance("trn1.2xlarge").link_bandwidth_per_core / 2
    cal = _write(tmp_path / "cal.json", bf16_flops_per_core=1e12, link_bandwidth_per_core=link)
    args = ["--plan", "auto", "--global-batch", "8", "--seq-len", "64"]
    args += ["--plan-instance", "trn1.2xlarge", "--plan-calibration", cal]
    printed = []
    with pytest.raises(ValueError, match="recorded"):  # the recorder's plan recommends nothing
        apply_plan(TrainConfig.from_args(train_parser().parse_args(args)), printed.append)
    (job,) = planned
    assert job.instance.peak_flops_per_core == 1e12 and job.efficiency == 1.0
    assert job.instance.link_bandwidth_per_core == link
    assert job.instance.hbm_per_core == get_instance("trn1.2xlarge").hbm_per_core
    assert printed == [
        f"--plan auto: {describe(get_instance('trn1.2xlarge'), load_calibration(cal))}"
    ]
