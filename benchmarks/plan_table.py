"""`neuron-tp plan` on the docs' configurations: recommended layout, memory per NeuronCore and
predicted throughput of Llama-2-7B/13B and Llama-3-8B on 1, 4 and 16 trn1.32xlarge, how long
each plan takes, and the planner's prediction next to AWS's published NxD figures; with pipeline
parallelism in the search, Llama-2-70B / Llama-3-70B full fine-tunes on 1, 4, 8 and 32 nodes and
Llama-3.1-405B; long context (Llama-3-8B / 70B at 8k, 32k, 128k on 1 and 4 nodes, cp and
blockwise attention in the search) with the longest trainable sequence.

    .venv/bin/python benchmarks/plan_table.py [--out docs] [--tables base published pipeline long]
        [--trace-cache FILE]

Rows at the same traced shapes share their traces (neuron_tp.plan.trace_store); with
``--trace-cache`` the traces are also kept in FILE after every row, so an interrupted run
resumes where it stopped (a file written by other code is ignored).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from neuron_tp.plan import trace_store  # noqa: E402
from neuron_tp.plan.hardware import get_instance  # noqa: E402
from neuron_tp.plan.models import plan_config  # noqa: E402
from neuron_tp.plan.search import Job, make_plan  # noqa: E402

GIB = 2**30
TRACE_CACHE: list[str] = []  # the --trace-cache file, if any
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
# NxD's published pipeline runs (PLATFORM.md), planned at the published tp x pp and free
PUBLISHED_PP = [
    ("llama-2-70b", 4096, 32, dict(tp=32, pp=8), "TP32 PP8 DP4", "14.44"),
    ("llama-3.1-70b", 8192, 32, dict(tp=32, pp=8), "TP32 PP8 DP4", "7.94"),
]
PIPELINE = [("llama-2-70b", 4096), ("llama-3-70b", 8192)]  # x PIPELINE_NODES, batch 1024
PIPELINE_NODES = (1, 4, 8, 32)
BIG = [("llama-3.1-405b", 8192, 32), ("llama-3.1-405b", 8192, 36)]
LONG = [("llama-3-8b", (1, 4)), ("llama-3-70b", (1, 4))]  # at LONG_SEQS, global batch 64
LONG_SEQS = (8192, 32768, 131072)
# the docs' large tables pin 1d + sequence parallelism (what every layout that fits uses at
# these sizes) to keep a plan's trace count small on a 2-core machine
LARGE_PINS = dict(tp_mode="1d", sequence_parallel=True)


def _layout(c) -> str:
    lay = c.layout
    mode = lay.tp_mode + ("+SP" if lay.sequence_parallel else "")
    return (
        f"tp={lay.tp} {mode}, dp={lay.dp}, micro-batch {lay.micro_batch} x accum "
        f"{lay.grad_accum}, recompute {lay.activation_checkpointing}"
        + (f", pp={lay.pp}" if lay.pp > 1 else "")
        + (f" interleaved v={lay.virtual_stages}" if lay.pp_schedule == "interleaved" else "")
        + (f", cp={lay.cp}" if lay.cp > 1 else "")
        + (", blockwise attention" if lay.attention == "blockwise" else "")
        + (" (tight fit)" if c.tight else "")
    )


def _plan(model: str, seq: int, nodes: int, batch: int, **pins):
    job = Job(get_instance("trn1.32xlarge"), nodes, seq, batch)
    start = time.perf_counter()
    plan = make_plan(plan_config(model, seq), job, **pins)
    for path in TRACE_CACHE:
        trace_store.save(path)
    return plan, time.perf_counter() - start


def _row(model: str, seq: int, nodes: int, batch: int, **pins) -> str:
    plan, took = _plan(model, seq, nodes, batch, **pins)
    c = plan.recommended
    if c is None:
        return f"| {model} | {seq} | {nodes} | {plan.verdict} | - | - | - | - | {took:.0f} s |"
    return (
        f"| {model} | {seq} | {nodes} | {_layout(c)} | {c.memory.total / GIB:.1f} | "
        f"{c.seq_per_s:.2f} | {c.seq_per_s * seq:,.0f} | {c.mfu:.1%} | {took:.0f} s |"
    )


HEAD = [
    "| model | seq | nodes | recommended layout | GiB per core (of 14.4) | predicted seq/s "
    "| tokens/s | MFU | plan time |",
    "|" + "---|" * 9,
]


def _published(entries, **extra) -> list[str]:
    pub = [
        "| published run (trn1.32xlarge) | published seq/s | planner, same tp x pp | predicted "
        "seq/s | GiB per core | planner's own pick |",
        "|" + "---|" * 6,
    ]
    for model, seq, nodes, pins, layout, published in entries:
        pinned, _ = _plan(model, seq, nodes, 1024, **pins, **extra)
        free, _ = _plan(model, seq, nodes, 1024, **extra)
        c, f = pinned.recommended, free.recommended
        line = (
            f"| {model} seq {seq}, {nodes} nodes, {layout} | {published} | "
            + (
                f"{_layout(c)} | {c.seq_per_s:.2f} | {c.memory.total / GIB:.1f}"
                if c
                else f"{pinned.verdict} | - | -"
            )
            + f" | {_layout(f) + f' ({f.seq_per_s:.2f} seq/s)' if f else free.verdict} |"
        )
        pub.append(line)
        print(line, flush=True)
    return pub


def _longest(model: str, nodes: int) -> str:
    """The longest power-of-two sequence (from 8k) some layout trains (global batch 64)."""
    best = "-"
    seq = 8192
    while seq <= 2**20:
        plan, _ = _plan(model, seq, nodes, 64, **LARGE_PINS, activation_checkpointing="full")
        if plan.recommended is None:
            break
        best, seq = f"{seq // 1024}k ({_layout(plan.recommended)})", seq * 2
    return best


def _longest_cell(fits: list[int], shortest_row: str) -> str:
    """The longest of :data:`LONG_SEQS` that fits, or why the shortest does not (its row)."""
    if fits:
        top = max(fits)
        return f"{top // 1024}k" + (" or more" if top == LONG_SEQS[-1] else "")
    why = shortest_row.split(" | ")[3]
    return f"none of {', '.join(f'{s // 1024}k' for s in LONG_SEQS)}: {why}"


def _write(args, name: str, rows: list[str]) -> None:
    if args.out:
        from tp_scaling import _write_table

        _write_table(os.path.join(args.out, "plan.md"), name, "\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="directory holding plan.md (tables replaced)")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tables", nargs="+", default=["base", "published", "pipeline", "long"])
    ap.add_argument("--trace-cache", default=None, help="JSON file keeping the traces")
    args = ap.parse_args()
    if args.trace_cache:
        TRACE_CACHE.append(args.trace_cache)
        print(f"{trace_store.load(args.trace_cache)} traces from {args.trace_cache}", flush=True)
    if "pipeline" in args.tables:
        rows = list(HEAD)
        for model, seq in PIPELINE:
            for nodes in PIPELINE_NODES:
                rows.append(_row(model, seq, nodes, 1024, **LARGE_PINS))
                print(rows[-1], flush=True)
        for model, seq, nodes in BIG:
            rows.append(_row(model, seq, nodes, 1152 if nodes == 36 else 1024, **LARGE_PINS))
            print(rows[-1], flush=True)
        _write(args, "pipeline", rows)
        _write(args, "published-pp", _published(PUBLISHED_PP, **LARGE_PINS))
    if "long" in args.tables:
        rows = list(HEAD)
        longest = ["| model | nodes | longest trainable sequence of the table |", "|---|---|---|"]
        for model, node_counts in LONG:
            for nodes in node_counts:
                fits = []
                for seq in LONG_SEQS:
                    rows.append(_row(model, seq, nodes, 64, **LARGE_PINS))
                    fits += [seq] if " - |" not in rows[-1] else []
                    print(rows[-1], flush=True)
                    _write(args, "long", rows)  # row by row: a stopped run keeps its rows
                cell = _longest_cell(fits, rows[-len(LONG_SEQS)])
                longest.append(f"| {model} | {nodes} | {cell} |")
                _write(args, "longest", longest)
    if "longest" in args.tables:  # a doubling scan (slow: one plan per length)
        scan = ["| model | nodes | longest trainable sequence (power of two) |", "|---|---|---|"]
        for model, node_counts in LONG:
            for nodes in node_counts:
                scan.append(f"| {model} | {nodes} | {_longest(model, nodes)} |")
                print(scan[-1], flush=True)
        _write(args, "longest-scan", scan)
    if "base" in args.tables:
        rows = list(HEAD)
        for model, seq, batch in TABLE:
            for nodes in args.nodes:
                rows.append(_row(model, seq, nodes, batch))
                print(rows[-1], flush=True)
        _write(args, "table", rows)
    if "published" in args.tables:
        _write(args, "published", _published(PUBLISHED))


if __name__ == "__main__":
    main()
