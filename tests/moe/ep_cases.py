"""Expert-parallel cases shared by the gloo tier (test_expert_parallel.py) and the XLA CPU
devices tier (test_expert_parallel_xla.py): ``expert_parallel_mlp`` against a plain torch
reference, a loop over experts on the UNSHARDED weights (each expert applied to the pairs routed
to it; capacity applied by counting pairs in token order), for outputs and the gradients of
``x``, the routing weights and the local experts' weights.

Every ep rank's tokens, routing and upstream gradient come from generators seeded by (case,
ep rank), so every rank can compute the reference for the whole group: the gradient of an
expert's weights sums over the tokens of every rank routed to it.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from neuron_tp.moe.expert_parallel import expert_capacity, expert_parallel_mlp
from neuron_tp.parallel.mesh import Group


@dataclass(frozen=True)
class Case:
    experts: int = 8
    k: int = 2
    tokens: int = 7  # per rank; odd
    hidden: int = 10
    inter: int = 6
    capacity_factor: float | None = None
    skew: float = 0.0  # added to expert 0's router logit: makes it overflow
    seed: int = 0
    repeat: bool = False  # every token's last slot repeats its first expert (hash routers)


def weights(c: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The unsharded fused experts ``gate_up [E, 2I, H]``, ``down [E, H, I]``."""
    g = torch.Generator().manual_seed(100 + c.seed)
    gate_up = torch.randn(c.experts, 2 * c.inter, c.hidden, generator=g) / math.sqrt(c.hidden)
    down = torch.randn(c.experts, c.hidden, c.inter, generator=g) / math.sqrt(c.inter)
    return gate_up, down


def rank_data(c: Case, ep_rank: int):
    """``x [T, H]``, ``ids [T, k]``, routing weights ``[T, k]`` and upstream gradient of ep
    rank ``ep_rank``: routing is softmax/top-k of random logits (normalised)."""
    g = torch.Generator().manual_seed(1000 * c.seed + ep_rank)
    x = torch.randn(c.tokens, c.hidden, generator=g)
    logits = torch.randn(c.tokens, c.experts, generator=g)
    logits[:, 0] += c.skew
    vals, ids = logits.softmax(-1).topk(c.k, dim=-1)
    if c.repeat:
        ids[:, -1] = ids[:, 0]
    w = vals / vals.sum(-1, keepdim=True)
    grad = torch.randn(c.tokens, c.hidden, generator=g)
    return x, ids, w, grad


def tp_slice(gate_up, down, tp_rank: int, tp: int):
    """The tp slice of every expert's intermediate dim (gate chunk then up chunk)."""
    gate, up = gate_up.chunk(2, dim=1)
    i = gate.shape[1] // tp
    sl = slice(tp_rank * i, (tp_rank + 1) * i)
    return torch.cat([gate[:, sl], up[:, sl]], 1), down[:, :, sl]


