"""Ranks that disagree stop together with an error naming what differs
(neuron_tp.parallel.agreement).

One 2-rank gloo job tries many mismatches in sequence (each is raised on both ranks by the
same exchanges, so the ranks stay in step): training options that used to hang or train
silently apart, a rank that fails locally, ``parallelize`` with different weights or options,
replicas whose weights differ after sharding, ``from_pretrained`` with a truncated file on one
rank, generation options. The agreeing cases must pass (no false alarm, e.g. tp shards)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402

COMMON = ["--device", "cpu", "--seq-len", "32", "--micro-batch", "2", "--steps", "3", "--tp", "2"]
TRAIN_CASES = {  # option: (rank 0's extra arguments, rank 1's)
    "--sequence-parallel": ([], ["--sequence-parallel"]),
    "--seed": (["--seed", "0"], ["--seed", "1"]),
    "--lr": (["--lr", "1e-3"], ["--lr", "2e-3"]),
    "--model": (["--model", "tiny-llama"], ["--model", "tiny-gpt2"]),
    "--seq-len": (["--seq-len", "32"], ["--seq-len", "64"]),
    "--tp": (["--tp", "1"], ["--tp", "2"]),
    "--steps": (["--steps", "3"], ["--steps", "5"]),
    "--micro-batch": (["--micro-batch", "2"], ["--micro-batch", "4"]),
}


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the test inspects type and message
        return f"{type(e).__name__}: {e}"


def _job(tmp: str) -> None:
    import neuron_tp as ntp
    from neuron_tp.cli.args import generate_parser, train_parser
    from neuron_tp.infer.generate_command import run_cli
    from neuron_tp.job.presets import build_model
    from neuron_tp.parallel.agreement import check_agreement, check_model_replicas
    from neuron_tp.parallel.state import is_parallel
    from neuron_tp.train.loop import setup

    rank = torch.distributed.get_rank()
    res = {}

    def train_args(*extra):
        return train_parser().parse_args([*COMMON, "--output-dir", f"{tmp}/out", *extra])

    for option, per_rank in TRAIN_CASES.items():
        res[option] = _outcome(lambda: setup(train_args(*per_rank[rank])))
    bad_data = [[], ["--data", f"{tmp}/latin1"]][rank]
    res["local failure"] = _outcome(lambda: setup(train_args(*bad_data)))
    res["agreeing setup"] = _outcome(lambda: setup(train_args("--sequence-parallel")))

    mesh = ntp.init_mesh(tp=2)
    world = mesh.group("world")
    res["scope split"] = _outcome(
        lambda: check_agreement({"x": rank}, world, scopes={"x": [[0], [1]]})
    )
    res["scope whole"] = _outcome(lambda: check_agreement({"x": rank}, world))

    def parallelize(perturb: str | None = None, **kw):
        model = build_model("tiny-llama", 257, 0)
        if perturb and rank == 1:
            with torch.no_grad():
                model.get_parameter(perturb)[0] += 1e-3
        out = _outcome(lambda: ntp.parallelize(model, mesh, **kw))
        return out, is_parallel(model), model

    res["parallelize weights"] = parallelize("model.layers.1.mlp.down_proj.weight")[:2]
    res["parallelize options"] = parallelize(sequence_parallel=rank == 1)[:2]
    res["parallelize same"], _, model = parallelize()
    with torch.no_grad():  # after sharding: a replicated norm differs on rank 1
        if rank == 1:
            model.model.norm.weight[3] += 1e-3
    res["replicas norm"] = _outcome(lambda: check_model_replicas(model, mesh))

    dp_mesh = ntp.init_mesh(tp=1)  # dp=2: every parameter must be equal on both ranks
    model = ntp.parallelize(build_model("tiny-llama", 257, 0), dp_mesh)
    res["replicas same"] = _outcome(lambda: check_model_replicas(model, dp_mesh))
    with torch.no_grad():
        if rank == 1:
            model.model.layers[0].self_attn.k_proj.weight[1, 2] += 1e-3
    res["replicas weights"] = _outcome(lambda: check_model_replicas(model, dp_mesh))

    hf_dir = f"{tmp}/hf" if rank == 0 else f"{tmp}/hf-truncated"
    res["from_pretrained truncated"] = _outcome(lambda: ntp.from_pretrained(hf_dir, mesh))
    # same config and header, other (sharded) weights: only the files can tell
    hf_dir = f"{tmp}/hf" if rank == 0 else f"{tmp}/hf-other-weights"
    res["from_pretrained other weights"] = _outcome(lambda: ntp.from_pretrained(hf_dir, mesh))
    res["from_pretrained same"] = _outcome(lambda: ntp.from_pretrained(f"{tmp}/hf", mesh))

    gen = [
        "--device",
        "cpu",
        "--tp",
        "2",
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "2",
        "--seed",
        str(rank),
    ]
    res["generate --seed"] = _outcome(lambda: run_cli(generate_parser().parse_args(gen)))
    with open(f"{tmp}/agree-{rank}.json", "w") as fh:
        json.dump(res, fh)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[dict]:
    """Each rank's outcome of every case, from ONE 2-rank job (the cases run in sequence)."""
    from neuron_tp.job.presets import build_model

    tmp_path = tmp_path_factory.mktemp("agreement")
    build_model("tiny-llama", 257, 0).save_pretrained(tmp_path / "hf")
    (tmp_path / "hf-truncated").mkdir()
    for f in ("config.json", "model.safetensors"):
        data = (tmp_path / "hf" / f).read_bytes()
        cut = data if f == "config.json" else data[: len(data) // 2]
        (tmp_path / "hf-truncated" / f).write_bytes(cut)
    other = build_model("tiny-llama", 257, 0)
    with torch.no_grad():  # replicated parameters (the norms) stay equal
        other.model.layers[0].mlp.up_proj.weight.mul_(-1)
    other.save_pretrained(tmp_path / "hf-other-weights")
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "a.txt").write_bytes("café au lait\n".encode("latin-1") * 50)
    gloo_dist.run(_job, str(tmp_path), world_size=2)
    return [json.loads((tmp_path / f"agree-{k}.json").read_text()) for k in range(2)]


