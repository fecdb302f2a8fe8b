"""MoE runs executed on N XLA CPU devices (tests/helpers/xla_dist.py), used by
test_moe_xla.py. Each rank shards a tiny MoE model, trains it on the device for a few steps
with DIFFERENT token ids each step next to the unsharded transformers model trained the same
way on the CPU, and reports the differences and the process-wide compile count after each
step (rank 0, after a barrier, so every rank's graphs are counted); then generation.

A case with a capacity factor runs the device model in ``capacity`` mode; its reference is
transformers' model whose experts get the weights of the (token, slot) pairs past an expert's
capacity set to 0, the pairs chosen by a plain loop (:func:`capacity_keep`)."""

from __future__ import annotations

import copy
import math
import threading

import torch

import neuron_tp as ntp
from moe_archs import V, build_moe
from moe_families import build_family
from neuron_tp import hf
from neuron_tp.backend.graphs import graph_counters
from neuron_tp.moe import ParallelMoEBlock
from xla_dist import serial

# Family configs on the XLA device: windows no longer than the 8 tokens (transformers'
# sliding-window and chunked masks use an offset torch-xla 2.9 refuses beyond the sequence
# length: "Value out of range").
XLA_OVERRIDES = {
    "gpt_oss": dict(sliding_window=8),
    "cohere2_moe": dict(sliding_window=8),
    "llama4_text": dict(attention_chunk_size=8),
}

_barriers: dict[int, threading.Barrier] = {}
_lock = threading.Lock()


def _barrier(n: int) -> threading.Barrier:
    with _lock:
        return _barriers.setdefault(n, threading.Barrier(n))


def _counted(mesh) -> int:
    """The process-wide compile count once every rank got here."""
    _barrier(mesh.world_size).wait()
    n = graph_counters()["compiles"]
    _barrier(mesh.world_size).wait()
    return n


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().cpu().float() - b.detach().float()).abs().max())


def run_all(tp: int, cases: list[tuple], steps: int) -> dict:
    """:func:`run_train` for each ``(family, sequence_parallel[, capacity_factor])``, then
    :func:`run_generate`, in one launch."""
    out = {}
    for name, sp, *cf in cases:
        key = f"{name} sp={sp}" + (f" cf={cf[0]}" if cf else "")
        out[key] = run_train(tp, name, sp, steps, *cf)
    out["generate"] = run_generate(tp)
    return out


def capacity_keep(idx: torch.Tensor, cap: int, num_experts: int) -> torch.Tensor:
    """``[T, k]`` bool: the pairs each expert takes, in token order, at most ``cap`` each."""
    seen, keep = [0] * num_experts, torch.ones(idx.shape, dtype=torch.bool)
    for t, row in enumerate(idx.tolist()):
        for j, e in enumerate(row):
            keep[t, j] = seen[e] < cap
            seen[e] += 1
    return keep


def _drop_past_capacity(model, cf: float, dropped: list) -> None:
    """Each MoE layer's experts of transformers' ``model`` take at most ``C = ceil(cf * T * k
    / E)`` pairs (the others' weights set to 0); the dropped count is appended to ``dropped``."""
    for mod in model.modules():
        if hasattr(mod, "gate_up_proj") and hasattr(mod, "num_experts"):

            def forward(x, idx, w, orig=mod.forward, e=mod.num_experts):
                keep = capacity_keep(idx, math.ceil(cf * idx.numel() / e), e)
                dropped.append(int((~keep).sum()))
                return orig(x, idx, w * keep.to(w.dtype))

            mod.forward = forward


def _device_dropped(model) -> int:
    return sum(int(b.experts.dropped) for b in model.modules() if isinstance(b, ParallelMoEBlock))


def run_train(tp: int, name: str, sp: bool, steps: int, cf: float | None = None) -> dict:
    """``steps`` SGD steps (tokens differ every step) on the device vs on the CPU: the loss
    and every gathered gradient of each step, eval logits after the last step, and the
    compile count after each step. Every step runs the same two graphs (forward, backward and
    the gradient gathers; the optimizer update). With ``cf``: capacity mode (see the module
    doc), and the pairs dropped per step (device, reference)."""
    import torch_xla

    mesh = ntp.init_mesh(tp=tp)
    dev = ntp.xla_device()
    with serial():  # "family:<model_type>": any MoE family (tests/helpers/moe_families.py)
        fam = name.removeprefix("family:")
        ref = build_family(fam, **XLA_OVERRIDES.get(fam, {})) if fam != name else build_moe(name)
        ref = ref.train()
    m = hf.parallelize(copy.deepcopy(ref), mesh, sequence_parallel=sp, parallel_loss=True)
    m = ntp.move_to(m, dev)
    ref_dropped: list[int] = []
    if cf is not None:
        ntp.set_moe_mode(m, "capacity", capacity_factor=cf)
        _drop_past_capacity(ref, cf, ref_dropped)
    opts = [torch.optim.SGD(x.parameters(), lr=0.2) for x in (m, ref)]
    out = {"loss": [], "grad": [], "compiles": [], "dropped": []}
    for step in range(steps):
        ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(100 + step))
        loss = m(ids.to(dev), labels=ids.to(dev)).loss
        loss.backward()
        ntp.sync_sequence_parallel_grads(m)
        grads = hf.gather_hf_state_dict(m, grads=True)
        torch_xla.sync()  # one graph: forward, backward, gathers
        with serial():
            ref_loss = ref(ids, labels=ids).loss
            ref_loss.backward()
        out["loss"].append(_maxdiff(loss, ref_loss))
        out["grad"].append(max(_maxdiff(grads[n], p.grad) for n, p in ref.named_parameters()))
        if cf is not None:
            out["dropped"].append((_device_dropped(m), sum(ref_dropped)))
            ref_dropped.clear()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch_xla.sync()
        out["compiles"].append(_counted(mesh))
    m.eval(), ref.eval()
    ids = torch.randint(1, V, (2, 8), generator=torch.Generator().manual_seed(7))
    with hf.full_logits(m):
        logits = m(ids.to(dev)).logits
    torch_xla.sync()
    out["logits"] = _maxdiff(logits, ref(ids).logits)
    return out


def run_generate(tp: int) -> dict:
    """Greedy generation of a tiny Mixtral through one Generator (prefill dense, decode in the
    gather mode): tokens vs transformers' generate on the CPU, and traces / compiles after
    each of three calls with different prompts (no new graph after the first)."""
    from neuron_tp.infer.static_generator import Generator

    mesh = ntp.init_mesh(tp=tp)
    with serial():
        ref = build_moe("mixtral", max_position_embeddings=256)  # a 136-position cache
        ref.generation_config.eos_token_id = None  # token 2 is no end here: 6 tokens each
        ref.generation_config.pad_token_id = 0
    model = hf.parallelize(copy.deepcopy(ref), mesh)
    model = ntp.move_to(model.eval(), ntp.xla_device())
    gen = Generator(model, [8], 6, batch_buckets=[2])
    res = {"same": [], "counts": []}
    for seed in (1, 2, 3):
        prompts = torch.randint(1, V, (2, 5), generator=torch.Generator().manual_seed(seed))
        got = gen.generate(prompts.tolist(), 6)
        with serial():
            want = ref.generate(prompts, max_new_tokens=6, do_sample=False)
        res["same"].append(got == want[:, 5:].tolist())
        res["counts"].append((gen.traces, _counted(mesh)))
    return res
