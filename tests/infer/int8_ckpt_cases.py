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