# how a rank words two options' values (rank whose message is checked, expected text)
OPTION_WORDING = {
    "--tp": (0, "--tp: rank 0: 1; rank 1: 2"),
    "--sequence-parallel": (1, "--sequence-parallel: rank 0: false; rank 1: true"),
}


@pytest.mark.parametrize("option", TRAIN_CASES)
def test_differing_train_option_raises_on_every_rank(outcomes, option):
    """Every rank raises, naming the option and both values."""
    r = outcomes
    for k in range(2):
        assert r[k][option].startswith("RankMismatchError"), (option, r[k][option])
        assert f"\n  {option}: rank 0: " in r[k][option], r[k][option]
        assert "rank 1: " in r[k][option]
    if option in OPTION_WORDING:
        k, text = OPTION_WORDING[option]
        assert text in r[k][option]


def test_local_failure_is_raised_on_every_rank(outcomes):
    """A local failure on rank 1: it raises its own error, rank 0 stops with it quoted."""
    r = outcomes
    assert r[1]["local failure"].startswith("UserError") and "a.txt" in r[1]["local failure"]
    assert r[0]["local failure"].startswith("RankMismatchError: neuron-tp train: rank 1 failed")
    assert "not UTF-8" in r[0]["local failure"]


def test_agreeing_ranks_pass_and_scopes(outcomes):
    for k in range(2):
        assert outcomes[k]["agreeing setup"] == "ok"
        assert outcomes[k]["scope split"] == "ok"
        assert "x: rank 0: 0; rank 1: 1" in outcomes[k]["scope whole"]