def reference(x, ids, w, gate_up, down, cap: int | None):
    """The loop over experts on full weights: returns (output, number of dropped pairs)."""
    out = torch.zeros_like(x)
    dropped = 0
    for e in range(gate_up.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)  # row-major: token order
        if cap is not None and len(tok) > cap:
            dropped += len(tok) - cap
            tok, slot = tok[:cap], slot[:cap]
        gate, up = (x[tok] @ gate_up[e].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down[e].t()
        out = out.index_add(0, tok, y * w[tok, slot].unsqueeze(-1))
    return out, dropped


def checks(c: Case, ep: Group, tp_rank: int = 0, tp: int = 1, device="cpu"):
    """(what, got, want) for the EP result of this rank vs the reference: output, dropped
    count, grads of x, routing weights, gate_up and down (the local experts)."""
    gate_up, down = tp_slice(*weights(c), tp_rank, tp)
    e_local = c.experts // ep.size
    mine = slice(ep.rank * e_local, (ep.rank + 1) * e_local)
    cap = (
        None
        if c.capacity_factor is None
        else expert_capacity(c.tokens, c.k, c.experts, c.capacity_factor)
    )
    # reference over every ep rank's tokens (the local experts' grads sum over all of them)
    ref_gu, ref_down = gate_up.clone().requires_grad_(True), down.clone().requires_grad_(True)
    want = {}
    loss = 0.0
    for r in range(ep.size):
        x, ids, w, grad = rank_data(c, r)
        x, w = x.requires_grad_(True), w.requires_grad_(True)
        out, dropped = reference(x, ids, w, ref_gu, ref_down, cap)
        loss = loss + (out * grad).sum()
        if r == ep.rank:
            want.update(out=out.detach(), dropped=torch.tensor(dropped), x=x, w=w)
    loss.backward()
    want["x"], want["w"] = want["x"].grad, want["w"].grad
    want["gate_up"], want["down"] = ref_gu.grad[mine], ref_down.grad[mine]

    x, ids, w, grad = rank_data(c, ep.rank)
    x = x.to(device).requires_grad_(True)
    w = w.to(device).requires_grad_(True)
    gu = gate_up[mine].contiguous().to(device).requires_grad_(True)
    dn = down[mine].contiguous().to(device).requires_grad_(True)
    res = expert_parallel_mlp(
        x, ids.to(device), w, gate_up=gu, down=dn, group=ep, capacity_factor=c.capacity_factor
    )
    res.output.backward(grad.to(device))
    what = f"{c} ep{ep.size} rank {ep.rank} tp{tp} rank {tp_rank}"
    got = dict(
        out=res.output, dropped=res.dropped, x=x.grad, w=w.grad, gate_up=gu.grad, down=dn.grad
    )
    return [(f"{name} {what}", got[name], want[name]) for name in got]


def compare(pending, atol=1e-5, rtol=1e-5) -> int:
    for what, got, want in pending:
        got = got.detach().cpu()
        if not got.is_floating_point():
            assert got.item() == want.item(), f"{what}: {got.item()} != {want.item()}"
            continue
        torch.testing.assert_close(
            got, want.to(got.dtype), atol=atol, rtol=rtol, msg=lambda m, what=what: f"{what}: {m}"
        )
    return len(pending)


XLA_CASES = [Case(), Case(tokens=12, capacity_factor=1.0, skew=1.5, seed=4)]
# Families sharded behind transformers' experts interface, under ep on the devices: softmax
# over the top-k logits with biased, transposed, interleaved experts (gpt-oss); sigmoid scores
# and the dense call (Llama-4); sigmoid with a correction bias (MiniMax-M2).
XLA_FAMILIES = ("gpt_oss", "llama4_text", "minimax_m2")


def xla_job() -> dict:
    """On each of 2 XLA CPU device threads (xla_dist.run), ep 2 over the world: every case
    traced then one sync, compared with the CPU reference; then the capacity case again with
    other routings (other seeds, other drops): no new graph is compiled (shapes never depend on
    routing).
    """
    import torch_xla
    import torch_xla.debug.metrics as met

    import neuron_tp as ntp
    import xla_dist

    mesh = ntp.init_mesh(tp=2)
    dev = torch_xla.device()
    with xla_dist.serial():  # the references use autograd on shared modules: one at a time
        pending = [p for c in XLA_CASES for p in checks(c, mesh.tp, device=dev)]
    torch_xla.sync()
    n = compare(pending, atol=1e-4, rtol=1e-4)

    def compiles() -> int:
        return met.counter_value("UncachedCompile") or 0

    def step(seed: int) -> list:
        with xla_dist.serial():
            p = checks(dataclasses.replace(XLA_CASES[1], seed=seed), mesh.tp, device=dev)
        torch_xla.sync()
        return p

    compare(step(5), atol=1e-4, rtol=1e-4)
    import torch.distributed as dist

    dist.barrier()  # every device thread has compiled the step's graph
    before = compiles()
    after_pending = step(6)  # other tokens, other routing
    compare(after_pending, atol=1e-4, rtol=1e-4)
    dist.barrier()
    new_compiles = compiles() - before
    import ep_model_xla

    model, zero1 = ep_model_xla.run(), ep_model_xla.run_zero1()
    families = {f: ep_model_xla.run(f"family:{f}", steps=2) for f in XLA_FAMILIES}
    return {
        "rank": mesh.rank,
        "checks": n,
        "new_compiles": new_compiles,
        "model": model,
        "zero1": zero1,
        "families": families,
    }
