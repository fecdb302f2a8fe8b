"""Errors that say what is wrong and what would work (issue 15 §5), and generation straight
from a neuron_tp training checkpoint at another tp degree (greedy tokens equal transformers'
own ``generate`` on the trained weights loaded into a plain model)."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from neuron_tp.train.args import generate_parser, train_parser  # noqa: E402
from neuron_tp.train.presets import build_model, model_config  # noqa: E402

PROMPTS = [[72, 101, 108], list(b"The old"), list(range(97, 108))]


@pytest.fixture(autouse=True)
def _no_default_mesh():
    ntp.set_default_mesh(None)
    yield
    ntp.set_default_mesh(None)


def _train_args(tmp, *extra):
    return train_parser().parse_args(
        [
            "--device",
            "cpu",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--steps",
            "2",
            "--output-dir",
            str(tmp / "run"),
            *extra,
        ]
    )


def test_model_path_that_is_not_a_model(tmp_path):
    from neuron_tp.infer.load import load_for_generation
    from neuron_tp.train.loop import setup

    with pytest.raises(ValueError, match=r"'/nonexistent' is neither a preset \(tiny-llama"):
        setup(_train_args(tmp_path, "--model", "/nonexistent"))
    args = generate_parser().parse_args(["--model", "/nonexistent"])
    with pytest.raises(
        ValueError,
        match=r"'/nonexistent' is neither a preset \(tiny-llama.*"
        r"a HuggingFace model or a neuron_tp checkpoint",
    ):
        load_for_generation(args, ntp.Mesh(1, 0))
    with pytest.raises(
        ValueError,
        match=r"'/nonexistent': does not exist; neuron_tp loads a "
        r"local HuggingFace model directory",
    ):
        ntp.from_pretrained("/nonexistent", ntp.Mesh(1, 0))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty'?: no config.json"):
        ntp.from_pretrained(str(tmp_path / "empty"), ntp.Mesh(1, 0))


def test_truncated_safetensors_names_the_file(tmp_path):
    build_model("tiny-llama", 257, 0).save_pretrained(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    for cut in (len(data) // 2, 5):  # data missing; header itself cut
        f.write_bytes(data[:cut])
        with pytest.raises(
            ValueError,
            match=re.escape(str(f)) + r": unreadable safetensors "
            r"file \(\d+ bytes.*truncated",
        ):
            ntp.from_pretrained(str(tmp_path / "m"), ntp.Mesh(1, 0))


def test_non_utf8_data_names_file_and_byte(tmp_path):
    from neuron_tp.train.data import ByteTokenizer, PackedData

    raw = b'{"text": "fine"}\n{"text": "caf\xe9"}\n'  # latin-1 on line 2
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_bytes(raw)
    at = raw.index(bytes([0xE9]))
    want = f"{tmp_path / 'd' / 'x.jsonl'}: not UTF-8 text: byte {at} (line 2)"
    with pytest.raises(ValueError, match=re.escape(want) + ".*iconv"):
        PackedData(str(tmp_path / "d"), ByteTokenizer(), 4, 1)


def test_forward_of_meta_model_says_load_weights():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config("tiny-llama", 257))
    ntp.parallelize(model, ntp.Mesh(1, 0))
    with pytest.raises(ValueError, match=r"still on the meta device.*from_pretrained"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_plan_whose_split_output_has_no_consumer():
    mesh = ntp.Mesh.virtual(2, 0, tp=2)
    up_gate = {"model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.gate_proj": "colwise"}
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.gate_proj is 'colwise'.*in "
        r"model\.layers\.0\.mlp \(LlamaMLP\).*put "
        r"\{'model\.layers\.\*\.mlp\.down_proj': 'rowwise'\}",
    ):
        ntp.parallelize(build_model("tiny-llama", 257, 0), mesh, plan=up_gate)
    with pytest.raises(
        ValueError,
        match=r"down_proj is 'rowwise' \(it expects its input split.*"
        r"'model\.layers\.\*\.mlp\.gate_proj': 'colwise', "
        r"'model\.layers\.\*\.mlp\.up_proj': 'colwise'",
    ):
        ntp.parallelize(
            build_model("tiny-llama", 257, 0),
            mesh,
            plan={"model.layers.*.mlp.down_proj": "rowwise"},
        )
    # Llama's own plan with down_proj made colwise: the rowwise o_proj before the MLP does
    # not consume gate/up's split output.
    from neuron_tp.hf import resolve_plan

    model = build_model("tiny-llama", 257, 0)
    plan = {**resolve_plan(model), "model.layers.*.mlp.down_proj": "colwise"}
    with pytest.raises(
        ValueError,
        match=r"mlp\.gate_proj is 'colwise'.*put "
        r"\{'model\.layers\.\*\.mlp\.down_proj': 'rowwise'\}",
    ):
        ntp.parallelize(model, mesh, plan=plan)
    # The suggested plan is accepted.
    ntp.parallelize(
        build_model("tiny-llama", 257, 0),
        mesh,
        plan={**up_gate, "model.layers.*.mlp.down_proj": "rowwise"},
    )


def test_generate_with_device_xla_on_ranks_off_neuron(monkeypatch):
    from neuron_tp.infer.cli import run_cli

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    args = generate_parser().parse_args(["--device", "xla", "--tp", "2", "--prompt", "Hi"])
    with pytest.raises(
        ValueError,
        match=r"--device xla with 2 ranks needs NeuronCores.*"
        r"use --device cpu",
    ):
        run_cli(args)
    import torch.distributed as tdist

    assert not tdist.is_initialized()  # refused before any rendezvous


def _reference_tokens(trained) -> list[list[int]]:
    """Greedy tokens of transformers' own generate on a plain model holding ``trained``."""
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_config(model_config("tiny-llama", 257)).eval()
    plain.load_state_dict(trained, strict=True)
    plain.generation_config.eos_token_id = None  # neuron_tp's generate never stops early
    return [
        plain.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, pad_token_id=0)[
            0, len(p) :
        ].tolist()
        for p in PROMPTS
    ]


