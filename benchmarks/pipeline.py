"""Pipeline parallelism, measured (neuron_tp.pipeline).

1. Step time against the number of micro-batches M at pp 4 on 4 gloo ranks (1F1B, a 4-layer
   Llama, one layer per stage), next to the predicted bubble (p-1)/(M+p-1) and the measured
   one: 1 - (time in tasks) / (step time), per rank, averaged.
2. Bytes one rank receives per micro-batch crossing a stage boundary, forward activation and
   backward gradient (one exchange each), traced for a virtual rank on the XLA CPU device
   (nothing executes), with and without sequence parallelism and in the 2D residual layout
   (``--tp-mode 2d``, library 2D blocks), next to b*s*h*dtype (/tp under SP or 2D):
   ``permute`` (XLA collective-permute, what Neuron runs), ``gather`` (the all-gather over the
   pp group XLA:CPU devices run: p-1 buffers received per useful one), and gloo's isend/irecv
   (exactly the buffer).

    .venv/bin/python benchmarks/pipeline.py [--hidden 256 --seq 128 --batch 2] [--steps 4]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _rank(rank: int, world: int, port: int, args, ms, out) -> None:
    import copy

    import torch
    import torch.distributed as dist
    import transformers

    import neuron_tp as ntp
    from neuron_tp.hf import parallelize
    from neuron_tp.optim.adamw import make_optimizer
    from neuron_tp.pipeline import build, plan_stages, split_model
    from neuron_tp.pipeline.runner import PipelineRunner

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = ntp.init_mesh(pp=world)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=world,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    model = copy.deepcopy(transformers.LlamaForCausalLM(config))
    parallelize(model, mesh)
    stage = split_model(model, mesh, plan_stages(world, world))
    opt = make_optimizer(stage.model, 1e-4, 0.0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    rows = []
    for m in ms:
        runner = PipelineRunner(
            stage, build("1f1b", world, m), batch=args.batch, seq=args.seq, device="cpu"
        )
        batches = [
            {
                "input_ids": (ids := torch.randint(0, 512, (args.batch, args.seq), generator=gen)),
                "labels": ids,
            }
            for _ in range(m)
        ]
        times, idle = [], []
        for _ in range(args.steps + 1):
            opt.zero_grad()
            dist.barrier()
            t0, busy0 = time.perf_counter(), runner.busy_seconds
            runner.step(batches, torch.tensor([1.0 / (m * args.batch * args.seq)]))
            took = time.perf_counter() - t0
            times.append(took)
            idle.append(1 - (runner.busy_seconds - busy0) / took)
            opt.step()
        rows.append((m, statistics.median(times[1:]), statistics.mean(idle[1:])))
    got = [None] * world
    dist.all_gather_object(got, rows)
    if rank == 0:
        out.put(got)
    dist.barrier()
    dist.destroy_process_group()


def step_time(args) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    ms, p = (4, 8, 16), 4
    procs = [ctx.Process(target=_rank, args=(r, p, port, args, ms, out)) for r in range(p)]
    for proc in procs:
        proc.start()
    per_rank = out.get()
    for proc in procs:
        proc.join()
    print(
        f"\n1F1B step time at pp {p} on gloo (hidden {args.hidden}, seq {args.seq}, "
        f"micro-batch {args.batch}; median of {args.steps} steps)"
    )
    print("| M | step s | s per micro-batch | predicted bubble (p-1)/(M+p-1) | measured idle |")
    print("|---|---|---|---|---|")
    for i, m in enumerate(ms):
        t = statistics.mean(r[i][1] for r in per_rank)
        idle = statistics.mean(r[i][2] for r in per_rank)
        print(f"| {m} | {t:.3f} | {t / m:.4f} | {(p - 1) / (m + p - 1):.1%} | {idle:.1%} |")


def _traced_bytes(method: str, p: int, tp: int, shape, dtype) -> int:
    import torch

    import neuron_tp as ntp
    from neuron_tp.backend.hlo import parse_collectives, trace_hlo
    from neuron_tp.pipeline.exchange import Exchange, Sent

    dev = ntp.xla_device()
    mesh = ntp.Mesh.virtual(world_size=p * tp, rank=tp, tp=tp, pp=p)
    ex = Exchange(mesh.pp, shape, dtype, dev, method)
    x = torch.ones(shape, dtype=dtype, device=dev)
    got = ex(Sent(x, x * 2), True, True)
    hlo = trace_hlo(list(got))
    size = torch.tensor([], dtype=dtype).element_size()
    if method == "permute":
        shapes = re.findall(r"\w+\[([\d,]+)\]\{[^}]*\} collective-permute", hlo)
        return sum(eval("*".join(s.split(","))) * size for s in shapes)  # noqa: S307
    total = 0
    for c in parse_collectives(hlo):
        n = 1
        for d in c.shape:
            n *= d
        total += n * size * (len(c.replica_groups[0]) - 1) // len(c.replica_groups[0])
    return total


def _in_fresh_process(method: str, p: int, tp: int, shape) -> int:
    """One trace per process: torch-xla threads an ordering token through every collective
    until a graph runs, so a second trace in the same process would count the first's too."""
    import subprocess

    cmd = [sys.executable, __file__, "--one", method, str(p), str(tp), *map(str, shape)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return int(res.stdout.strip().splitlines()[-1])


def boundary_bytes(args) -> None:
    b, s, h = args.batch, args.seq, args.hidden
    print(
        f"\nBytes one rank receives per micro-batch and boundary (forward + backward), "
        f"b={b} s={s} h={h} fp32, traced HLO"
    )
    print("| pp | tp | SP / mode | b*s*h*4 (/tp) x 2 | permute | gather | gloo isend/irecv |")
    print("|---|---|---|---|---|---|---|")
    rows = [(2, 1, "no"), (4, 1, "no"), (2, 2, "no"), (2, 2, "yes"), (4, 4, "no")]
    rows += [(4, 4, "yes"), (2, 4, "2d")]  # 2d: the residual layout [b/q, s, h/q], q = 2
    for p, tp, how in rows:
        q = math.isqrt(tp)
        shape = {"no": (b, s, h), "yes": (b, s // tp, h), "2d": (b // q, s, h // q)}[how]
        want = 2 * b * s * h * 4 // (1 if how == "no" else tp)
        perm, gath = (_in_fresh_process(m, p, tp, shape) for m in ("permute", "gather"))
        print(f"| {p} | {tp} | {how} | {want} | {perm} | {gath} | {want} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", choices=("time", "bytes"), default=None)
    ap.add_argument("--one", nargs=6, help=argparse.SUPPRESS)  # method p tp b s h
    a = ap.parse_args()
    if a.one:
        import torch

        m, *nums = a.one
        p, tp, *shape = map(int, nums)
        print(_traced_bytes(m, p, tp, tuple(shape), torch.float32))
        sys.exit(0)
    if a.only != "time":
        boundary_bytes(a)
    if a.only != "bytes":
        step_time(a)
