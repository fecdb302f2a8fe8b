"""``neuron-tp train --cp N`` (context parallelism, ring attention) on gloo ranks and XLA CPU
devices: step by step the losses and grad norms of the independent unsharded reference
(transformers' sdpa on the full sequence, one process): --cp 2 with ZeRO-1 (the optimizer
state cut over dp x cp) and --eval-data (the eval loss of the reference model on the same
eval rows), --cp 2 --tp 2 with sequence parallelism, --cp 4, --cp 2 x dp 2 with ZeRO-1,
--pp 2 --cp 2 (pipeline stages around the ring), the long-context recipe's command, LoRA at
--cp 2 x tp 2 and at --cp 4 on 4 XLA CPU devices (against the unsharded peft model; the saved
adapter equal to its adapters; on XLA no compile after the second step); --bf16 (fp32
masters) at cp 2 equal to the dp 2 run of the same ZeRO-1 layout, whose checkpoint files it
resumes; a --cp 2 ZeRO-1 checkpoint resumes at --cp 1; packed prompt/completion rows
(answer-only loss, --eval-data of them too) at --cp 2 --tp 2 and at --pp 2 --cp 2 equal to
--tp 2 (x dp 2) on gloo, and (cp 2 x tp 2 with ZeRO-1) on 4 XLA CPU devices; refusals naming
what works."""

from __future__ import annotations

import math
import os
import sys
from typing import NamedTuple

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import xla_cp_cases as cases  # noqa: E402
from xla_multi_train_cases import args_for  # noqa: E402

import gloo_dist  # noqa: E402
import xla_dist  # noqa: E402
from neuron_tp.errors import UserError  # noqa: E402
from neuron_tp.job.config import TrainConfig  # noqa: E402
from neuron_tp.job.data import ByteTokenizer  # noqa: E402
from neuron_tp.job.layout_rules import job_refusals  # noqa: E402
from neuron_tp.job.sft_data import load_data  # noqa: E402
from neuron_tp.parallel.mesh import Mesh  # noqa: E402
from reference_train import reference_run  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cp_train"))


EVAL_TEXT = "".join(f"held-out line {i}: a lazy dog sleeps {i * 7 % 31} h.\n" for i in range(40))
EVAL = ["--eval-every", "4", "--eval-batches", "2"]


class Ref(NamedTuple):
    losses: list[float]
    norms: list[float]
    eval_loss: float = math.nan


@pytest.fixture(scope="module")
def ref(base) -> Ref:
    """The unsharded reference on cases.CP's data, and its eval loss after the last step on
    the first 2 batches of 2 rows of ``eval.txt``."""
    with open(f"{base}/eval.txt", "w") as f:
        f.write(EVAL_TEXT)
    losses, norms = reference_run(args_for(f"{base}/ref", *cases.CP), global_micro_batch=2)
    data = load_data(f"{base}/eval.txt", ByteTokenizer(), 256, 2, shuffle=False)
    batches = [data.next_batch() for _ in range(2)]
    return Ref(losses, norms, _reference_eval(reference_run.model, batches))


