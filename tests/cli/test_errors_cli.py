"""Errors that say what is wrong and what would work (issue 15 §5), and generation straight
from a neuron_tp training checkpoint at another tp degree (greedy tokens equal transformers'
own ``generate`` on the trained weights loaded into a plain model)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
import xla_zygote  # noqa: E402
from neuron_tp.cli.args import generate_parser, train_parser  # noqa: E402
from neuron_tp.job.presets import build_model, model_config  # noqa: E402

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
    from neuron_tp.job.data import ByteTokenizer, PackedData

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
    from neuron_tp.infer.generate_command import run_cli

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
    from neuron_tp.infer.load import load_for_generation
    from neuron_tp.infer.static_generator import generate

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
    from neuron_tp.hf.saving import gather_hf_state_dict
    from neuron_tp.infer.load import load_for_generation
    from neuron_tp.infer.static_generator import generate
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


# --- issue 27: a user error is one line from one rank (items 4-7) --------------------------

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--seq-len", "32", "--micro-batch", "2", "--log-every", "1", "--warmup-steps", "1"]


def _env(**kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NEURON_TP_DEBUG", "RANK")}
    return {**env, "PJRT_DEVICE": "CPU", "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, **kw}


def _three_head_model(path) -> str:
    """A tiny Llama directory with 3 attention heads (tp 2 cannot split it)."""
    from transformers import AutoModelForCausalLM

    config = model_config("tiny-llama", 257)
    config.num_attention_heads = config.num_key_value_heads = 3
    config.hidden_size, config.head_dim = 48, 16
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def _damage(shard: str, key: str) -> None:
    """Flip one bit inside tensor ``key``'s bytes (the header stays valid)."""
    data = bytearray(open(shard, "rb").read())
    n = int.from_bytes(data[:8], "little")
    start, end = json.loads(data[8 : 8 + n])[key]["data_offsets"]
    data[8 + n + (start + end) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))


def test_misspelled_command_suggests_the_right_one(capsys):
    from neuron_tp.cli.entry import main

    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "neuron-tp: error: unknown command 'trian'; did you mean 'train'?" in err, err
    assert "train, generate, serve, consolidate, plan" in err
    assert main(["--help"]) == 0


