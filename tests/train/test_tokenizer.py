"""One tokenizer resolution for train, generate and serve (issue 27 items 1, 3, 8):

* ``train --model DIR`` without ``--tokenizer`` trains on DIR's own tokenizer (its first loss
  equals the run with ``--tokenizer DIR``, not the byte-level one) and says so;
* checkpoints carry the tokenizer, so ``generate --model OUTDIR`` without ``--tokenizer``
  decodes the run's text: the same as transformers' own ``generate`` + ``AutoTokenizer`` on
  the consolidated directory (gloo tp 2, and 2 XLA CPU devices);
* ``consolidate`` writes the tokenizer files and a generation config;
* a tokenizer larger than the model's embedding is refused by train, generate (CPU and XLA)
  and serve, naming both sizes; a model directory or checkpoint without a tokenizer is
  refused, saying what to pass.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from transformers import GenerationConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
import xla_dist  # noqa: E402
from neuron_tp.cli.args import generate_parser, serve_parser, train_parser  # noqa: E402
from neuron_tp.errors import UserError  # noqa: E402
from neuron_tp.job.config import ServeConfig  # noqa: E402
from tiny_tokenizer import bpe_tokenizer_dir, llama_dir  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
PROMPTS = ["The old man", "Hello"]
NEW = 8


@pytest.fixture(autouse=True)
def _no_default_mesh():
    ntp.set_default_mesh(None)
    yield
    ntp.set_default_mesh(None)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny Llama directory holding its own 300-token BPE tokenizer, one without a
    tokenizer, a 400-token tokenizer (too large for the model) and a jsonl corpus."""
    root = tmp_path_factory.mktemp("tok")
    data = root / "d.jsonl"
    text = open(os.path.join(REPO, "data", "corpus.txt")).read()[:20000]
    data.write_text("\n".join(json.dumps({"text": p}) for p in text.split("\n\n") if p) + "\n")
    model = llama_dir(str(root / "model"), 300, seed=3, tokenizer_vocab=300)
    gen = GenerationConfig.from_pretrained(model)
    gen.eos_token_id = [1, 2]  # the tokenizer's </s> too: not what the model config derives
    gen.save_pretrained(model)
    return {
        "model": model,
        "bare": llama_dir(str(root / "bare"), 300, seed=3),
        "big": bpe_tokenizer_dir(str(root / "big"), 400),
        "data": str(data),
        "root": str(root),
    }


def _train_argv(dirs, out, *extra):
    return [
        "--device",
        "cpu",
        "--model",
        dirs["model"],
        "--data",
        dirs["data"],
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--log-every",
        "1",
        "--output-dir",
        str(out),
        *extra,
    ]


def _first_loss(dirs, out, *extra):
    from neuron_tp.train.loop import train

    lines = []
    args = train_parser().parse_args(_train_argv(dirs, out, "--steps", "1", *extra))
    s = train(args, mesh=ntp.Mesh(1, 0), printer=lambda *a, **k: lines.append(" ".join(a)))
    return s["log"][0]["loss"], lines


def test_train_uses_the_model_directorys_tokenizer(dirs, tmp_path):
    own, lines = _first_loss(dirs, tmp_path / "own")
    given, _ = _first_loss(dirs, tmp_path / "given", "--tokenizer", dirs["model"])
    byte, byte_lines = _first_loss(dirs, tmp_path / "bytes", "--tokenizer", "bytes")
    assert own == given and own != byte
    assert f"tokenizer: {dirs['model']} (" in lines[0] and "300 tokens" in lines[0]
    assert byte_lines[0].startswith("tokenizer: byte-level (257 tokens")
    # the checkpoint carries the tokenizer and the model's generation config; bytes recorded
    step = tmp_path / "own" / "checkpoints" / "step-00000001"
    assert (step / "tokenizer" / "tokenizer.json").is_file()
    assert (step / "generation_config.json").read_bytes() == open(
        os.path.join(dirs["model"], "generation_config.json"), "rb"
    ).read()
    # generate reads the directory's / checkpoint's generation config, as transformers does
    from neuron_tp.infer.load import load_for_generation

    for path in (dirs["model"], str(tmp_path / "own")):
        args = generate_parser().parse_args(["--device", "cpu", "--model", path])
        model, _ = load_for_generation(args, ntp.Mesh(1, 0))
        assert model.generation_config.eos_token_id == [1, 2]
    meta = json.loads(
        (tmp_path / "bytes" / "checkpoints" / "step-00000001" / "meta.json").read_text()
    )
    assert meta["extra"]["tokenizer"]["kind"] == "bytes"