def _reference_eval(model, batches: list[dict]) -> float:
    """The mean token loss of the trained reference (eval mode) over ``batches``."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"][:, 1:] != -100).sum())
            total += float(model(input_ids=b["input_ids"], labels=b["labels"]).loss) * n
            count += n
    return total / count


def _check(log, ref: Ref, steps=slice(None)):
    losses, norms = ref.losses, ref.norms
    torch.testing.assert_close([e["loss"] for e in log], losses[steps], rtol=2e-4, atol=2e-4)
    torch.testing.assert_close([e["grad_norm"] for e in log], norms[steps], rtol=2e-3, atol=1e-5)


def _gloo(base: str, name: str, tp: int, cp: int, extra: tuple) -> None:
    from neuron_tp.train.loop import train

    pp = int(extra[extra.index("--pp") + 1]) if "--pp" in extra else 1
    mesh = gloo_dist.shared_mesh(tp, cp=cp, pp=pp)
    args = args_for(f"{base}/{name}", "--tp", str(tp), "--cp", str(cp), *cases.CP, *extra)
    args.device = "cpu"
    s = train(args, mesh, printer=lambda *a, **k: None)
    if mesh.rank == 0:
        torch.save(s["log"], f"{base}/{name}.pt")


LORA = cases.LORA

# name: (tp, cp, extra options); every one runs on tp x cp x dp gloo ranks, global batch 2
GLOO = {
    "cp2-zero1-eval": (1, 2, ("--zero1", "--eval-data", "{base}/eval.txt", *EVAL)),
    "cp2-tp2-sp": (2, 2, ("--sequence-parallel",)),
}
FOUR = {
    "cp4": (1, 4, ()),
    "cp2-dp2-zero1": (1, 2, ("--micro-batch", "1", "--zero1")),
    "recipe": (2, 2, tuple(cases.recipe_options()[1:])),  # the long-context recipe's options
    "cp2-tp2-lora": (2, 2, tuple(LORA)),
    "pp2-cp2": (1, 2, ("--pp", "2", "--micro-batch", "1", "--grad-accum", "2")),
}
# packed prompt/completion rows (answer-only loss) at cp 2 x tp 2 against tp 2 x dp 2 (global
# batch 2 both), eval on packed rows too; compared with each other (the reference run of
# reference_train does not pack)
SFT = ("--data", cases.SFT_DATA, "--steps", "2", "--seq-len", "128", "--attention-block", "32")
SFT += ("--eval-data", cases.SFT_DATA)
SFT += ("--eval-every", "2", "--eval-batches", "1")
PACKED = {
    "cp2-tp2-packed": (2, 2, (*SFT, "--sequence-parallel")),
    "tp2-dp2-packed": (2, 1, (*SFT, "--micro-batch", "1")),
    # at cp 1: blockwise attention masks the rows by segment ids (no [b, 1, s, s] mask)
    "tp2-dp2-packed-blockwise": (2, 1, (*SFT, "--micro-batch", "1", "--attention", "blockwise")),
    # pipeline stages around the ring: 2 micro-batches of 1 row (2 eval batches: the same rows)
    "pp2-cp2-packed": (
        1,
        2,
        (*SFT, "--pp", "2", "--micro-batch", "1", "--grad-accum", "2", "--eval-batches", "2"),
    ),
}
LAUNCH = [*FOUR, *PACKED]


@pytest.mark.parametrize("name", list(GLOO))
def test_cp2_trains_like_one_rank_on_gloo(base, ref, name):
    tp, cp, extra = GLOO[name]
    extra = tuple(e.format(base=base) for e in extra)
    gloo_dist.run(_gloo, base, name, tp, cp, extra, world_size=tp * cp)
    log = torch.load(f"{base}/{name}.pt")
    _check(log, ref)
    if "--eval-data" in extra:  # the mean over every label token of the eval rows
        assert [e["step"] for e in log if "eval_loss" in e] == [4]
        torch.testing.assert_close(log[-1]["eval_loss"], ref.eval_loss, rtol=2e-4, atol=2e-4)


def _four(name: str, base: str) -> None:
    _gloo(base, name, *{**FOUR, **PACKED}[name])


@pytest.fixture(scope="module")
def recipe_ref(base) -> Ref:
    """The unsharded reference of examples/long-context/README.md's command."""
    _, *options = cases.recipe_options()
    assert ["--cp", "2"] == options[options.index("--cp") :][:2]
    return Ref(*reference_run(args_for(f"{base}/recipe-ref", *options), global_micro_batch=2))


class LoraRef(NamedTuple):
    ref: Ref
    adapter: dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def lora_ref(base) -> LoraRef:
    """The unsharded peft model (adapters from the same --seed) on cases.CP's data, and its
    adapter weights after the last step (peft's state-dict names)."""
    from peft import get_peft_model_state_dict

    losses, norms = reference_run(args_for(f"{base}/lora-ref", *cases.CP, *LORA), 2)
    return LoraRef(Ref(losses, norms), get_peft_model_state_dict(reference_run.model))


