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


def _graph_parameters(model, dev) -> list[tuple[str, tuple[int, ...]]]:
    """The ENTRY parameters of a one-token forward's graph (traced, then run to clear it: the
    collectives' ordering token would carry this graph into the next trace until a sync)."""
    import torch_xla

    from neuron_tp.backend.hlo import entry_parameters, trace_hlo

    with torch.no_grad():
        logits = model(torch.tensor([[72]]).to(dev)).logits
        params = entry_parameters(trace_hlo([logits]))
        torch_xla.sync()
    return params


def decode_weight_bytes(full, mesh, dev) -> dict:
    """Bytes the bf16 model's graph reads for its linears, unquantized vs int8: the parameters
    of one graph that the other does not have (what is common, the embedding, the LM head and
    the norms, cancels), read from the traced HLO."""
    from collections import Counter

    from neuron_tp import hf
    from neuron_tp.backend.hlo import nbytes
    from neuron_tp.layers.quantized import quantize_int8
    from xla_dist import serial

    with serial():
        plain, quant = (copy.deepcopy(full).to(torch.bfloat16).eval() for _ in range(2))
    plain, quant = hf.parallelize(plain, mesh), hf.parallelize(quant, mesh)
    quantize_int8(quant, mesh)
    graphs = {}
    for name, model in (("bf16", plain), ("int8", quant)):
        ntp.move_to(model, dev)
        graphs[name] = Counter(_graph_parameters(model, dev))
    only_bf16 = graphs["bf16"] - graphs["int8"]
    only_int8 = graphs["int8"] - graphs["bf16"]
    size = lambda c: sum(nbytes(dt, shape) * n for (dt, shape), n in c.items())  # noqa: E731
    return {
        "linear_bytes_bf16": size(only_bf16),
        "linear_bytes_int8": size(only_int8),
        "int8_dtypes": sorted({dt for dt, _ in only_int8}),
        "bf16_dtypes": sorted({dt for dt, _ in only_bf16}),
    }


def int8_checkpoint_tp1(model, out: str, ids: torch.Tensor, dev) -> dict:
    """``model`` (int8, tp 2) saved to ``out``, loaded back at tp 1 on this device: its logits,
    and whether its linears hold int8 on the device (no float weight)."""
    from neuron_tp import hf
    from neuron_tp.layers.quantized import Int8WeightLinear

    hf.save_pretrained(model, out)
    loaded = hf.from_pretrained(out, ntp.init_mesh(tp=1))
    ntp.move_to(loaded, dev)
    layers = [m for m in loaded.modules() if isinstance(m, Int8WeightLinear)]
    with torch.no_grad():
        logits = loaded(ids.to(dev)).logits.cpu()
    return {
        "tp1_logits": logits,
        "tp1_int8": len(layers) == 14
        and all(m.qweight.dtype == torch.int8 and m.qweight.device.type == "xla" for m in layers)
        and not any(n.endswith("proj.weight") for n, _ in loaded.named_parameters()),
    }


def quantized_rank(tp: int, prompts: list[list[int]], out: str) -> dict:
    """One rank: the tiny Llama sharded over tp, quantized on the host (the row-parallel scales'
    all-reduce(max) runs on the XLA devices), moved to the device; its logits, greedy tokens and
    the compile count after a short and a longer generation (every rank meets before counting);
    then saved as an int8 checkpoint (``out``) and loaded back at tp 1."""

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
    weight_bytes = decode_weight_bytes(full, mesh, dev)
    return {
        **weight_bytes,
        **int8_checkpoint_tp1(model, out, ids, dev),
        "logits": got,
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
