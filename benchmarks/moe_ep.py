"""Expert parallelism vs tp-only for one MoE layer on gloo ranks: bytes each rank sends and the
time of one forward + backward (printed, not asserted).

Every rank holds ``T`` tokens of its own (``--tokens``, hidden ``--hidden``), routed top-k over
``E`` experts with intermediate dim ``--inter``. Three layouts over the same ``P`` ranks:

* ``ep dropless``: ``neuron_tp.moe.expert_parallel.expert_parallel_mlp``, ``E/P`` experts per
  rank, capacity ``T`` rows per (rank, expert): four all-to-alls of ``E*T`` rows (two forward,
  two backward);
* ``ep cf=1.25``: the same with capacity ``ceil(1.25*T*k/E)`` rows;
* ``tp dense``: every rank holds every expert's ``I/P`` slice and computes every expert on the
  ``T`` tokens (the static dense formulation, ``E/k`` times the routed FLOPs), one all-reduce of
  ``[T, H]`` forward and one backward (the input's gradient). Note: the tp group shares ONE set
  of ``T`` tokens, the ep group processes ``P`` sets.

Bytes are counted from the tensors handed to torch.distributed (ring algorithm: an all-to-all
sends ``(P-1)/P`` of its buffer, an all-reduce ``2(P-1)/P``).

    .venv/bin/python benchmarks/moe_ep.py [--ranks 2 4 --experts 8 --k 2 --tokens 256 --hidden 64]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


class _Sent:
    """Bytes this rank hands to all-to-all and all-reduce, per the ring algorithm."""

    def __init__(self, world: int):
        self.world, self.bytes = world, 0.0
        self._a2a, self._ar = dist.all_to_all_single, dist.all_reduce
        dist.all_to_all_single = self.all_to_all_single
        dist.all_reduce = self.all_reduce

    def all_to_all_single(self, out, inp, *a, **kw):
        self.bytes += (self.world - 1) / self.world * inp.numel() * inp.element_size()
        return self._a2a(out, inp, *a, **kw)

    def all_reduce(self, t, *a, **kw):
        self.bytes += 2 * (self.world - 1) / self.world * t.numel() * t.element_size()
        return self._ar(t, *a, **kw)


def _layouts(args, mesh):
    """name -> a function running one forward + backward on this rank."""
    from neuron_tp.moe.expert_parallel import expert_parallel_mlp
    from neuron_tp.parallel import regions

    p, r = mesh.tp_size, mesh.tp_rank
    e, k, t, h, i = args.experts, args.k, args.tokens, args.hidden, args.inter
    g = torch.Generator().manual_seed(0)
    gate_up, down = (
        torch.randn(e, 2 * i, h, generator=g) * 0.1,
        torch.randn(e, h, i, generator=g) * 0.1,
    )
    g = torch.Generator().manual_seed(1 + r)
    x = torch.randn(t, h, generator=g)
    vals, ids = torch.randn(t, e, generator=g).softmax(-1).topk(k, -1)
    w = vals / vals.sum(-1, keepdim=True)
    mine = slice(r * e // p, (r + 1) * e // p)
    ep_gu = gate_up[mine].clone().requires_grad_(True)
    ep_dn = down[mine].clone().requires_grad_(True)
    gate, up = gate_up.chunk(2, 1)
    sl = slice(r * i // p, (r + 1) * i // p)
    tp_gu = torch.cat([gate[:, sl], up[:, sl]], 1).requires_grad_(True)
    tp_dn = down[:, :, sl].clone().requires_grad_(True)
    dense_w = torch.zeros(t, e).scatter(1, ids, w)  # [T, E], 0 for experts not chosen

    def ep(cf):
        def run():
            xx, ww = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
            out = expert_parallel_mlp(
                xx, ids, ww, gate_up=ep_gu, down=ep_dn, group=mesh.tp, capacity_factor=cf
            )
            out.output.sum().backward()

        return run

    def tp_dense():
        xx, ww = x.clone().requires_grad_(True), dense_w.clone().requires_grad_(True)
        xin = regions.identity_fwd_all_reduce_bwd(xx, mesh.tp)
        hid = torch.matmul(xin.unsqueeze(0), tp_gu.transpose(1, 2))  # [E, T, 2I/P]
        a, b = hid.chunk(2, -1)
        out = torch.matmul(F.silu(a) * b, tp_dn.transpose(1, 2))  # [E, T, H]
        y = (out * ww.t().unsqueeze(-1)).sum(0)
        regions.all_reduce_fwd_identity_bwd(y, mesh.tp).sum().backward()

    return {"ep dropless": ep(None), "ep cf=1.25": ep(1.25), "tp dense": tp_dense}


def _rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import neuron_tp as ntp

    mesh = ntp.init_mesh(tp=world)
    sent = _Sent(world)
    results = {}
    for name, fn in _layouts(args, mesh).items():
        fn()  # warm-up
        sent.bytes = 0.0
        fn()
        nbytes = sent.bytes
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        results[name] = (nbytes, statistics.median(times))
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--inter", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    print(
        f"E={args.experts} k={args.k} T={args.tokens} tokens/rank H={args.hidden} "
        f"I={args.inter}, fp32, gloo, one forward + backward, median of {args.repeats}"
    )
    print(f"{'P':>2} {'layout':<12} {'KiB sent/rank':>14} {'ms':>8}")
    ctx = mp.get_context("spawn")
    for world in args.ranks:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = ctx.SimpleQueue()
        procs = [ctx.Process(target=_rank, args=(r, world, port, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        results = out.get()
        for p in procs:
            p.join()
        for name, (nbytes, secs) in results.items():
            print(f"{world:>2} {name:<12} {nbytes / 1024:>14.1f} {secs * 1e3:>8.2f}")


if __name__ == "__main__":
    main()