@pytest.mark.parametrize("name", list(FOUR))
def test_cp4_cp2_dp2_lora_and_the_recipe_train_like_one_rank_on_gloo(
    base, ref, recipe_ref, lora_ref, name
):
    """LoRA at cp 2 x tp 2: the adapters train like the unsharded peft model's and are saved
    once (rank 0), equal to the reference's."""
    gloo_dist.run_case(_four, name, base, cases=LAUNCH, world_size=4)
    want = {"recipe": recipe_ref, "cp2-tp2-lora": lora_ref.ref}.get(name, ref)
    _check(torch.load(f"{base}/{name}.pt"), want)
    if name == "cp2-tp2-lora":
        from safetensors.torch import load_file

        saved = load_file(f"{base}/{name}/adapter/adapter_model.safetensors")
        assert sorted(saved) == sorted(lora_ref.adapter) and len(saved) == 2 * 3 * 2  # 2 layers
        for k, w in lora_ref.adapter.items():
            torch.testing.assert_close(saved[k], w, atol=1e-5, rtol=1e-4, msg=k)


def _packed_log(base: str, name: str) -> list[dict]:
    gloo_dist.run_case(_four, name, base, cases=LAUNCH, world_size=4)
    return torch.load(f"{base}/{name}.pt")


def _same_run(log, want, keys=("loss", "grad_norm", "eval_loss")):
    def values(entries):
        return [[e.get(k, math.nan) for k in keys] for e in entries]

    assert [e["step"] for e in log if "eval_loss" in e] == ([2] if "eval_loss" in keys else [])
    torch.testing.assert_close(values(log), values(want), rtol=2e-4, atol=2e-4, equal_nan=True)


@pytest.mark.parametrize("name", ["cp2-tp2-packed", "pp2-cp2-packed", "tp2-dp2-packed-blockwise"])
def test_packed_rows_by_segment_ids_train_like_the_4d_mask_on_gloo(base, name):
    """Packed rows cross the ring: the block-diagonal mask by segment ids in every tile,
    positions restarting per sample, the loss over the completions of the global batch; also
    inside pipeline stages (each stage its part of the ring, the targets split on the last),
    and at cp 1 under blockwise attention; all equal to sdpa given the 4D mask (tp 2 x dp 2)."""
    want = _packed_log(base, "tp2-dp2-packed")
    _same_run(_packed_log(base, name), want)


@pytest.fixture(scope="module")
def on_xla4(base) -> xla_dist.Cases:
    return xla_dist.run_cases(cases.on_devices, ["cp4-lora", "packed"], base, devices=4)