def _generate_tp2(tmp: str) -> None:
    from neuron_tp.infer.generate import generate
    from neuron_tp.infer.load import load_for_generation

    mesh = ntp.init_mesh(tp=2)
    res = {}
    for name, path in (
        ("step dir", f"{tmp}/run/checkpoints/step-00000002"),
        ("run dir", f"{tmp}/run"),
    ):
        args = generate_parser().parse_args(["--device", "cpu", "--tp", "2", "--model", path])
        model, _ = load_for_generation(args, mesh)
        res[name] = generate(model, PROMPTS, 6, [16])
    with open(f"{tmp}/gen-{mesh.rank}.json", "w") as fh:
        json.dump(res, fh)


def test_generate_from_neuron_tp_checkpoint_at_any_tp(tmp_path):
    from neuron_tp.hf.loading import gather_hf_state_dict
    from neuron_tp.infer.generate import generate
    from neuron_tp.infer.load import load_for_generation
    from neuron_tp.train.loop import setup, train

    runs = []
    train(
        _train_args(tmp_path, "--lr", "3e-2", "--warmup-steps", "1"),
        printer=lambda *a, **k: None,
        on_step=runs.append,
    )
    ref = _reference_tokens(gather_hf_state_dict(runs[-1].model))
    assert ref != _reference_tokens(build_model("tiny-llama", 257, 0).state_dict())  # trained
    # `train --model CHECKPOINT` says what to do instead
    with pytest.raises(ValueError, match=r"neuron_tp training checkpoint.*--resume"):
        setup(_train_args(tmp_path, "--model", str(tmp_path / "run")))
    args = generate_parser().parse_args(["--device", "cpu", "--model", str(tmp_path / "run")])
    model, _ = load_for_generation(args, ntp.Mesh(1, 0))
    assert generate(model, PROMPTS, 6, [16]) == ref
    gloo_dist.run(_generate_tp2, str(tmp_path), world_size=2)
    for r in range(2):
        res = json.loads((tmp_path / f"gen-{r}.json").read_text())
        assert res["step dir"] == ref and res["run dir"] == ref
