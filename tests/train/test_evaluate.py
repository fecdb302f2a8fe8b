"""Evaluation during training (neuron_tp.train.evaluate) and OUTPUT_DIR/metrics.jsonl, on gloo
ranks against plain transformers on the unsharded model: the eval loss of a tp=2 model with
dropout (eval mode) on masked batches, the token-weighted mean over dp ranks whose batches hold
different numbers of label tokens, and a tp=2 training run with --eval-data killed and resumed
(eval loss of the resumed run vs the reference model trained as long; metrics.jsonl = the runs'
logs, each step once). On 2 XLA CPU devices: a run with eval compiles its train graphs + 1, the
neuron_parallel_compile trial run compiles that graph too (training then compiles nothing new:
no recompilation per evaluation or per eval batch), host transfers only at eval/log steps.
Bad eval options: one clear error each, without any launch."""

from __future__ import annotations

import copy
import json
import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import xla_eval_cases  # noqa: E402

import gloo_dist  # noqa: E402
import xla_dist  # noqa: E402
from neuron_tp.cli.args import train_parser  # noqa: E402
from neuron_tp.errors import UserError  # noqa: E402
from neuron_tp.job.config import TrainConfig  # noqa: E402
from neuron_tp.job.data import ByteTokenizer  # noqa: E402
from neuron_tp.job.sft_data import load_data  # noqa: E402
from neuron_tp.parallel.mesh import Mesh  # noqa: E402
from neuron_tp.train.evaluate import eval_data, evaluation_totals  # noqa: E402
from packing_ref import LAYOUTS, packed_batch, samples  # noqa: E402
from reference_train import reference_run  # noqa: E402
from tiny_configs import nd_config  # noqa: E402

VOCAB, SEQ = 64, 16
COMMON = [
    "--device",
    "cpu",
    "--model",
    "tiny-llama",
    "--seq-len",
    "32",
    "--micro-batch",
    "2",
    "--warmup-steps",
    "3",
    "--lr",
    "3e-3",
    "--min-lr",
    "1e-4",
    "--max-grad-norm",
    "1.0",
]
EVAL_TEXT = "".join(f"evaluation line {i}: the quick brown fox {i * i % 97}.\n" for i in range(60))


class MaskedBatches:
    """Dict batches (the batch interface) of random ids with a share ``masked`` of -100
    labels; batch ``i`` of ``stream`` is the same in every process."""

    def __init__(self, stream: int, masked: float, micro_batch: int = 2):
        self.stream, self.masked, self.micro_batch, self.position = stream, masked, micro_batch, 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 * self.stream + self.position)
        self.position += 1
        ids = torch.randint(0, VOCAB, (self.micro_batch, SEQ), generator=g)
        labels = ids.clone()
        labels[torch.rand(ids.shape, generator=g) < self.masked] = -100
        return {"input_ids": ids, "labels": labels}