def test_cp4_lora_on_xla_trains_like_the_unsharded_peft_model(on_xla4, base, lora_ref):
    """A ring of 4 XLA CPU devices (3 hops a layer, the chunk pair picked by the device-side
    rank) with LoRA: every step's loss and norm those of the unsharded peft model, the adapter
    saved once and equal to its adapters, nothing compiled after the second step."""
    from safetensors.torch import load_file

    got = on_xla4.get("cp4-lora")
    _check(got[0]["log"], lora_ref.ref)
    saved = load_file(f"{base}/xla-cp4-lora/adapter/adapter_model.safetensors")
    assert sorted(saved) == sorted(lora_ref.adapter)
    for k, w in lora_ref.adapter.items():
        torch.testing.assert_close(saved[k], w, atol=1e-5, rtol=1e-4, msg=k)
    compiles = [p["compiles"] // 4 for p in got[0]["per_step"]]  # process-wide / 4 ranks
    assert len(compiles) == 4 and compiles[1:] == [compiles[1]] * 3, compiles


def test_packed_rows_at_cp2_tp2_on_xla_train_like_tp2_on_gloo(on_xla4, base):
    """The same packed run on 4 XLA CPU devices (segment chunks picked by the device-side
    rank), with ZeRO-1 (its state cut over the 2 cp ranks), equal to the gloo tp 2 x dp 2
    run."""
    want = _packed_log(base, "tp2-dp2-packed")
    _same_run(on_xla4.get("packed")[0]["log"], want, ("loss", "grad_norm"))


STEP2 = "bf16-cp2/checkpoints/step-00000002"


def _bf16(base: str) -> None:
    """--bf16 (ZeRO-1, fp32 masters) at cp 2 (state cut over the 2 cp ranks), saved at step 2;
    the dp 2 run (state cut over the 2 dp ranks: the same layout); and the dp 2 run resumed
    from the cp 2 run's step-2 checkpoint (each rank reads its own shard file)."""
    import neuron_tp as ntp
    from neuron_tp.train.loop import train

    bf16 = ("--bf16", "--reduce-dtype", "fp32")
    runs = {
        "cp2": (2, ("--cp", "2", "--save-every", "2")),
        "dp2": (1, ("--micro-batch", "1")),
        "dp2-resumed": (1, ("--micro-batch", "1", "--resume", f"{base}/{STEP2}")),
    }
    logs = {}
    for name, (cp, extra) in runs.items():
        mesh = ntp.init_mesh(cp=cp, reduce_dtype=torch.float32)
        args = args_for(f"{base}/bf16-{name}", *cases.CP, *bf16, *extra)
        args.device = "cpu"
        logs[name] = train(args, mesh, printer=lambda *a, **k: None)["log"]
    if mesh.rank == 0:
        torch.save(logs, f"{base}/bf16.pt")


def test_bf16_at_cp2_equals_dp2_and_its_checkpoint_resumes_at_dp2(base):
    gloo_dist.run(_bf16, base, world_size=2)
    logs = torch.load(f"{base}/bf16.pt")
    step2 = f"{base}/{STEP2}"
    assert os.path.exists(f"{step2}/optim-tp00000-dp00001.safetensors")  # cut over cp
    assert [e["step"] for e in logs["dp2-resumed"]] == [3, 4]
    cp2, dp2, resumed = (logs[k] for k in ("cp2", "dp2", "dp2-resumed"))
    # bf16 compute: ring attention and sdpa round differently (measured: 1e-4 of a ~5 loss)
    for got, want in ((cp2, dp2), (resumed, cp2[2:])):
        torch.testing.assert_close(
            [e["loss"] for e in got], [e["loss"] for e in want], rtol=0, atol=1e-3
        )
        torch.testing.assert_close(
            [e["grad_norm"] for e in got], [e["grad_norm"] for e in want], rtol=2e-3, atol=0
        )
    assert cp2[-1]["loss"] < cp2[0]["loss"] - 0.5


def _save_cp2(out: str) -> None:
    from neuron_tp.train.loop import train

    mesh = gloo_dist.shared_mesh(1, cp=2)
    args = args_for(out, "--cp", "2", "--zero1", *cases.CP)
    args.device, args.save_every, args.steps = "cpu", 2, 2
    train(args, mesh, printer=lambda *a, **k: None)


def _resume_cp1(out: str, log_path: str) -> None:
    from neuron_tp.train.loop import train

    args = args_for(out, "--zero1", *cases.CP)
    args.device, args.resume = "cpu", "auto"
    s = train(args, gloo_dist.shared_mesh(1), printer=lambda *a, **k: None)
    torch.save(s["log"], log_path)


def test_cp2_zero1_checkpoint_resumes_at_cp1(base, ref):
    out = f"{base}/resume"
    gloo_dist.run(_save_cp2, out, world_size=2)
    gloo_dist.run(_resume_cp1, out, f"{base}/resume.pt", world_size=1)
    _check(torch.load(f"{base}/resume.pt"), ref, slice(2, None))


def _config(*extra: str) -> TrainConfig:
    return TrainConfig.from_args(args_for("/tmp/unused", *extra))


def _check_cp(config: TrainConfig) -> None:
    why = job_refusals(config)
    if why:
        raise UserError("; ".join(why))


def test_refusals_name_what_works():
    with pytest.raises(UserError, match="multiple of 2 x cp = 4"):
        _check_cp(_config("--cp", "2", "--seq-len", "250"))
    with pytest.raises(UserError, match="multiple of 16"):
        _check_cp(_config("--cp", "2", "--tp", "4", "--seq-len", "260", "--sequence-parallel"))
    with pytest.raises(UserError, match="--ep yet; it works with --tp.*ZeRO-1.*LoRA.*--eval-data"):
        _check_cp(_config("--cp", "2", "--seq-len", "256", "--zero1", "--ep", "2"))
    _check_cp(_config("--cp", "2", "--seq-len", "256", "--zero1", "--lora-r", "4"))  # accepted
    _check_cp(_config("--cp", "2", "--seq-len", "256", "--zero1", "--bf16"))  # accepted
    with pytest.raises(UserError, match="pp x cp must divide 3"):
        Mesh(6, 0, tp=2, cp=2)
