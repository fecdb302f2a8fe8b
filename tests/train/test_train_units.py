"""Pieces of the training scripts in one process: data packing / dp split / resume position,
NEURON_CC_FLAGS merging (never clobbering), extract-mode detection, the LR schedule, option
validation, and ``scripts/*.py --help`` with torch alone."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from neuron_tp.backend.graphs import apply_neuron_defaults, extract_graphs_only, merged_cc_flags
from neuron_tp.cli.args import generate_parser, serve_parser, train_parser
from neuron_tp.job.config import GenerateConfig, ServeConfig, TrainConfig
from neuron_tp.job.data import ByteTokenizer, PackedData
from neuron_tp.optim.adamw import WarmupCosine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _corpus(tmp_path, n_docs=40):
    f = tmp_path / "d.jsonl"
    f.write_text(
        "\n".join(json.dumps({"text": f"document {i} " * (i % 7 + 3)}) for i in range(n_docs))
        + "\n"
    )
    return str(f)


def test_packing_dp_split_and_resume_position(tmp_path):
    path = _corpus(tmp_path)
    tok = ByteTokenizer()
    whole = PackedData(path, tok, 13, 4, dp_size=1, dp_rank=0, seed=3)
    ranks = [PackedData(path, tok, 13, 2, dp_size=2, dp_rank=r, seed=3) for r in range(2)]
    assert whole.batches_per_epoch == len(whole.chunks) // 4  # incomplete batch dropped
    for _ in range(2 * whole.batches_per_epoch + 1):  # across two epoch boundaries
        b = whole.next_batch()["input_ids"]
        parts = [r.next_batch()["input_ids"] for r in ranks]
        assert b.shape == (4, 13) and all(p.shape == (2, 13) for p in parts)
        assert torch.equal(b, torch.cat(parts))
    # the packed stream is the documents' bytes joined by end-of-text tokens
    docs = [json.loads(line)["text"] for line in open(path)]
    stream = [t for d in docs for t in [*d.encode(), 256]]
    assert whole.chunks.flatten().tolist() == stream[: whole.chunks.numel()]
    state = whole.state_dict()
    again = PackedData(path, tok, 13, 4, dp_size=1, dp_rank=0, seed=3)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch()["input_ids"], whole.next_batch()["input_ids"])
    with pytest.raises(ValueError, match="seq_len"):
        PackedData(path, tok, 14, 4, dp_size=1, dp_rank=0, seed=3).load_state_dict(state)


def test_data_errors(tmp_path):
    tok = ByteTokenizer()
    with pytest.raises(ValueError, match="does not exist"):
        PackedData(str(tmp_path / "none"), tok, 8, 1)
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(ValueError, match="no .txt or .jsonl"):
        PackedData(str(tmp_path), tok, 8, 1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        PackedData(str(bad), tok, 8, 1)
    small = tmp_path / "small.txt"
    small.write_text("tiny")
    with pytest.raises(ValueError, match="fewer than one global batch"):
        PackedData(str(small), tok, 8, 1)


def test_cc_flags_never_clobbered(monkeypatch):
    assert merged_cc_flags("") == "--model-type=transformer"
    assert merged_cc_flags("--model-type=cnn -O1") == "--model-type=cnn -O1"
    assert (
        merged_cc_flags("-O1  --cache_dir=/x", cache_dir="/y")
        == "-O1 --cache_dir=/x --model-type=transformer"
    )
    assert merged_cc_flags("-O2", cache_dir="/y") == "-O2 --model-type=transformer --cache_dir=/y"
    env = {"NEURON_CC_FLAGS": "--model-type=unet-inference -O1"}
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    apply_neuron_defaults(env)
    assert env["NEURON_CC_FLAGS"] == "--model-type=unet-inference -O1"
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    env = {}
    apply_neuron_defaults(env)
    assert env == {}  # off Neuron nothing is set


def test_extract_mode_detection(monkeypatch):
    for value, expected in (("1", True), ("true", True), ("0", False), ("", False)):
        monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", value)
        assert extract_graphs_only() is expected
    monkeypatch.delenv("NEURON_EXTRACT_GRAPHS_ONLY")
    assert extract_graphs_only() is False


def test_schedule_warmup_then_cosine():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = WarmupCosine(opt, 1e-3, 1e-4, 4, 20)
    lrs = []
    for _ in range(20):
        lrs.append(s.apply())
        assert opt.param_groups[0]["lr"] == lrs[-1]
        s.step()
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # non-increasing after warmup
    assert lrs[-1] > 1e-4 and s.value(20) == pytest.approx(1e-4)


def test_option_validation_and_help():
    for bad in (["--tp", "0"], ["--steps", "-1"], ["--device", "gpu"], ["--tensor-parallel", "2"]):
        with pytest.raises(SystemExit):
            train_parser().parse_args(bad)
    with pytest.raises(SystemExit):
        generate_parser().parse_args(["--buckets", "32,x"])
    assert generate_parser().parse_args(["--buckets", "128,32,32"]).buckets == [32, 128]
    for script in ("train.py", "generate.py"):
        proc = subprocess.run(
            [sys.executable, os.path.join(REPO, "scripts", script), "--help"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert proc.returncode == 0 and "--tp" in proc.stdout, proc.stderr
    from neuron_tp.train.loop import setup

    args = train_parser().parse_args(
        ["--device", "cpu", "--tp", "2", "--sequence-parallel", "--seq-len", "33"]
    )
    with pytest.raises(ValueError, match="divisible by --tp"):
        setup(args)


@pytest.mark.parametrize(
    "parser, config_type",
    [(train_parser, TrainConfig), (generate_parser, GenerateConfig), (serve_parser, ServeConfig)],
    ids=["train", "generate", "serve"],
)
def test_config_has_exactly_the_parser_options(parser, config_type):
    """The typed config is the parsed options field for field (groups flattened): same names,
    same values, same ``--option`` keys the ranks agree on; frozen; an unknown option and a
    missing one are refused."""
    from neuron_tp.job.options import flat_values

    args = parser().parse_args(["--tp", "2", "--seed", "5"])
    config = config_type.from_args(args)
    assert flat_values(config) == vars(args)
    assert config.option_values() == {
        "--" + k.replace("_", "-"): v for k, v in sorted(vars(args).items())
    }
    assert list(config.option_values()) == sorted(config.option_values())
    assert config_type.from_args(config) is config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.tp = 4
    with pytest.raises(TypeError, match="unknown"):
        config_type.from_args(argparse.Namespace(**vars(args), unknown=1))
    with pytest.raises(TypeError, match="missing options \\['seed'\\]"):
        config_type.from_args(
            argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "seed"})
        )


def test_cli_train_bf16_one_rank_and_device_refusal(tmp_path, monkeypatch, capsys):
    import neuron_tp as ntp
    from neuron_tp.cli.entry import main
    from neuron_tp.train.loop import setup, train

    args = train_parser().parse_args(
        [
            "--device",
            "cpu",
            "--bf16",
            "--steps",
            "3",
            "--log-every",
            "1",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--output-dir",
            str(tmp_path / "bf16"),
        ]
    )
    runs = []
    s = train(args, mesh=ntp.Mesh(1, 0), printer=lambda *a, **k: None, on_step=runs.append)
    assert all(p.dtype == torch.bfloat16 for p in runs[-1].model.parameters())
    assert len(s["log"]) == 3 and all(torch.isfinite(torch.tensor(e["loss"])) for e in s["log"])
    # the CLI entry point, and a rerun that finds the job already done (no overwrite attempt)
    cmd = [
        "train",
        "--device",
        "cpu",
        "--steps",
        "2",
        "--log-every",
        "1",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--output-dir",
        str(tmp_path / "cli"),
    ]
    try:
        assert main(cmd) == 0 and "loss" in capsys.readouterr().out
        assert main(cmd) == 0 and "nothing to do" in capsys.readouterr().out
        assert main([*cmd, "--resume", "none"]) == 2  # a user error: one line, status 2
        err = capsys.readouterr().err
        assert re.match(r"neuron-tp train: error: .*--resume none but .*step-00000002 exists", err)
    finally:
        ntp.set_default_mesh(None)  # init_mesh made one for this process
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    with pytest.raises(ValueError, match="use --device cpu"):
        setup(train_parser().parse_args(["--device", "xla", "--tp", "2"]))


def test_hf_tokenizer_directory(tmp_path):
    """A local HF tokenizer directory (a BPE tokenizer trained here on the demo corpus) is
    used instead of bytes: documents are its encodings joined by its end-of-text token, and
    the preset model's vocabulary follows the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from neuron_tp.job.data import load_tokenizer, vocab_size
    from neuron_tp.job.presets import build_model

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train(
        [os.path.join(REPO, "data", "corpus.txt")],
        trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]),
    )
    PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(str(tmp_path / "tok"))
    tok = load_tokenizer(str(tmp_path / "tok"))
    path = _corpus(tmp_path, n_docs=30)
    data = PackedData(path, tok, 16, 2)
    docs = [json.loads(line)["text"] for line in open(path)]
    stream = [t for d in docs for t in [*tok.encode(d), tok.eos_token_id]]
    assert data.chunks.flatten().tolist() == stream[: data.chunks.numel()]
    assert vocab_size(tok) == 300
    assert build_model("tiny-llama", vocab_size(tok), 0).config.vocab_size == 300
    with pytest.raises(ValueError, match="not a directory"):
        load_tokenizer(str(tmp_path / "missing"))
