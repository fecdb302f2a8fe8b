"""int8 weights on N XLA CPU devices (tests/helpers/xla_dist.py), used by test_quantize.py."""

from __future__ import annotations

import copy
import threading

import torch

import neuron_tp as ntp
from int8_reference import reference_model
from neuron_tp.backend.graphs import graph_counters

_barriers: dict[int, threading.Barrier] = {}
_lock = threading.Lock()


def _barrier(n: int) -> threading.Barrier:
    with _lock:
        return _barriers.setdefault(n, threading.Barrier(n))


def quantized_rank(tp: int, prompts: list[list[int]]) -> dict:
    """One rank: the tiny Llama sharded over tp, quantized on the host (the row-parallel scales'
    all-reduce(max) runs on the XLA devices), moved to the device; its logits, greedy tokens and
    the compile count after a short and a longer generation (every rank meets before counting)."""

    from neuron_tp import hf
    from neuron_tp.infer.static_generator import generate
    from neuron_tp.job.presets import build_model
    from neuron_tp.layers.quantized import Int8WeightLinear, quantize_int8
    from xla_dist import serial

    mesh = ntp.init_mesh(tp=tp)
    with serial():
        full = build_model("tiny-llama", 257, 4).eval()
        ref = reference_model(full).eval()
        model = copy.deepcopy(full)
    model = hf.parallelize(model, mesh).eval()  # collective: never under the lock
    quantize_int8(model, mesh)
    dev = ntp.xla_device()
    ntp.move_to(model, dev)
    layers = [m for m in model.modules() if isinstance(m, Int8WeightLinear)]
    ids = torch.tensor([prompts[-1]])
    with torch.no_grad():
        got = model(ids.to(dev)).logits.cpu()
        want, plain = ref(ids).logits, full(ids).logits
    barrier = _barrier(mesh.world_size)
    tokens = generate(model, prompts, 4, [16])
    barrier.wait()
    first = graph_counters()["compiles"]
    barrier.wait()
    tokens_long = generate(model, prompts, 12, [16])
    barrier.wait()
    more = graph_counters()["compiles"]
    with serial():
        ref_tokens = [
            ref.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    return {
        "int8_on_device": bool(layers)
        and all(m.qweight.dtype == torch.int8 and m.qweight.device.type == "xla" for m in layers),
        "err_ref": (got - want).abs().max().item(),
        "err_unquantized": (got - plain).abs().max().item(),
        "tokens": tokens_long,
        "tokens_prefix": [t[:4] for t in tokens_long] == tokens,
        "ref_tokens": ref_tokens,
        "compiles_after_first": first,
        "compiles_after_more_tokens": more,
    }
