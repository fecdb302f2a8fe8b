"""`neuron-tp plan` on the docs' configurations: recommended layout, memory per NeuronCore and
predicted throughput of Llama-2-7B/13B and Llama-3-8B on 1, 4 and 16 trn1.32xlarge, how long
each plan takes, and the planner's prediction next to AWS's published NxD figures.

    .venv/bin/python benchmarks/plan_table.py [--out docs]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from neuron_tp.plan.hardware import get_instance  # noqa: E402
from neuron_tp.plan.models import plan_config  # noqa: E402
from neuron_tp.plan.search import Job, make_plan  # noqa: E402

GIB = 2**30
TABLE = [  # model, seq len, global batch (NxD's published runs use 1024 sequences)
    ("llama-3-8b", 8192, 1024),
    ("llama-2-7b", 4096, 1024),
    ("llama-2-13b", 4096, 1024),
]
# AWS Neuron's trn1 training performance table (NxD, BF16, global batch 1024); see PLATFORM.md
PUBLISHED = [
    ("llama-2-7b", 4096, 16, dict(tp=8), "TP8 DP64", "95.14 (Neuron 2.21); ~81 earlier"),
    ("llama-3.1-8b", 8192, 32, dict(tp=32), "TP32 DP32 ZeRO-1", "47.95"),
    ("llama-3.1-70b", 8192, 32, dict(tp=32), "TP32 PP8 DP4", "7.94"),
]


def _layout(c) -> str:
    lay = c.layout
    mode = lay.tp_mode + ("+SP" if lay.sequence_parallel else "")
    return (
        f"tp={lay.tp} {mode}, dp={lay.dp}, micro-batch {lay.micro_batch} x accum "
        f"{lay.grad_accum}, recompute {lay.recompute}" + (" (tight fit)" if c.tight else "")
    )


def _plan(model: str, seq: int, nodes: int, batch: int, **pins):
    job = Job(get_instance("trn1.32xlarge"), nodes, seq, batch)
    start = time.perf_counter()
    plan = make_plan(plan_config(model, seq), job, **pins)
    return plan, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory holding plan.md (tables replaced)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16])
    args = ap.parse_args()
    rows = [
        "| model | seq | nodes | recommended layout | GiB per core (of 14.4) | predicted seq/s "
        "| tokens/s | MFU | plan time |",
        "|" + "---|" * 9,
    ]
    for model, seq, batch in TABLE:
        for nodes in args.nodes:
            plan, took = _plan(model, seq, nodes, batch)
            c = plan.recommended
            if c is None:
                line = (
                    f"| {model} | {seq} | {nodes} | {plan.verdict} | - | - | - | - | {took:.0f} s |"
                )
            else:
                line = (
                    f"| {model} | {seq} | {nodes} | {_layout(c)} | {c.memory.total / GIB:.1f} | "
                    f"{c.seq_per_s:.1f} | {c.seq_per_s * seq:,.0f} | {c.mfu:.1%} | {took:.0f} s |"
                )
            rows.append(line)
            print(line, flush=True)
    pub = [
        "| published run (trn1.32xlarge) | published seq/s | planner, same tp | predicted "
        "seq/s | GiB per core | planner's own pick |",
        "|" + "---|" * 6,
    ]
    for model, seq, nodes, pins, layout, published in PUBLISHED:
        pinned, _ = _plan(model, seq, nodes, 1024, **pins)
        free, _ = _plan(model, seq, nodes, 1024)
        c, f = pinned.recommended, free.recommended
        line = (
            f"| {model} seq {seq}, {nodes} nodes, {layout} | {published} | "
            + (
                f"{_layout(c)} | {c.seq_per_s:.1f} | {c.memory.total / GIB:.1f}"
                if c
                else f"{pinned.verdict} | - | -"
            )
            + f" | {_layout(f) + f' ({f.seq_per_s:.1f} seq/s)' if f else free.verdict} |"
        )
        pub.append(line)
        print(line, flush=True)
    if args.out:
        from tp_scaling import _write_table

        path = os.path.join(args.out, "plan.md")
        _write_table(path, "table", "\n".join(rows))
        _write_table(path, "published", "\n".join(pub))


if __name__ == "__main__":
    main()
