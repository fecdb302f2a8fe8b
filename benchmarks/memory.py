"""Per-rank memory of one transformer layer, lever by lever, next to the Megatron formulas.

For each tp in ``--tp`` (default 1 2 4), tp gloo CPU processes (one thread each, world = tp,
dp = 1) build a ``neuron_tp.blocks.block_1d.TransformerBlock(h, heads)`` (fp32, bias, 4h GeLU MLP,
dropout 0, SDPA attention) and run forward + backward under four levers; rank 0 reports:

* ``tp``       plain tensor parallelism (residual stream replicated over tp);
* ``sp-keep``  TP + SP keeping the all-gathered column-linear inputs
  (``sequence_parallel_regather=False``);
* ``sp``       TP + SP saving only the sequence shard, re-gathered in backward (default);
* ``sp-full``  ``sp`` with full recompute (``neuron_tp.hf.recompute.checkpoint(block, x)``,
  ``torch.utils.checkpoint`` non-reentrant on CPU).

Columns (bytes per rank of rank 0, one layer):

* ``params`` / ``grads``  parameter bytes and ``.grad`` bytes after backward;
* ``adamw``   ``torch.optim.AdamW`` state after one step (exp_avg, exp_avg_sq, step);
* ``zero1/2`` ANALYTIC: ``adamw / 2``, what ``ntp.Zero1`` at dp=2 would keep (not measured:
  that needs 2*tp ranks; fp32 params need no master copy);
* ``saved``   saved-for-backward activation bytes, counted with
  ``torch.autograd.graph.saved_tensors_hooks``, one count per storage, parameters excluded
  (for ``sp-full`` the checkpoint's own hooks hide its inside: the outer hooks see the layer
  input it keeps for the recompute, and nothing else);
* ``megatron`` Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models", per layer and rank, in 16-bit bytes (16-bit activations, 1-byte dropout masks,
  all of it counted as 2-byte elements here), x2 for our fp32, with A = 5*a*s/h:
  tp: s*b*h*(10 + 24/t + A/t); sp: s*b*h/t*(34 + A); sp-full: 2*s*b*h/t (the input shard);
  sp-keep (derived, not in the paper): s*b*h*(4 + 30/t + A/t) (the two gathered inputs of
  the column-parallel linears, 2*s*b*h each, stay unsharded);
* ``meg-sel`` the same without the A term: Megatron's selective recompute (the s^2 attention
  scores are not saved), which is what SDPA's fused attention does anyway;
* ``/meg``, ``/sel`` saved / megatron, saved / meg-sel. Expect /sel a bit below 1: dropout is 0,
  so the formula's two 1-byte dropout masks (2*s*b*h bytes, /t under SP) are not saved;
* ``ms``      median forward+backward wall time of a few repeats, CPU gloo timing (1 thread per
  rank; a proxy for the collectives' count, not for Trainium speed).

    .venv/bin/python benchmarks/memory.py [--tp 1 2 4] [--hidden 512 --heads 8 --seq 256 --batch 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LEVERS = ("tp", "sp-keep", "sp", "sp-full")


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _saved_bytes(block, fn, x) -> int:
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    y.sum().backward()
    return sum(seen.values())


def _measure(args, lever: str) -> dict:
    import neuron_tp as ntp
    from neuron_tp.hf.recompute import checkpoint

    mesh = ntp.get_mesh()
    t, sp = mesh.tp_size, lever != "tp"
    torch.manual_seed(0)
    block = ntp.blocks.TransformerBlock(
        args.hidden,
        args.heads,
        mesh=mesh,
        sequence_parallel=sp,
        sequence_parallel_regather=lever != "sp-keep",
    )
    x = torch.randn(args.batch, args.seq // t if sp else args.seq, args.hidden)
    x.requires_grad_()
    full = lever == "sp-full"

    def fn(inp):
        return checkpoint(block, inp) if full else block(inp)

    saved = _saved_bytes(block, fn, x)
    out = {"params": _nbytes(block.parameters())}
    out["grads"] = _nbytes(p.grad for p in block.parameters())
    opt = torch.optim.AdamW(block.parameters())
    opt.step()
    out["adamw"] = _nbytes(v for s in opt.state.values() for v in s.values())
    times = []
    for _ in range(args.repeats):
        block.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        fn(x).sum().backward()
        times.append(time.perf_counter() - t0)
    out.update(saved=saved, ms=1e3 * statistics.median(times))
    return out


def _worker(rank: int, world: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import neuron_tp as ntp

    try:
        ntp.init_mesh(tp=world)
        rows = {lever: _measure(args, lever) for lever in LEVERS}
        if rank == 0:
            queue.put(rows)
    finally:
        dist.destroy_process_group()


def _run(args, t: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, t, port, args, queue)) for r in range(t)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"tp={t}: ranks exited with {[p.exitcode for p in procs]}")
    return queue.get()


def megatron(lever: str, t: int, s: int, b: int, h: int, a: int, scores: bool) -> float:
    """Activation bytes per layer and rank at 16-bit (Korthikanti et al.); ``scores``: keep
    the 5*a*s/h attention term (False: selective recompute)."""
    sbh, big = s * b * h, 5 * a * s / h if scores else 0.0
    return {
        "tp": sbh * (10 + 24 / t + big / t),
        "sp-keep": sbh * (4 + 30 / t + big / t),
        "sp": sbh / t * (34 + big),
        "sp-full": 2 * sbh / t,
    }[lever]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    fp32 = 2  # our activations are fp32: the 16-bit formulas x 2
    mib = 2**20
    print(
        f"one TransformerBlock h={args.hidden} heads={args.heads} s={args.seq} b={args.batch}"
        ", fp32, rank 0 of tp; MiB; megatron = 16-bit formula x2; zero1/2 analytic (adamw/2);"
        " ms = CPU gloo fwd+bwd median"
    )
    cols = "params grads adamw zero1/2 saved megatron meg-sel /meg /sel ms"
    print(f"{'tp':>3} {'lever':<8}" + "".join(f"{c:>9}" for c in cols.split()))
    for t in args.tp:
        rows = _run(args, t)
        for lever in LEVERS:
            r = rows[lever]
            dims = (lever, t, args.seq, args.batch, args.hidden, args.heads)
            meg, sel = (fp32 * megatron(*dims, scores=k) for k in (True, False))
            vals = [r["params"], r["grads"], r["adamw"], r["adamw"] / 2, r["saved"], meg, sel]
            cells = [f"{v / mib:9.2f}" for v in vals]
            cells += [f"{r['saved'] / meg:9.2f}", f"{r['saved'] / sel:9.2f}", f"{r['ms']:9.1f}"]
            print(f"{t:>3} {lever:<8}" + "".join(cells), flush=True)


if __name__ == "__main__":
    main()
