"""Context parallelism: ring attention over cp ranks vs blockwise attention on one rank.

One attention core (batch 1, 4 query heads over 2 kv heads of 64, causal), forward+backward,
at a global sequence s: cp = 1 runs ``blockwise_attention`` on all s tokens (the existing
path); cp = 2, 4 run ``ring_attention`` on s / cp tokens per rank over a ring of cp ranks.

- gloo: cp processes; time per forward+backward (mean of 2 after a warm-up), the peak RSS
  each rank added during the steps (max over ranks), and the bytes each rank sent through
  ``comm.ring_shift`` (counted by wrapping it here) against the formula
  ``fwd (cp-1) * 2 * kv * itemsize + bwd ((cp-1) * 2 * kv * itemsize + cp * 2 * kv * 4)``
  with ``kv = b * hkv * (s / cp) * d`` (the local keys).
- xla: cp XLA CPU devices of one process (threads); time per step, the process's peak RSS
  added (all ranks together), and the bytes of the step graph's collective-permutes as
  traced for a Neuron rank (virtual mesh: what Neuron gets; the CPU devices carry each hop by
  an all-gather of cp times that).

    python benchmarks/context_parallel.py                     # s 2048 4096 8192, gloo and xla
    python benchmarks/context_parallel.py --seqs 2048 --tiers gloo
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
B, H, HKV, D = 1, 4, 2, 64


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def formula_bytes(seq: int, cp: int, itemsize: int = 4) -> int:
    kv = B * HKV * (seq // cp) * D
    return (cp - 1) * 2 * kv * itemsize * 2 + cp * 2 * kv * 4 if cp > 1 else 0


def _inputs(seq: int, cp: int, group, device):
    import torch

    from neuron_tp.layers.ring_attention import split_sequence

    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, seq, D, generator=g)
    k, v = (torch.randn(B, HKV, seq, D, generator=g) for _ in range(2))
    if cp > 1:
        q, k, v = (split_sequence(t, group, 2) for t in (q, k, v))
    return [t.to(device).requires_grad_() for t in (q, k, v)]


def _step(q, k, v, cp, group, block):
    from neuron_tp.layers.blockwise_attention import blockwise_attention
    from neuron_tp.layers.ring_attention import ring_attention

    if cp == 1:
        out = blockwise_attention(q, k, v, causal=True, block=block)
    else:
        out = ring_attention(q, k, v, group, block=block)
    out.float().pow(2).mean().backward()
    return out


def _gloo_rank(rank: int, cp: int, seq: int, block: int, port: int, queue) -> None:
    import torch
    import torch.distributed as dist

    import neuron_tp as ntp
    from neuron_tp.parallel import comm

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if cp > 1:
        dist.init_process_group("gloo", rank=rank, world_size=cp)
    mesh = ntp.init_mesh(cp=cp)
    sent = [0]
    shift = comm.ring_shift

    def counting(x, group):
        sent[0] += x.numel() * x.element_size()
        return shift(x, group)

    comm.ring_shift = counting
    q, k, v = _inputs(seq, cp, mesh.cp, "cpu")
    base, times = _rss_mib(), []
    for _ in range(3):
        sent[0] = 0
        t0 = time.perf_counter()
        _step(q, k, v, cp, mesh.cp, block)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    queue.put({"step_s": sum(times[1:]) / 2, "added_mib": peak - base, "bytes": sent[0]})
    if cp > 1:
        dist.barrier()
        dist.destroy_process_group()


def gloo(cp: int, seq: int, block: int) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_gloo_rank, args=(r, cp, seq, block, port, queue)) for r in range(cp)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rows = [queue.get() for _ in range(cp)]
    return {
        "step_s": max(r["step_s"] for r in rows),
        "added_mib": max(r["added_mib"] for r in rows),
        "bytes": rows[0]["bytes"],
    }


def _xla_rank(_index: int, cp: int, seq: int, block: int, out: str) -> None:
    import torch_xla
    import torch_xla.runtime as xr

    import neuron_tp as ntp

    mesh = ntp.init_mesh(cp=cp) if cp > 1 else ntp.init_mesh()
    q, k, v = _inputs(seq, cp, mesh.cp, ntp.xla_device())
    torch_xla.sync()
    base, times = _rss_mib(), []
    for _ in range(3):
        t0 = time.perf_counter()
        for t in (q, k, v):
            t.grad = None
        _step(q, k, v, cp, mesh.cp, block)
        torch_xla.sync()
        _ = q.grad.sum().item()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if xr.global_ordinal() == 0:
        with open(out, "w") as f:
            json.dump({"step_s": sum(times[1:]) / 2, "added_mib": peak - base}, f)


def _neuron_bytes(cp: int, seq: int, block: int) -> int:
    """Bytes of the collective-permutes in one rank's traced step (virtual mesh: Neuron's form)."""
    import torch_xla

    from neuron_tp.parallel.mesh import Mesh

    mesh = Mesh.virtual(cp, 0, tp=1, cp=cp)
    q, k, v = _inputs(seq, cp, mesh.cp, torch_xla.device())
    _step(q, k, v, cp, mesh.cp, block)
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([q.grad, k.grad, v.grad])
    sizes = {"f32": 4, "bf16": 2, "f16": 2}
    total = 0
    for m in re.finditer(r"= (\w+)\[([\d,]*)\][^=]*collective-permute\(", hlo):
        n = 1
        for dim in filter(None, m.group(2).split(",")):
            n *= int(dim)
        total += n * sizes[m.group(1)]
    return total


def xla(cp: int, seq: int, block: int) -> dict:
    import tempfile

    import torch_xla.distributed.xla_multiprocessing as xmp

    import neuron_tp as ntp

    os.environ.update(ntp.xla_cpu_devices_env(cp))
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        xmp.spawn(_xla_rank, args=(cp, seq, block, f.name))
        with open(f.name) as g:
            return json.load(g)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tiers", nargs="+", default=["gloo", "xla"], choices=["gloo", "xla"])
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        tier, cp, seq = args.one[0], int(args.one[1]), int(args.one[2])
        if tier == "bytes":
            print(json.dumps({"bytes": _neuron_bytes(cp, seq, args.block)}))
        else:
            print(json.dumps((gloo if tier == "gloo" else xla)(cp, seq, args.block)))
        return
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}

    def run(tier: str, cp: int, seq: int) -> dict | None:
        cmd = [sys.executable, __file__, "--block", str(args.block), "--one", tier, str(cp)]
        proc = subprocess.run([*cmd, str(seq)], env=env, capture_output=True, text=True)
        if proc.returncode:
            print(proc.stderr[-1500:], file=sys.stderr)
            return None
        return json.loads(proc.stdout.strip().splitlines()[-1])

    print(f"attention: batch {B}, {H} q heads / {HKV} kv heads x {D}, causal, block {args.block}")
    head = f"{'fwd+bwd':>8} {'+MiB':>7} | {'bytes/rank':>11} {'formula':>11}"
    print(f"{'tier':5} {'seq':>6} {'cp':>3} | {head}")
    for tier in args.tiers:
        for seq in args.seqs:
            for cp in args.cps:
                r = run(tier, cp, seq)
                if r is None:
                    print(f"{tier:5} {seq:>6} {cp:>3} | failed", flush=True)
                    continue
                sent = r.get("bytes")
                if tier == "xla" and cp > 1:
                    sent = (run("bytes", cp, seq) or {}).get("bytes")
                sent_s = "-" if sent is None else f"{sent:,}"
                print(
                    f"{tier:5} {seq:>6} {cp:>3} | {r['step_s']:>7.2f}s {r['added_mib']:>7.0f} | "
                    f"{sent_s:>11} {formula_bytes(seq, cp):>11,}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
