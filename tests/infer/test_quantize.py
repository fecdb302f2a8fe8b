"""Weight-only int8 (``--quantize int8``, :mod:`neuron_tp.layers.quantized`).

The reference is built independently, with plain torch: the unsharded transformers model whose
Linear weights (all but the LM head) are replaced by ``dequantize(quantize(W))`` (per-row
absmax / 127, round, clamp to +-127), in fp32. On gloo ranks at tp 2 and tp 4 (tp 4 replicates
the tiny Llama's 2 kv heads over ranks):

- per layer, a quantized column shard and a quantized row shard (dequantized) are bit-equal to
  the matching slice of the reference weight (a row shard's scales are the FULL row's);
- the quantized parallel model's logits equal the reference's to fp32 rounding (the row-parallel
  reduction sums partial products in another order than one matmul, so not bit-exact; the same
  holds without quantization), while they differ from the unquantized model's by much more;
- greedy tokens equal transformers' ``generate`` on the reference, and ``neuron-tp generate
  --quantize int8`` prints the reference's text.

On 2 XLA CPU devices (xla_quantize_cases.py): logits vs the same reference, decode without a
recompile after the first decode step, the quantized layers hold int8 on the device, and the
traced HLO of a bf16 forward reads the linears' weights as int8 (bytes counted from the
graph's parameters).
"""

from __future__ import annotations

import copy
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import gloo_dist  # noqa: E402
import neuron_tp as ntp  # noqa: E402
from int8_reference import dq_reference, reference_model  # noqa: E402

HERE = os.path.dirname(__file__)
REPO = os.path.dirname(os.path.dirname(HERE))
PROMPTS = [[72, 101, 108], [84, 104, 101, 32, 111, 108, 100], list(range(97, 108))]


def _layers(mesh) -> dict:
    """Per-layer bit-exactness of a quantized column and row shard (at this tp)."""
    from neuron_tp.layers.quantized import quantize_int8

    torch.manual_seed(3)
    lin = torch.nn.Linear(64, 24, bias=True)
    with torch.no_grad():  # rows with very different ranges: a shard's max is not the row's
        lin.weight.mul_(torch.logspace(-2, 1, 64))
    full = dq_reference(lin.weight)
    tp, r = mesh.tp_size, mesh.tp_rank
    col = torch.nn.Sequential(ntp.ColumnParallelLinear.from_linear(lin, mesh))
    row = torch.nn.Sequential(ntp.RowParallelLinear.from_linear(lin, mesh))
    quantize_int8(col, mesh)
    quantize_int8(row, mesh)
    c, w = col[0], row[0]
    rows, cols = 24 // tp, 64 // tp
    return {
        "col_int8": c.qweight.dtype == torch.int8 and "weight" not in c._parameters,
        "col_exact": torch.equal(c.weight, full[r * rows : (r + 1) * rows]),
        "row_exact": torch.equal(w.weight, full[:, r * cols : (r + 1) * cols]),
    }


