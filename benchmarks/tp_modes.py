"""Step time of ``neuron-tp train`` per tensor-parallel mode, gloo CPU ranks, P = 4 and 8.

For each case (P, mode) P gloo processes (one thread each) run the training loop on the
``--model`` preset with the same global batch (``--micro-batch`` sequences per dp replica:
the 2D/3D modes split it over the grid, 1D keeps it whole on every tp rank); rank 0 reports
the median wall time of the steps after ``--warmup``. On a 2-core machine P processes share
two cores, so the numbers compare modes on one machine (collective count and size, redundant
work), not Trainium speed.

    .venv/bin/python benchmarks/tp_modes.py [--steps 12 --seq-len 128 --micro-batch 4]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (world P, tp, mode, sequence parallel, dp replicas): the same global batch in every case
# (tiny-llama has 4 heads: 1D stops at tp 4, so P = 8 is 1D tp4 x dp2 against 3D q=2)
CASES = [(4, 4, "1d", False, 1), (4, 4, "1d", True, 1), (4, 4, "2d", False, 1)]
CASES += [(8, 4, "1d", False, 2), (8, 4, "1d", True, 2), (8, 8, "3d", False, 1)]


def _worker(rank: int, world: int, port: int, case: tuple, args, out: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import neuron_tp as ntp
    from neuron_tp.cli.args import train_parser
    from neuron_tp.train.loop import train

    _, tp, mode, sp, dp = case
    mesh = ntp.init_mesh(tp=tp, tp_mode=mode)
    argv = ["--device", "cpu", "--model", args.model, "--tp", str(tp), "--tp-mode", mode]
    argv += ["--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch // dp)]
    argv += ["--steps", str(args.steps), "--log-every", "1000", "--output-dir", out]
    argv += ["--resume", "none"] + (["--sequence-parallel"] if sp else [])
    marks: list[float] = []
    train(
        train_parser().parse_args(argv),
        mesh,
        printer=lambda *a, **k: None,
        on_step=lambda run: marks.append(time.perf_counter()),
    )
    steps = [b - a for a, b in zip(marks, marks[1:])][args.warmup :]
    if rank == 0:
        queue.put(1e3 * statistics.median(steps))
    dist.destroy_process_group()


def _run(case: tuple, args) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    P = case[0]
    with tempfile.TemporaryDirectory() as out:  # the ranks must agree on --output-dir
        procs = [
            ctx.Process(target=_worker, args=(r, P, port, case, args, out, queue)) for r in range(P)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"{case}: ranks exited with {[p.exitcode for p in procs]}")
    return queue.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument(
        "--micro-batch", type=int, default=4, help="global batch: divisible by q^2 (3D) and dp"
    )
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    print(
        f"neuron-tp train --model {args.model} --seq-len {args.seq_len} --micro-batch "
        f"{args.micro_batch}, gloo CPU, median ms/step after {args.warmup} warm-up steps"
    )
    print("| P | layout | ms/step |\n|---|---|---|")
    for case in CASES:
        P, tp, mode, sp, dp = case
        name = f"{mode} tp{tp}" + (" +sp" if sp else "") + (f" x dp{dp}" if dp > 1 else "")
        print(f"| {P} | {name} | {_run(case, args):.1f} |", flush=True)


if __name__ == "__main__":
    main()