def test_user_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    from neuron_tp.cli.entry import main
    from neuron_tp.errors import UserError

    monkeypatch.delenv("NEURON_TP_DEBUG", raising=False)
    argv = ["generate", "--device", "cpu", "--tp", "2", "--prompt", "Hi"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("neuron-tp generate: error: tp=2 does not divide the world size 1")
    assert "torchrun --nproc_per_node 2" in err[0] and "--xla-cpu-devices 2" in err[0], err
    monkeypatch.setenv("NEURON_TP_DEBUG", "1")
    with pytest.raises(UserError, match="does not divide the world size 1"):
        main(argv)


def test_kv_cache_longer_than_the_model_suggests_what_fits(capsys, monkeypatch):
    from neuron_tp.cli.entry import main

    monkeypatch.delenv("NEURON_TP_DEBUG", raising=False)
    base = ["generate", "--device", "cpu", "--prompt", "Hi"]
    assert main([*base, "--buckets", "800", "--max-new-tokens", "300"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "exceeds the model's max_position_embeddings=1024" in err[0], err
    m = re.search(
        r"pass --max-new-tokens (\d+) or --buckets with the largest at most (\d+)", err[0]
    )
    assert m, err
    # each suggestion fits the model (tiny-llama: 1024 positions), one more does not
    new, largest = int(m.group(1)), int(m.group(2))
    assert 800 + new == 1024 and largest + 300 == 1024
    assert main([*base, "--buckets", "800", "--max-new-tokens", str(new + 1)]) == 2
    assert main([*base, "--buckets", str(largest), "--max-new-tokens", "2"]) == 0


def test_generate_from_a_run_without_a_checkpoint_yet(tmp_path, capsys, monkeypatch):
    from neuron_tp.cli.entry import main

    monkeypatch.delenv("NEURON_TP_DEBUG", raising=False)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "step-00000004").mkdir()  # a save cut short
    argv = ["generate", "--device", "cpu", "--prompt", "Hi", "--model", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no complete checkpoint yet" in err[0], err
    assert "--save-every" in err[0] and "neuron-tp generate --model" not in err[0], err


def test_params_on_meta_is_safe_for_rank_threads():
    """Two ranks of --xla-cpu-devices (threads of one process) building models at once: the
    second builder's parameters are on the meta device too, and the patch is undone after
    both (the issue's `lm_head.weight: rank 0: meta; rank 1: <checksum>`)."""
    import threading

    from neuron_tp.hf.loading import params_on_meta

    original = torch.nn.Module.register_parameter
    a_in, b_started, a_done = threading.Event(), threading.Event(), threading.Event()
    got = {}

    def first():
        with params_on_meta():
            got["a"] = torch.nn.Linear(2, 2).weight.is_meta
            a_in.set()
            b_started.wait(5)
            time.sleep(0.2)  # the second builder enters now (without the lock)
        a_done.set()

    def second():
        a_in.wait(5)
        b_started.set()
        with params_on_meta():
            a_done.wait(5)  # the first builder has left its context
            got["b"] = torch.nn.Linear(2, 2).weight.is_meta

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    restored = torch.nn.Module.register_parameter is original
    torch.nn.Module.register_parameter = original
    assert got == {"a": True, "b": True} and restored, (got, restored)


def _cli_ranks(tmp: str, m3: str) -> None:
    """Rank body: `neuron_tp.cli.entry.main` of user errors on 2 gloo ranks; what each printed."""
    import contextlib
    import io

    import torch.distributed as tdist

    from neuron_tp.cli.entry import main

    rank, res = tdist.get_rank(), {}

    def run(name, argv):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            res[name] = {"rc": main(argv)}
        res[name]["err"] = err.getvalue()
        ntp.set_default_mesh(None)
        tdist.barrier()

    run("tp3", ["train", "--device", "cpu", "--tp", "3", "--steps", "1", *TINY])
    run(
        "heads",
        [
            "train",
            "--device",
            "cpu",
            "--tp",
            "2",
            "--model",
            m3,
            "--tokenizer",
            "bytes",
            "--steps",
            "1",
            *TINY,
        ],
    )
    out = f"{tmp}/run"
    run(
        "train",
        ["train", "--device", "cpu", "--tp", "2", "--steps", "1", "--output-dir", out, *TINY],
    )
    if rank == 0:  # a bit flipped in the shard only tp rank 1 reads
        _damage(
            f"{out}/checkpoints/step-00000001/shard-tp00001.safetensors",
            "model/model.layers.1.mlp.down_proj.weight",
        )
    tdist.barrier()
    gen = ["generate", "--device", "cpu", "--tp", "2", "--model", out, "--max-new-tokens", "2"]
    for i in range(3):
        run(f"damaged{i}", [*gen, "--prompt", "Hi"])
    with open(f"{tmp}/cli-{rank}.json", "w") as fh:
        json.dump(res, fh)


def test_user_errors_on_gloo_ranks_print_one_line_from_one_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("NEURON_TP_DEBUG", raising=False)
    m3 = _three_head_model(tmp_path / "m3")
    gloo_dist.run(_cli_ranks, str(tmp_path), m3, world_size=2, timeout=240)
    r0, r1 = (json.loads((tmp_path / f"cli-{r}.json").read_text()) for r in (0, 1))
    assert r0["train"]["rc"] == r1["train"]["rc"] == 0
    for name, rank, text in (
        ("tp3", 0, "neuron-tp train: error: tp=3 does not divide the world size 2"),
        (
            "heads",
            0,
            "neuron-tp train: error: model.layers.0.self_attn.q_proj: "
            "num_attention_heads=3 cannot be split over tp=2",
        ),
        # the rank that read the damaged file reports it; the other stays silent
        *((f"damaged{i}", 1, "neuron-tp generate: error: loading ") for i in range(3)),
    ):
        said, quiet = (r0, r1) if rank == 0 else (r1, r0)
        assert said[name]["rc"] == quiet[name]["rc"] == 2, (name, r0[name], r1[name])
        lines = said[name]["err"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(text), (name, lines)
        assert quiet[name]["err"] == "", (name, quiet[name])
    for i in range(3):
        line = r1[f"damaged{i}"]["err"]
        assert "failed on rank 1: " in line and "shard-tp00001.safetensors: tensor " in line
        assert "'model/model.layers.1.mlp.down_proj.weight' is damaged (CRC-32" in line, line


def test_damaged_shard_on_xla_cpu_devices_names_the_damage(tmp_path):
    """`generate --xla-cpu-devices 2 --tp 2` of a damaged checkpoint: one line naming the
    damaged tensor (never a rank mismatch of half-built models), exit status 2."""
    from neuron_tp.train.loop import train

    out = tmp_path / "run"
    train(_train_args(tmp_path, "--steps", "1"), printer=lambda *a, **k: None)
    step = out / "checkpoints" / "step-00000001"
    (out / "checkpoints" / "step-00000003").mkdir()  # an incomplete newer save
    _damage(str(step / "shard-tp00000.safetensors"), "model/lm_head.weight")
    argv = ["generate", "--device", "xla", "--xla-cpu-devices", "2", "--tp", "2"]
    cli = ["-m", "neuron_tp.cli", *argv, "--model", str(out), "--prompt", "Hi"]
    proc = xla_zygote.python(cli, _env(), 300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = [ln for ln in proc.stderr.splitlines() if "PJRT_DEVICE" not in ln]
    assert len(err) == 1, proc.stderr[-3000:]
    assert err[0].startswith(f"neuron-tp generate: error: loading {step} failed on every rank")
    assert "tensor 'model/lm_head.weight' is damaged (CRC-32" in err[0], err
    assert (
        f"loading checkpoint {step} (skipped the incomplete newer "
        f"{out / 'checkpoints' / 'step-00000003'})" in proc.stdout
    ), proc.stdout


def test_bad_tp_under_torchrun_is_one_line(tmp_path):
    """torchrun, 2 ranks, a 3-head model at --tp 2: the message once, no rank traceback. What
    remains is torchrun's own report of a failed child (its traceback and summary)."""
    m3 = _three_head_model(tmp_path / "m3")
    cmd = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2"]
    cmd += [
        "-m",
        "neuron_tp.cli",
        "train",
        "--device",
        "cpu",
        "--tp",
        "2",
        "--model",
        m3,
        "--tokenizer",
        "bytes",
    ]
    proc = subprocess.run(
        [*cmd, "--steps", "1", "--output-dir", str(tmp_path / "out"), *TINY],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0, text
    ours = text[: text.index("Traceback")] if "Traceback" in text else text
    theirs = text[len(ours) :]
    assert theirs == "" or theirs.splitlines()[1].endswith('bin/torchrun", line 8, in <module>')
    assert "[rank" not in text and text.count("num_attention_heads=3 cannot be split") == 1, text
    assert ours.count("neuron-tp train: error: ") == 1, text
    assert len(ours.splitlines()) < 8, ours
    assert "<NO_OTHER_FAILURES>" in theirs and "exitcode  : 2" in theirs, theirs
    assert len(text.splitlines()) < 40, text


def test_bad_data_is_one_line(tmp_path, capsys, monkeypatch):
    from neuron_tp.cli.entry import main

    monkeypatch.delenv("NEURON_TP_DEBUG", raising=False)
    argv = ["train", "--device", "cpu", "--steps", "1", "--output-dir", str(tmp_path / "o")]
    assert main([*argv, "--data", str(tmp_path / "nodata")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"neuron-tp train: error: --data '{tmp_path / 'nodata'}' does not exist"], err


def test_error_of_one_rank_alone_under_torchrun_is_printed(tmp_path):
    """A user error that only rank 1 hit, outside any agreement (rank 0 would wait in its next
    collective): rank 1 prints it, naming itself, and torchrun then stops rank 0."""
    script = tmp_path / "one_rank.py"
    script.write_text(
        "import os, sys, time\n"
        "from neuron_tp.cli.entry import user_error_exit\n"
        "from neuron_tp.errors import UserError\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(user_error_exit('train', UserError('only rank 1 failed')))\n"
        "time.sleep(60)\n"
    )
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    start = time.monotonic()
    proc = subprocess.run(
        [torchrun, "--nproc_per_node", "2", str(script)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0 and time.monotonic() - start < 100, text  # no 600 s wait
    assert text.count("neuron-tp train: error (rank 1): only rank 1 failed") == 1, text