def test_parallelize_names_what_differs_and_leaves_the_model(outcomes):
    for k in range(2):  # the differing parameter is named, the model left unsharded
        out, sharded = outcomes[k]["parallelize weights"]
        assert out.startswith("RankMismatchError: parallelize(LlamaForCausalLM)") and not sharded
        assert "\n      model.layers.1.mlp.down_proj.weight: rank 0: " in out
        out, sharded = outcomes[k]["parallelize options"]
        assert "sequence_parallel: rank 0: false; rank 1: true" in out and not sharded
        assert outcomes[k]["parallelize same"] == "ok"


def test_replicas_that_differ_after_sharding(outcomes):
    for k in range(2):
        assert outcomes[k]["replicas same"] == "ok"
        assert "weights of replicated parameters (checksums)" in outcomes[k]["replicas norm"]
        assert "model.norm.weight" in outcomes[k]["replicas norm"]
        assert "model.layers.0.self_attn.k_proj.weight" in outcomes[k]["replicas weights"]


def test_generate_options(outcomes):
    for k in range(2):
        assert "--seed: rank 0: 0; rank 1: 1" in outcomes[k]["generate --seed"]


def test_from_pretrained_with_a_truncated_file_on_one_rank(outcomes):
    trunc = outcomes[1]["from_pretrained truncated"]
    assert trunc.startswith("UserError") and "hf-truncated/model.safetensors" in trunc
    assert "truncated" in trunc
    assert outcomes[0]["from_pretrained truncated"].startswith("RankMismatchError")
    assert "rank 1 failed" in outcomes[0]["from_pretrained truncated"]


def test_from_pretrained_with_other_weights_on_one_rank(outcomes):
    """Same config and safetensors header, other sharded weights: each rank reads only its
    own slices, so the files' sampled data checksums are what catches it."""
    for k in range(2):
        got = outcomes[k]["from_pretrained other weights"]
        assert got.startswith("RankMismatchError") and "model files" in got, got
        assert outcomes[k]["from_pretrained same"] == "ok"


def _xla_ranks() -> dict:
    """One XLA CPU device per rank (threads): the exchange runs as XLA all-gathers."""
    import neuron_tp as ntp
    from neuron_tp.job.presets import build_model
    from neuron_tp.parallel.agreement import check_agreement
    from xla_dist import serial

    mesh = ntp.init_mesh(tp=2)
    rank, world = mesh.rank, mesh.group("world")
    res = {
        "same": _outcome(lambda: check_agreement({"a": 1, "b": [2, "x"]}, world)),
        "differ": _outcome(
            lambda: check_agreement(
                {"a": 1, "lr": [1e-3, 2e-3][rank], "cfg": {"h": 64, "l": 2 + rank}},
                world,
                details={"cfg": {"h": 64, "l": 2 + rank}},
            )
        ),
        "failed": _outcome(
            lambda: check_agreement(
                {"a": 1}, world, error=ValueError("boom on 1") if rank == 1 else None
            )
        ),
    }
    with serial():  # the global RNG is shared by the threads
        model = build_model("tiny-llama", 257, 0)
    with torch.no_grad():
        model.model.norm.weight[rank] += 1e-3 * rank
    res["parallelize"] = _outcome(lambda: ntp.parallelize(model, mesh))
    return res


def test_agreement_on_xla_devices():
    import xla_dist

    ranks = xla_dist.run(_xla_ranks, devices=2, timeout=300)
    for r in ranks:
        assert r["same"] == "ok"
        assert "\n  lr: rank 0: 0.001; rank 1: 0.002" in r["differ"]
        assert "\n  cfg: rank 0 vs rank 1\n      l: rank 0: 2; rank 1: 3" in r["differ"]
        assert "model.norm.weight: rank 0: " in r["parallelize"]
    assert ranks[1]["failed"] == "ValueError: boom on 1"
    assert ranks[0]["failed"] == (
        "RankMismatchError: the job: rank 1 failed before the ranks "
        "could agree, so this rank stops too; rank 1: ValueError: "
        "boom on 1"
    )