def test_missing_tokenizers_are_refused_with_what_to_pass(dirs, tmp_path):
    from neuron_tp.infer.load import load_for_generation
    from neuron_tp.train.loop import setup, train

    bare = [*_train_argv(dirs, tmp_path / "r"), "--model", dirs["bare"]]
    with pytest.raises(
        UserError, match=r"holds no tokenizer .*--tokenizer DIR .*--tokenizer bytes"
    ):
        setup(train_parser().parse_args(bare))
    gen = ["--device", "cpu", "--model", dirs["bare"]]
    with pytest.raises(UserError, match=r"holds no tokenizer .*--tokenizer DIR"):
        load_for_generation(generate_parser().parse_args(gen), ntp.Mesh(1, 0))
    with pytest.raises(UserError, match=r"--tokenizer '/nonexistent' is not a directory"):
        load_for_generation(
            generate_parser().parse_args([*gen, "--tokenizer", "/nonexistent"]), ntp.Mesh(1, 0)
        )
    # a checkpoint that records no tokenizer (an older run): refused, not decoded as bytes
    train(
        train_parser().parse_args([*bare, "--tokenizer", "bytes", "--steps", "1"]),
        mesh=ntp.Mesh(1, 0),
        printer=lambda *a, **k: None,
    )
    meta_file = tmp_path / "r" / "checkpoints" / "step-00000001" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["extra"]["tokenizer"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"records no tokenizer.*--tokenizer DIR"):
        load_for_generation(
            generate_parser().parse_args(["--device", "cpu", "--model", str(tmp_path / "r")]),
            ntp.Mesh(1, 0),
        )


def test_tokenizer_larger_than_the_model_is_refused(dirs, tmp_path):
    """train, generate (the CPU path, which crashed with IndexError) and serve (its loader)."""
    from neuron_tp.infer import serve_command
    from neuron_tp.infer.generate_command import run_cli
    from neuron_tp.train.loop import setup

    msg = r"the tokenizer has 400 tokens but --model .* has 300 .*use the model's own tokenizer"
    with pytest.raises(UserError, match=msg):
        setup(train_parser().parse_args([*_train_argv(dirs, tmp_path), "--tokenizer", dirs["big"]]))
    gen = ["--device", "cpu", "--model", dirs["model"], "--tokenizer", dirs["big"]]
    with pytest.raises(UserError, match=msg):
        run_cli(generate_parser().parse_args([*gen, "--prompt", "Hello"]))
    ntp.set_default_mesh(None)
    config = ServeConfig.from_args(serve_parser().parse_args(gen))
    with pytest.raises(UserError, match=msg):
        serve_command.load_engine(serve_command.Engine(None), config, ntp.Mesh(1, 0))


def _run_and_generate(tmp: str, dirs: dict) -> None:
    """tp 2: train on the model directory (no --tokenizer), generate from the run's output
    directory (no --tokenizer), rank 0 consolidates."""
    from neuron_tp.infer.generate_command import run_cli
    from neuron_tp.train.loop import train

    argv = _train_argv(dirs, f"{tmp}/run", "--tp", "2", "--steps", "3", "--lr", "3e-2")
    train(train_parser().parse_args(argv), printer=lambda *a, **k: None)
    gen = ["--device", "cpu", "--tp", "2", "--model", f"{tmp}/run", "--max-new-tokens", str(NEW)]
    gen += ["--buckets", "8"]
    texts = run_cli(generate_parser().parse_args([*gen, *(f"--prompt={p}" for p in PROMPTS)]))
    if torch.distributed.get_rank() == 0:
        from neuron_tp.checkpoint import consolidate

        consolidate(f"{tmp}/run", f"{tmp}/hf")
        with open(f"{tmp}/texts.json", "w") as fh:
            json.dump(texts, fh)


def _transformers_texts(hf: str) -> list[str]:
    """Plain transformers on the consolidated directory: its own tokenizer and generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf)
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([tok.encode(p)])
        new = model.generate(ids, max_new_tokens=NEW, do_sample=False)
        out.append(tok.decode(new[0, ids.shape[1] :], skip_special_tokens=True))
    return out


def test_generate_and_consolidate_carry_the_runs_tokenizer(dirs, tmp_path):
    from transformers import AutoTokenizer

    tmp = str(tmp_path)
    gloo_dist.run(_run_and_generate, tmp, dirs, world_size=2)
    hf = f"{tmp}/hf"
    assert os.path.isfile(f"{hf}/generation_config.json")
    own, consolidated = (
        AutoTokenizer.from_pretrained(dirs["model"]),
        AutoTokenizer.from_pretrained(hf),
    )
    for text in ["Hello world, ünï", *PROMPTS]:
        assert consolidated.encode(text) == own.encode(text)
    texts = json.loads((tmp_path / "texts.json").read_text())
    ref = _transformers_texts(hf)
    assert texts == ref
    # the XLA tier (2 XLA CPU devices of one process): the same text; a tokenizer larger
    # than the model is refused there too, before any id reaches the device
    res = xla_dist.run(_xla_generate, f"{tmp}/run", dirs["big"], devices=2)
    for r in res:
        assert r["texts"] == ref
        assert "the tokenizer has 400 tokens but --model" in r["refused"]


def _xla_generate(run: str, big: str) -> dict:
    from neuron_tp.infer.generate_command import run_cli

    base = ["--tp", "2", "--model", run, "--buckets", "8", "--max-new-tokens", str(NEW)]
    texts = run_cli(generate_parser().parse_args([*base, *(f"--prompt={p}" for p in PROMPTS)]))
    try:
        run_cli(generate_parser().parse_args([*base, "--prompt", "Hello", "--tokenizer", big]))
        refused = None
    except UserError as e:
        refused = str(e)
    return {"texts": texts, "refused": refused}
