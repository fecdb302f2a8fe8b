"""MoE runs executed on N XLA CPU devices (tests/helpers/xla_dist.py), used by
test_moe_xla.py. Each rank shards a tiny MoE model, trains it on the device for a few steps
with DIFFERENT token ids each step next to the unsharded transformers model trained the same
way on the CPU, and reports the differences and the process-wide compile count after each
step (rank 0, after a barrier, so every rank's graphs are counted); then generation."""

from __future__ import annotations

import copy
import threading

import torch

import neuron_tp as ntp
from moe_archs import V, build_moe
from neuron_tp import hf
from neuron_tp.backend.graphs import graph_counters
from xla_dist import serial

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


def run_all(tp: int, cases: list[tuple[str, bool]], steps: int) -> dict:
    """:func:`run_train` for each ``(family, sequence_parallel)``, then :func:`run_generate`,
    in one launch."""
    out = {f"{name} sp={sp}": run_train(tp, name, sp, steps) for name, sp in cases}
    out["generate"] = run_generate(tp)
    return out


def run_train(tp: int, name: str, sp: bool, steps: int) -> dict:
    """``steps`` SGD steps (tokens differ every step) on the device vs on the CPU: the loss
    and every gathered gradient of each step, eval logits after the last step, and the
    compile count after each step. Every step runs the same two graphs (forward, backward and
    the gradient gathers; the optimizer update)."""
    import torch_xla

    mesh = ntp.init_mesh(tp=tp)
    dev = ntp.xla_device()
    with serial():
        ref = build_moe(name).train()
    m = hf.parallelize(copy.deepcopy(ref), mesh, sequence_parallel=sp, parallel_loss=True)
    m = ntp.move_to(m, dev)
    opts = [torch.optim.SGD(x.parameters(), lr=0.2) for x in (m, ref)]
    out = {"loss": [], "grad": [], "compiles": []}
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
    from neuron_tp.infer.generate import Generator

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