def _run(tmp: str, tp: int) -> None:
    from neuron_tp import hf
    from neuron_tp.cli.args import generate_parser
    from neuron_tp.infer.generate_command import run_cli
    from neuron_tp.infer.static_generator import generate
    from neuron_tp.job.presets import build_model
    from neuron_tp.layers.quantized import Int8WeightLinear, quantize_int8

    mesh = ntp.init_mesh(tp=tp)
    res = _layers(mesh)
    full = build_model("tiny-llama", 257, 4).eval()
    ref = reference_model(full).eval()
    model = quantize_int8(hf.parallelize(copy.deepcopy(full), mesh), mesh).eval()
    names = [n for n, m in model.named_modules() if isinstance(m, Int8WeightLinear)]
    res["quantized"] = sorted(names)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        got, want, plain = (m(ids).logits for m in (model, ref, full))
    res["err_ref"] = (got - want).abs().max().item()
    res["err_unquantized"] = (got - plain).abs().max().item()
    res["greedy"] = generate(model, PROMPTS, 10, [16])
    res["ref_greedy"] = [
        ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    if tp == 2:  # the CLI path: a saved HF directory loaded slice by slice, then quantized
        hf.save_pretrained(hf.parallelize(copy.deepcopy(full), mesh), f"{tmp}/model")
        torch.distributed.barrier()
        argv = ["--device", "cpu", "--tp", str(tp), "--model", f"{tmp}/model"]
        argv += ["--tokenizer", "bytes", "--prompt", "The old", "--max-new-tokens", "6"]
        argv += ["--buckets", "8", "--quantize", "int8"]
        res["cli"] = run_cli(generate_parser().parse_args(argv))
        out = generate(ref, [list(b"The old")], 6, [8], eos_ids=[256])
        res["cli_ref"] = [bytes(t for t in o if t < 256).decode("utf-8", "replace") for o in out]
    with open(f"{tmp}/q-{mesh.rank}.json", "w") as fh:
        json.dump(res, fh)


@pytest.mark.parametrize("tp", [2, 4])
def test_quantized_parallel_model_matches_reference(tmp_path, tp):
    gloo_dist.run(_run, str(tmp_path), tp, world_size=tp)
    reps = [json.loads((tmp_path / f"q-{r}.json").read_text()) for r in range(tp)]
    print({k: reps[0][k] for k in ("err_ref", "err_unquantized")})
    for rep in reps:
        assert rep["col_int8"] and rep["col_exact"] and rep["row_exact"]
        assert rep["err_ref"] < 1e-5, rep["err_ref"]
        assert rep["err_unquantized"] > 100 * max(rep["err_ref"], 1e-7)
        assert rep["greedy"] == rep["ref_greedy"]
    names = reps[0]["quantized"]
    assert len(names) == 2 * 7 and not any("lm_head" in n or "embed" in n for n in names)
    assert all(r["greedy"] == reps[0]["greedy"] for r in reps)
    if tp == 2:
        assert reps[0]["cli"] == reps[0]["cli_ref"]


def test_refusals():
    from neuron_tp.errors import UserError
    from neuron_tp.job.presets import build_model

    full = build_model("tiny-llama", 257, 4)
    with pytest.raises(UserError, match="no column/row-parallel linear"):
        ntp.quantize(full)  # not parallelized: nothing to quantize
    with pytest.raises(UserError, match="fp8"):
        ntp.quantize(full, dtype="fp8")


def test_xla_two_devices_logits_no_recompile_and_int8_checkpoint_at_tp1(tmp_path):
    from xla_quantize_cases import quantized_rank

    import xla_dist

    reps = xla_dist.run(quantized_rank, 2, PROMPTS, str(tmp_path / "int8"), devices=2)
    for rep in reps:  # the int8 checkpoint saved at tp 2 on the devices, loaded at tp 1
        err = (rep["tp1_logits"] - rep["logits"]).abs().max().item()
        print(f"XLA: int8 checkpoint saved at tp 2, loaded at tp 1: max |logits diff| {err:.2e}")
        assert err < 1e-5 and rep["tp1_int8"], (err, rep["tp1_int8"])
    print([{k: r[k] for k in ("err_ref", "err_unquantized", "compiles_after_first")} for r in reps])
    for rep in reps:
        assert rep["int8_on_device"]
        assert rep["err_ref"] < 1e-4, rep["err_ref"]
        assert rep["err_unquantized"] > 10 * rep["err_ref"]
        assert rep["tokens"] == rep["ref_tokens"] and rep["tokens_prefix"]
        # 12 tokens after 4: no new graph (the decode graph compiled in the first call)
        assert rep["compiles_after_more_tokens"] == rep["compiles_after_first"]
        # the HLO of a bf16 forward reads its linears as int8 (+ a bf16 scale per row): at
        # most 0.55x the bytes of the same graph unquantized, and no bf16 copy of them
        assert rep["int8_dtypes"] == ["bf16", "s8"] and rep["bf16_dtypes"] == ["bf16"], rep
        ratio = rep["linear_bytes_int8"] / rep["linear_bytes_bf16"]
        print(f"linear weight bytes read per forward: int8 / bf16 = {ratio:.3f}")
        assert 0.5 < ratio <= 0.55, rep


def test_flag_on_generate_and_serve():
    from neuron_tp.cli.args import generate_parser, serve_parser
    from neuron_tp.job.config import GenerateConfig, ServeConfig

    gen = GenerateConfig.from_args(generate_parser().parse_args(["--model", "tiny-llama"]))
    assert gen.quantize == "none"
    argv = ["--model", "tiny-llama", "--quantize", "int8"]
    assert ServeConfig.from_args(serve_parser().parse_args(argv)).generate_config().quantize == (
        "int8"
    )
    with pytest.raises(SystemExit):
        generate_parser().parse_args(["--model", "tiny-llama", "--quantize", "fp8"])
    assert "--quantize" in serve_parser().format_help()


def _check_int8_checkpoint(reps: list[dict]) -> None:
    """Loaded at tp 4 and 1: the tp-2 model's logits (fp32 rounding) and greedy tokens, the
    independent reference's logits, and int8 weights only (14 layers: 7 linears x 2 blocks)."""
    for rep in reps:
        logits2, greedy2 = rep["tp2"]
        for tp in (4, 1):
            logits, greedy = rep[f"tp{tp}"]
            err = (logits - logits2).abs().max().item()
            print(f"int8 checkpoint saved at tp 2, loaded at tp {tp}: max |logits diff| {err:.2e}")
            assert err < 1e-5, (tp, err)
            assert (logits - rep["ref"]).abs().max().item() < 1e-4
            assert greedy == greedy2, (tp, greedy, greedy2)
            layout = rep[f"layout{tp}"]
            assert layout["int8_layers"] == 14 and layout["all_int8"], layout
            assert layout["float_params_ok"], layout


def _int8_gloo(tmp: str) -> None:
    from int8_ckpt_cases import consolidated_int8, int8_checkpoint

    from neuron_tp.cli.args import generate_parser
    from neuron_tp.errors import UserError
    from neuron_tp.infer.generate_command import run_cli

    res = int8_checkpoint(f"{tmp}/int8", PROMPTS)
    argv = ["--device", "cpu", "--tp", "4", "--model", f"{tmp}/int8", "--tokenizer", "bytes"]
    argv += ["--prompt", "The old", "--max-new-tokens", "6", "--buckets", "8"]
    res["cli"] = run_cli(generate_parser().parse_args(argv))  # --quantize none: stays int8
    try:
        ntp.from_pretrained(f"{tmp}/int8", ntp.init_mesh(tp=4, tp_mode="2d"))
    except UserError as e:
        res["refusal_2d"] = str(e)
    res["consolidate"] = consolidated_int8(tmp, PROMPTS)
    torch.save(res, f"{tmp}/int8-{torch.distributed.get_rank()}.pt")


def test_int8_checkpoint_saved_at_tp2_loads_at_tp4_and_tp1_gloo(tmp_path):
    from neuron_tp.infer.static_generator import generate
    from neuron_tp.job.presets import build_model

    gloo_dist.run(_int8_gloo, str(tmp_path), world_size=4)
    reps = [torch.load(tmp_path / f"int8-{r}.pt") for r in range(4)]
    _check_int8_checkpoint(reps)
    cfg = json.loads((tmp_path / "int8" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "neuron_tp" and cfg["modules_to_not_convert"] == ["lm_head"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "int8" / "model.safetensors"), "pt") as f:
        q = f.get_slice("model.layers.0.mlp.down_proj.weight")
        s = f.get_slice("model.layers.0.mlp.down_proj.weight_scale")
        assert (q.get_dtype(), q.get_shape(), s.get_dtype(), s.get_shape()) == (
            "I8",
            [64, 176],
            "F32",
            [64],
        )
    ref = reference_model(build_model("tiny-llama", 257, 4).eval()).eval()
    out = generate(ref, [list(b"The old")], 6, [8], eos_ids=[256])
    want = [bytes(t for t in o if t < 256).decode("utf-8", "replace") for o in out]
    assert reps[0]["cli"] == want
    assert "tp_mode '1d'" in reps[0]["refusal_2d"]
    _check_consolidated([r["consolidate"] for r in reps], tmp_path)


def _check_consolidated(reps: list[dict], tmp_path) -> None:
    """``neuron-tp consolidate --quantize int8`` of a training checkpoint and of a float HF
    directory, loaded at tp 2: the int8 weights and scales of ``ntp.quantize`` of the float
    model at tp 2, bit for bit, and its logits (the independent reference's to fp32 rounding);
    an int8 source refused (status 2)."""
    assert (reps[0]["rc_run"], reps[0]["rc_float"], reps[0]["rc_int8_src"]) == (0, 0, 2)
    for rep in reps:
        for src in ("run", "float"):
            got, want = rep[f"int8_{src}"], rep["want_int8"]
            assert sorted(got) == sorted(want) and len(want) == 2 * 2 * 7, sorted(got)
            assert all(torch.equal(got[k], want[k]) for k in want), src
            err = (rep[f"logits_{src}"] - rep["want"]).abs().max().item()
            print(f"consolidate --quantize int8 ({src}) at tp 2 vs ntp.quantize: {err:.2e}")
            assert err < 1e-6, (src, err)
            assert (rep[f"logits_{src}"] - rep["ref"]).abs().max().item() < 1e-4
    cfg = json.loads((tmp_path / "c-run" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "neuron_tp" and cfg["modules_to_not_convert"] == ["lm_head"]
    assert not (tmp_path / "x").exists() and not (tmp_path / "c-run.tmp-float").exists()


def test_int8_checkpoint_refusals(tmp_path):
    from neuron_tp.errors import UserError
    from neuron_tp.job.presets import model_config

    cfg = model_config("tiny-llama", 257)
    cfg.quantization_config = {"quant_method": "gptq", "bits": 4}
    cfg.save_pretrained(tmp_path / "gptq")
    with pytest.raises(UserError, match="quant_method 'gptq'"):
        ntp.from_pretrained(str(tmp_path / "gptq"), ntp.Mesh(world_size=1, rank=0, tp=1))
    cfg.quantization_config = {"quant_method": "neuron_tp", "quantization_dtype": "int4"}
    cfg.save_pretrained(tmp_path / "int4")
    with pytest.raises(UserError, match="int4"):
        ntp.from_pretrained(str(tmp_path / "int4"), ntp.Mesh(world_size=1, rank=0, tp=1))
