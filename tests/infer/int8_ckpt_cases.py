"""The int8 checkpoint format on 4 gloo ranks, used by test_quantize.py: the tiny Llama
quantized at tp 2 and saved, then loaded at tp 4 and tp 1 (the XLA tier:
xla_quantize_cases.py)."""

from __future__ import annotations

import copy

import torch

import neuron_tp as ntp
from int8_reference import reference_model


def _outputs(model, ids, prompts) -> tuple[torch.Tensor, list]:
    from neuron_tp.infer.static_generator import generate

    with torch.no_grad():
        logits = model(ids).logits
    return logits, generate(model, prompts, 6, [16])


def _int8_layout(model) -> dict:
    """Whether the loaded model holds int8 weights only: no float weight on a converted
    layer, every float parameter an embedding, a norm or the LM head."""
    from neuron_tp.layers.quantized import Int8WeightLinear

    layers = [m for m in model.modules() if isinstance(m, Int8WeightLinear)]
    floats = [n for n, _ in model.named_parameters()]
    return {
        "int8_layers": len(layers),
        "all_int8": all(
            m.qweight.dtype == torch.int8 and "weight" not in m._parameters for m in layers
        ),
        "float_params_ok": all(("embed" in n or "norm" in n or "lm_head" in n) for n in floats),
    }


def int8_checkpoint(out: str, prompts: list[list[int]]) -> dict:
    """One rank: quantize at tp 2 (dp 2), save ``out``; load it at tp 4 and at tp 1; the
    logits and greedy tokens of each, and of the independent reference (rank-local, fp32)."""
    from neuron_tp import hf
    from neuron_tp.job.presets import build_model
    from neuron_tp.layers.quantized import quantize_int8

    full = build_model("tiny-llama", 257, 4).eval()
    ref = reference_model(full).eval()
    saved = copy.deepcopy(full)
    mesh2 = ntp.init_mesh(tp=2)
    saved = quantize_int8(hf.parallelize(saved, mesh2), mesh2).eval()
    ids = torch.tensor([prompts[-1]])
    res = {"tp2": _outputs(saved, ids, prompts)}
    hf.save_pretrained(saved, out)
    for tp in (4, 1):
        mesh = ntp.init_mesh(tp=tp)
        model = hf.from_pretrained(out, mesh)
        res[f"tp{tp}"] = _outputs(model, ids, prompts)
        res[f"layout{tp}"] = _int8_layout(model)
    with torch.no_grad():
        res["ref"] = ref(ids).logits
    return res


def _int8_state(model) -> dict[str, torch.Tensor]:
    from neuron_tp.layers.quantized import Int8WeightLinear

    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Int8WeightLinear):
            out[f"{name}.q"], out[f"{name}.s"] = mod.qweight.clone(), mod.weight_scale.clone()
    return out


def consolidated_int8(tmp: str, prompts: list[list[int]]) -> dict:
    """One rank: the tiny Llama saved at tp 2 as a training checkpoint and as a float HF
    directory; rank 0 runs ``neuron-tp consolidate --quantize int8`` on each; every rank loads
    both int8 directories at tp 2. Their logits and int8 layers, and those of
    ``ntp.quantize`` of the float model at tp 2 (plus the refusal of an int8 source)."""
    from neuron_tp import checkpoint, hf
    from neuron_tp.cli.entry import main
    from neuron_tp.job.presets import build_model
    from neuron_tp.layers.quantized import quantize_int8

    full = build_model("tiny-llama", 257, 4).eval()
    mesh = ntp.init_mesh(tp=2)
    checkpoint.save(f"{tmp}/run", hf.parallelize(copy.deepcopy(full), mesh), step=1, mesh=mesh)
    hf.save_pretrained(hf.parallelize(copy.deepcopy(full), mesh), f"{tmp}/float", mesh)
    res: dict = {}
    if mesh.rank == 0:
        for src in ("run", "float"):
            argv = ["consolidate", "--quantize", "int8", f"{tmp}/{src}", f"{tmp}/c-{src}"]
            res[f"rc_{src}"] = main(argv)
        res["rc_int8_src"] = main(["consolidate", "--quantize", "int8", f"{tmp}/c-run", f"{tmp}/x"])
    torch.distributed.barrier()
    want = quantize_int8(hf.parallelize(copy.deepcopy(full), mesh), mesh).eval()
    ids = torch.tensor([prompts[-1]])
    with torch.no_grad():
        res["want"] = want(ids).logits
        res["ref"] = reference_model(full).eval()(ids).logits
    res["want_int8"] = _int8_state(want)
    for src in ("run", "float"):
        model = hf.from_pretrained(f"{tmp}/c-{src}", mesh).eval()
        with torch.no_grad():
            res[f"logits_{src}"] = model(ids).logits
        res[f"int8_{src}"] = _int8_state(model)
    return res
