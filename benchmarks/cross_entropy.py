"""neuron_tp vs neuronx-distributed (NxD): vocab-parallel cross-entropy, forward + backward.

Each tp degree runs on ``tp`` gloo CPU ranks (one thread each); NxD runs in its CPU mode from
its source mirror (see ``benchmarks/_nxd.py``). Both get the same vocab shard
``[tokens, vocab/tp]`` and labels; timed per call: the per-token loss, ``.sum().backward()``.
NxD overwrites its input logits, so each NxD call gets a fresh clone, made outside its timing
(the clone's own time is printed). Both are measured round-robin (median over ``--repeats``
after warm-up) so that other load hits them alike.

Also printed: the peak bytes allocated during one call above those held before it (resident
set high-water mark; NxD's clone excluded), and the max difference of
NxD's loss and gradient from neuron_tp's. NxD works in the logits' dtype (bf16 softmax for
bf16 logits) and neuron_tp in fp32, hence the larger bf16 differences.

    .venv/bin/python benchmarks/cross_entropy.py [--tokens 4096 --vocab 32000 --tp 1 2]
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

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_bytes(fn, *args) -> int:
    """Peak resident bytes of this process during ``fn(*args)`` above those before it (Linux: the
    high-water mark is reset through ``/proc/self/clear_refs``; tensors this large are
    mmap-ed, so freed ones leave the resident set at once)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _rss("VmRSS")
    fn(*args)
    return _rss("VmHWM") - before


def _calls(tp: int, dtype: torch.dtype, args):
    """This rank's shard ``base`` and labels, and the calls on them: neuron_tp's, NxD's (on a
    given clone of ``base``) and the comparison of their losses and gradients."""
    from neuronx_distributed.parallel_layers.loss_functions import parallel_cross_entropy

    import neuron_tp as ntp

    g = torch.Generator().manual_seed(0)
    local_v = args.vocab // tp
    full = torch.randn(args.tokens, args.vocab, generator=g) * 3
    labels = torch.randint(0, args.vocab, (args.tokens,), generator=g)
    rank = dist.get_rank()
    base = full[:, rank * local_v : (rank + 1) * local_v].to(dtype).contiguous()
    del full
    ours = base.clone().requires_grad_(True)

    def run_ours():
        ours.grad = None
        ntp.parallel_cross_entropy(ours, labels, reduction="sum").backward()
        return ours

    def run_nxd(x):
        x.requires_grad_(True)
        parallel_cross_entropy(x, labels).sum().backward()
        return x

    def compare() -> tuple[float, float]:
        with torch.no_grad():
            nx = base.clone().requires_grad_(True)
            loss_n = parallel_cross_entropy(nx, labels)
        loss_o = ntp.parallel_cross_entropy(ours.detach(), labels, reduction="none")
        x = base.clone().requires_grad_(True)
        run_nxd(x)
        run_ours()
        return (
            (loss_n.float() - loss_o.float()).abs().max().item(),
            (x.grad.float() - ours.grad.float()).abs().max().item(),
        )

    return base, run_ours, run_nxd, compare


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import logging

    from _nxd import nxd_init

    import neuron_tp as ntp

    logging.disable(logging.INFO)  # NxD's group-building log lines
    nxd_init(world)
    ntp.init_mesh(tp=world)
    rows = []
    for name in args.dtypes:
        base, run_ours, run_nxd, compare = _calls(world, DTYPES[name], args)
        times: dict[str, list[float]] = {"neuron_tp": [], "nxd": [], "clone": []}
        for i in range(args.warmup + args.repeats):
            dist.barrier()
            t0 = time.perf_counter()
            run_ours()
            t1 = time.perf_counter()
            x = base.clone()
            t2 = time.perf_counter()
            dist.barrier()
            t3 = time.perf_counter()
            run_nxd(x)
            t4 = time.perf_counter()
            del x
            if i >= args.warmup:
                times["neuron_tp"].append(t1 - t0)
                times["clone"].append(t2 - t1)
                times["nxd"].append(t4 - t3)
        med = {k: statistics.median(v) for k, v in times.items()}
        run_ours().grad = None  # the peaks count the new gradient of each, not the old
        dist.barrier()
        peak_ours = _peak_bytes(run_ours)
        dist.barrier()
        peak_nxd = _peak_bytes(run_nxd, base.clone())
        dloss, dgrad = compare()
        rows.append((name, med, peak_ours, peak_nxd, dloss, dgrad, base.numel() * 4))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def _run(tp: int, args) -> list:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, tp, port, args, queue)) for r in range(tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"tp={tp}: a rank failed: exit codes {[p.exitcode for p in procs]}")
    return queue.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    from _nxd import load_nxd

    load_nxd()  # fail early (mirror missing) and export the source once, before the ranks
    print(
        f"Vocab-parallel cross-entropy, tokens={args.tokens} vocab={args.vocab}, forward + "
        f"backward per call, tp gloo ranks x 1 thread, median of {args.repeats}\n"
    )
    print(
        "| tp | logits | neuron_tp ms | NxD ms | NxD / neuron_tp | NxD's clone ms "
        "| peak MiB neuron_tp | peak MiB NxD | shard MiB (fp32) | max dloss | max dgrad |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    mib = 2.0**20
    for tp in args.tp:
        for name, med, p_o, p_n, dloss, dgrad, shard in _run(tp, args):
            print(
                f"| {tp} | {name} | {med['neuron_tp'] * 1e3:.0f} | {med['nxd'] * 1e3:.0f} "
                f"| {med['nxd'] / med['neuron_tp']:.2f} | {med['clone'] * 1e3:.0f} "
                f"| {p_o / mib:.0f} | {p_n / mib:.0f} | {shard / mib:.0f} "
                f"| {dloss:.1e} | {dgrad:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
