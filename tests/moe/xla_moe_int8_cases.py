"""int8 MoE weights on 2 XLA CPU devices (tests/helpers/xla_dist.py), used by test_moe_int8.py."""

from __future__ import annotations

import copy
from collections import Counter

import torch

import neuron_tp as ntp


def _params(model, dev) -> Counter:
    """The ENTRY parameters (dtype, shape) of a 4-token forward's graph (traced, then run)."""
    import torch_xla

    from neuron_tp.backend.hlo import entry_parameters, trace_hlo

    with torch.no_grad():
        logits = model(torch.tensor([[3, 14, 15, 9]]).to(dev)).logits
        params = Counter(entry_parameters(trace_hlo([logits])))
        torch_xla.sync()
    return params


def moe_int8_rank(ids: list[int]) -> dict:
    """One rank: the tiny Mixtral at tp 2 quantized on the host (the experts' and linears'
    all-reduce(max) on the devices), moved to the device: its logits, whether the experts hold
    int8 there, and the bytes of the graph parameters only the bf16 / only the int8 model read."""
    import torch_xla
    from test_moe_int8 import reference

    from moe_archs import build_moe, loud_experts
    from neuron_tp.backend.hlo import nbytes
    from neuron_tp.moe.quantized import Int8Experts
    from xla_dist import serial

    mesh = ntp.init_mesh(tp=2)
    with serial():
        full = loud_experts(build_moe("mixtral", seed=1))
        ref = reference(full).eval()
        model, plain = copy.deepcopy(full), copy.deepcopy(full).to(torch.bfloat16)
        quant16 = copy.deepcopy(plain)
    model, plain, quant16 = (ntp.parallelize(m, mesh).eval() for m in (model, plain, quant16))
    ntp.quantize(model, mesh)
    ntp.quantize(quant16, mesh)
    dev = ntp.xla_device()
    for m in (model, plain, quant16):
        ntp.move_to(m, dev)
    experts = [m for m in model.modules() if isinstance(m, Int8Experts)]
    with torch.no_grad():
        got = model(torch.tensor([ids]).to(dev)).logits.cpu()
        want, unq = ref(torch.tensor([ids])).logits, full(torch.tensor([ids])).logits
    torch_xla.sync()  # the collectives' ordering token would carry this graph into the next
    a, b = _params(plain, dev), _params(quant16, dev)
    size = lambda c: sum(nbytes(dt, shape) * n for (dt, shape), n in c.items())  # noqa: E731
    return {
        "int8_on_device": len(experts) == 2
        and all(
            m.qgate_up_proj.dtype == m.qdown_proj.dtype == torch.int8
            and m.qdown_proj.device.type == "xla"
            for m in experts
        ),
        "err_ref": (got - want).abs().max().item(),
        "err_unquantized": (got - unq).abs().max().item(),
        "bytes_bf16": size(a - b),
        "bytes_int8": size(b - a),
        "int8_dtypes": sorted({dt for dt, _ in b - a}),
    }