def reference_loss(model, batches: list[dict]) -> float:
    """The mean token loss of plain transformers (eval mode) over ``batches``."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"][:, 1:] != -100).sum())
            if n:
                total += float(model(input_ids=b["input_ids"], labels=b["labels"]).loss) * n
                count += n
    return total / count


def _models(dropout: float):
    import transformers as tf

    from neuron_tp import hf

    torch.manual_seed(0)
    ref = tf.LlamaForCausalLM(
        nd_config(vocab_size=VOCAB, attention_dropout=dropout, initializer_range=0.5)
    )
    sharded = copy.deepcopy(ref).train()
    mesh = gloo_dist.shared_mesh(2 if dropout else 1)
    hf.parallelize(sharded, mesh, parallel_loss=mesh.tp_size > 1)
    return ref, sharded, mesh


def _eval_loss(model, data, batches, mesh) -> float:
    loss_sum, count = evaluation_totals(model, data, batches, mesh, torch.device("cpu"))
    return float(loss_sum / count)


def _tp2_dropout(tmp: str) -> None:
    ref, model, mesh = _models(dropout=0.5)
    got = _eval_loss(model, MaskedBatches(0, 0.3), 3, mesh)
    same = MaskedBatches(0, 0.3)
    want = reference_loss(ref, [same.next_batch() for _ in range(3)])
    assert model.training, "the model must be back in train mode after an evaluation"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _dp2_token_mean(tmp: str) -> None:
    ref, model, mesh = _models(dropout=0.0)
    assert mesh.dp_size == 2
    shares = {0: 0.8, 1: 0.1}  # rank 0's batches hold far fewer label tokens than rank 1's
    got = _eval_loss(model, MaskedBatches(mesh.dp_rank, shares[mesh.dp_rank]), 2, mesh)
    every = [MaskedBatches(r, shares[r]) for r in (0, 1)]
    want = reference_loss(ref, [d.next_batch() for d in every for _ in range(2)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _train_args(tmp: str, eval_file: str, *extra: str):
    return train_parser().parse_args(
        [
            *COMMON,
            "--tp",
            "2",
            "--output-dir",
            os.path.join(tmp, "run"),
            "--eval-data",
            eval_file,
            "--eval-every",
            "2",
            "--eval-batches",
            "2",
            "--log-every",
            "3",
            "--save-every",
            "2",
            "--steps",
            "4",
            *extra,
        ]
    )


def _train_resume(tmp: str) -> None:
    from neuron_tp.train.loop import train

    mesh = gloo_dist.shared_mesh(2)
    eval_file = os.path.join(tmp, "eval.txt")
    if mesh.rank == 0:
        os.makedirs(tmp, exist_ok=True)
        with open(eval_file, "w") as f:
            f.write(EVAL_TEXT)
    torch.distributed.barrier()
    quiet = lambda *a, **k: None  # noqa: E731
    first = train(_train_args(tmp, eval_file), mesh, stop_at=3, printer=quiet)
    second = train(_train_args(tmp, eval_file), mesh, printer=quiet)
    assert [e["step"] for e in first["log"]] == [2, 3]  # eval step 2, log step 3
    assert [e["step"] for e in second["log"]] == [3, 4]  # resumed from step 2's checkpoint
    assert "eval_loss" in first["log"][0] and "eval_loss" not in first["log"][1]
    if mesh.rank == 0:
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        logged = [first["log"][0], *second["log"]]  # step 3 of the killed run was redone
        keys = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "eval_loss", "eval_perplexity")
        assert lines == [{k: e[k] for k in keys if k in e} for e in logged]
        for e in lines:
            if "eval_loss" in e:
                assert e["eval_perplexity"] == pytest.approx(math.exp(e["eval_loss"]))
        want = reference_eval(_train_args(tmp, eval_file), eval_file)
        torch.testing.assert_close(lines[-1]["eval_loss"], want, rtol=2e-4, atol=2e-4)


def reference_eval(args, eval_file: str, batches: int = 2) -> float:
    """The eval loss of the reference model trained ``--steps`` steps on the same data (global
    micro-batch 2), on the first ``batches`` batches of ``eval_file`` in file order."""
    reference_run(args, global_micro_batch=2)
    data = load_data(eval_file, ByteTokenizer(), args.seq_len, 2, shuffle=False)
    return reference_loss(reference_run.model, [data.next_batch() for _ in range(batches)])


class PackedBatches:
    """Packed dict batches (position_ids + segment_ids), a different packing each batch."""

    def __init__(self):
        self.position = 0

    def next_batch(self) -> dict[str, torch.Tensor]:
        layout = LAYOUTS["abc"[self.position % 3]]
        self.position += 1
        return packed_batch(layout, VOCAB, seed=self.position)


def _tp2_packed(tmp: str) -> None:
    """Packed eval batches: every sample scored as if alone (plain transformers, one sample at
    a time), the token-weighted mean over all of them."""
    ref, model, mesh = _models(dropout=0.5)
    got = _eval_loss(model, PackedBatches(), 3, mesh)
    same, total, count = PackedBatches(), 0.0, 0
    ref.eval()
    with torch.no_grad():
        for _ in range(3):
            for ids, labels in samples(same.next_batch()):
                logits, target = ref(input_ids=ids[None]).logits[0].float(), labels[1:]
                total += float(
                    torch.nn.functional.cross_entropy(
                        logits[:-1], target, ignore_index=-100, reduction="sum"
                    )
                )
                count += int((target != -100).sum())
    torch.testing.assert_close(got, total / count, rtol=1e-5, atol=1e-5)


def _check(case: str, tmp: str) -> None:
    {
        "tp2_dropout": _tp2_dropout,
        "tp2_packed": _tp2_packed,
        "dp2": _dp2_token_mean,
        "train_resume": _train_resume,
    }[case](os.path.join(tmp, case))


CASES = ("tp2_dropout", "tp2_packed", "dp2", "train_resume")


@pytest.fixture(scope="module")
def shared_tmp(tmp_path_factory):
    return str(tmp_path_factory.mktemp("evaluate"))


@pytest.mark.parametrize("case", CASES)
def test_evaluate_on_two_gloo_ranks(case, shared_tmp):
    gloo_dist.run_case(_check, case, shared_tmp, cases=CASES, world_size=2)


def _config(tmp_path, *extra: str) -> TrainConfig:
    return TrainConfig.from_args(
        train_parser().parse_args([*COMMON, "--output-dir", str(tmp_path), *extra])
    )


def test_bad_eval_options(tmp_path):
    ok = tmp_path / "eval.txt"
    ok.write_text(EVAL_TEXT)
    (tmp_path / "empty.txt").write_text("")
    tok, mesh = ByteTokenizer(), Mesh(1, 0, tp=1)
    cases = {
        ("--eval-every", "2"): "--eval-every / --eval-batches need --eval-data",
        ("--eval-data", str(ok)): "needs --eval-every N",
        ("--eval-data", str(tmp_path / "nope.txt"), "--eval-every", "2"): "does not exist",
        ("--eval-data", str(tmp_path / "empty.txt"), "--eval-every", "2"): "--eval-data: ",
        ("--eval-data", str(ok), "--eval-every", "2", "--eval-batches", "99"): "pass at most",
    }
    for extra, message in cases.items():
        with pytest.raises(UserError, match=message):
            eval_data(_config(tmp_path, *extra), tok, mesh)
    data = eval_data(_config(tmp_path, "--eval-data", str(ok), "--eval-every", "2"), tok, mesh)
    first = data.next_batch()["input_ids"]
    data.position = 0
    assert torch.equal(data.next_batch()["input_ids"], first)
    assert torch.equal(first[0], data.chunks[0])  # file order, not shuffled


def test_eval_on_two_xla_devices_one_graph(tmp_path):
    eval_file = tmp_path / "eval.txt"
    eval_file.write_text(EVAL_TEXT)
    res = xla_dist.run(xla_eval_cases.run_all, str(tmp_path), str(eval_file), devices=2)
    c = [n // 2 for n in res[0]["compiles"]]  # the process compiles every graph per device
    print("graphs after trial, trial+eval, train+eval:", c)
    assert c[2] - c[1] == 1, f"trial run with eval: {c[2] - c[1]} graphs more than without"
    assert c[3] - c[2] == 0, f"training with eval compiled {c[3] - c[2]} graph(s) the trial had not"
    logs = [r["results"]["train_eval"]["log"] for r in res]
    keys = ("step", "loss", "grad_norm", "eval_loss", "eval_tokens")
    assert [[e[k] for k in keys] for e in logs[0]] == [[e[k] for k in keys] for e in logs[1]]
    assert [e["step"] for e in logs[0]] == [2, 4] and all("eval_loss" in e for e in logs[0])
    per_step = res[0]["results"]["train_eval"]["per_step"]
    transfers = [s["transfers_to_host"] for s in per_step]  # after steps 1..4
    assert transfers[2] == transfers[1] < transfers[3], transfers  # none at step 3
    args = xla_eval_cases_args(tmp_path)
    want = reference_eval(args, str(eval_file))
    torch.testing.assert_close(logs[0][-1]["eval_loss"], want, rtol=2e-4, atol=2e-4)
    with open(tmp_path / "train_eval" / "metrics.jsonl") as f:
        lines = [json.loads(line) for line in f]
    assert [e["eval_loss"] for e in lines] == [e["eval_loss"] for e in logs[0]]


def xla_eval_cases_args(tmp_path):
    from xla_multi_train_cases import args_for

    return args_for(str(tmp_path / "ref"), "--tp", "2", *xla_eval_cases.BASE)
