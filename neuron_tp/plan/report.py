"""A plan as a table for people and as JSON for tools."""

from __future__ import annotations

import shlex
from dataclasses import asdict
from typing import Any

from .predict import reference_kind
from .search import Candidate, Plan

GIB = 2**30


def _mode(c: Candidate) -> str:
    lay = c.layout
    return lay.tp_mode + ("+sp" if lay.sequence_parallel else "")


def _pipe(c: Candidate) -> str:
    """pp, with the interleaved schedule's virtual stages (``8i2``: 8 stages x 2 chunks)."""
    lay = c.layout
    return f"{lay.pp}" + (f"i{lay.virtual_stages}" if lay.pp_schedule == "interleaved" else "")


def _attn(c: Candidate) -> str:
    return "block" if c.layout.attention == "blockwise" else c.layout.attention


def train_args(plan: Plan, c: Candidate) -> list[str]:
    """The ``neuron-tp train`` options that run ``c`` for the plan's job: the model, the
    layout (tp, mode, micro-batch x gradient accumulation: the global batch over dp), the
    sequence length, the objective (and DPO's reference) and the precision."""
    job = plan.job
    args = ["--model", plan.model] if plan.model else []
    args += c.layout.train_args() + ["--seq-len", str(job.seq_len)]
    if job.objective != "lm":
        args += ["--objective", job.objective]
    if job.reference != "auto":
        args += ["--reference", job.reference]
    return args + (["--bf16"] if job.bf16 else [])


def command(plan: Plan, c: Candidate) -> list[str]:
    """The whole command line of ``c`` on every node: torchrun with the job's size, then
    ``-m neuron_tp.cli train`` and :func:`train_args` (one builder for the text and JSON)."""
    job = plan.job
    launch = ["torchrun", "--nnodes", str(job.nodes), "--nproc_per_node", str(job.per_node)]
    if job.nodes > 1:  # every node rendezvouses at the first one
        launch += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "HEAD_NODE:29500"]
    return launch + ["-m", "neuron_tp.cli", "train", *train_args(plan, c)]


def candidate_dict(plan: Plan, c: Candidate) -> dict:
    """One candidate: layout, its train options and command, memory (bytes), time
    (seconds), throughput, fit."""
    out: dict[str, Any] = {"layout": asdict(c.layout), "train_args": train_args(plan, c)}
    out["command"] = command(plan, c)
    out["fits"] = c.fits
    out["tight"] = c.tight
    if c.timing is not None:
        assert c.memory is not None  # predicted together with the timing
        out["memory_bytes"] = {**asdict(c.memory), "total": c.memory.total}
        out["headroom"] = c.headroom
        out["peak_stage"] = c.stage
        out["step_seconds"] = {**asdict(c.timing), "total": c.timing.step}
        out["sequences_per_s"] = c.seq_per_s
        out["mfu"] = c.mfu
    if c.why:
        out["why"] = c.why
    return out


def plan_dict(plan: Plan, limit: int = 0) -> dict:
    """The whole plan (``limit`` > 0: the first ``limit`` candidates)."""
    job = plan.job
    rec = plan.recommended
    cands = plan.candidates[:limit] if limit else plan.candidates
    return {
        "job": {
            "instance": job.instance.name,
            "nodes": job.nodes,
            "ranks": job.world,
            "seq_len": job.seq_len,
            "global_batch": job.global_batch,
            "bf16": job.bf16,
            "objective": job.objective,
            "reference": reference_kind(job.objective, job.reference),
        },
        "assumptions": {
            "efficiency": job.efficiency,
            "memory_fraction": job.memory_fraction,
            "usable_bytes_per_core": job.usable_bytes,
            "collective_latency_s": job.instance.collective_latency,
            "sources": list(job.instance.sources),
        },
        "parameters": {"total": plan.params[0], "active_per_token": plan.params[1]},
        "model_summary": plan.summary,
        "verdict": plan.verdict,
        "recommended": candidate_dict(plan, rec) if rec else None,
        "candidates": [candidate_dict(plan, c) for c in cands],
        "notes": plan.notes,
        "plan_seconds": plan.seconds,
        "traces": plan.traces,
    }


def memory_total(c: Candidate) -> float:
    """Bytes per core of a predicted candidate (its worst stage)."""
    assert c.memory is not None, "only predicted candidates have a memory"
    return c.memory.total


def _ref_head(job) -> str:
    """The reference column of ``--objective dpo`` (empty for the other objectives)."""
    return f"{'ref':>5} " if job.objective == "dpo" else ""


def _objective_line(job) -> list[str]:
    if job.objective == "lm":
        return []
    line = (
        f"objective {job.objective}: --global-batch and --micro-batch count pairs, two rows "
        "each (activations and compute of 2 x --micro-batch rows); seq/s is pairs/s"
    )
    if job.objective == "dpo":
        kind = reference_kind(job.objective, job.reference)
        line += (
            f"; reference {kind} (ref: adapters 0, copy one more set of the sharded weights, "
            "precompute 2 fp32 per pair of a rank's data"
            + (f", {job.pairs or job.global_batch} pairs)" if kind == "precompute" else ")")
        )
    return [line]


def plan_table(plan: Plan, limit: int = 20) -> str:
    """The ranked candidates as a text table, then the recommendation or the verdict."""
    job = plan.job
    tokens = job.seq_len
    head = (
        f"{'#':>3} {'tp':>3} {'mode':>6} {'pp':>4} {'cp':>2} {'dp':>4} {'attn':>5} {'mb':>3} "
        f"{'acc':>4} {'recomp':>9} "
        f"{'zero1':>5} | {'params':>6} {'grads':>6} {'optim':>6} {'activ':>6} {'buf':>5} "
        f"{_ref_head(job)}{'total':>6} GiB | {'step s':>7} {'seq/s':>7} {'tok/s':>9} "
        f"{'MFU':>5} | fit"
    )
    lines = [
        f"plan: {job.nodes} x {job.instance.name} ({job.world} ranks), seq {job.seq_len}, "
        f"global batch {job.global_batch}, {'bf16' if job.bf16 else 'fp32'}; per NeuronCore: "
        f"{job.usable_bytes / GIB:.1f} GiB usable ({job.memory_fraction:.0%} of "
        f"{job.instance.hbm_per_core / GIB:.0f}); compute at {job.efficiency:.0%} of peak",
        *plan.summary,
        *_objective_line(job),
        head,
        "-" * len(head),
    ]
    refused: set[tuple] = set()
    for i, c in enumerate(plan.candidates[:limit], 1):
        lay = c.layout
        row = (
            f"{i:>3} {lay.tp:>3} {_mode(c):>6} {_pipe(c):>4} {lay.cp:>2} {lay.dp:>4} "
            f"{_attn(c):>5} {lay.micro_batch:>3} {lay.grad_accum:>4} "
            f"{lay.activation_checkpointing:>9} "
            f"{'yes' if lay.zero1 else 'no':>5} | "
        )
        if c.memory is None or c.timing is None:  # once per tp, mode and reason
            if (lay.tp, _mode(c), c.why) not in refused:
                refused.add((lay.tp, _mode(c), c.why))
                lines.append(row + f"cannot run (any micro-batch, recompute): {c.why}")
            continue
        m, t = c.memory, c.timing
        assert t is not None  # predicted together with the memory
        row += " ".join(
            f"{v / GIB:>6.2f}" for v in (m.params, m.grads, m.optimizer + m.masters, m.activations)
        )
        ref = f"{m.reference / GIB:>5.2f} " if _ref_head(job) else ""
        row += f" {m.comm_buffer / GIB:>5.2f} {ref}{m.total / GIB:>6.2f}     | "
        row += f"{t.step:>7.2f} {c.seq_per_s:>7.2f} {c.seq_per_s * tokens:>9.0f} {c.mfu:>5.1%} | "
        if c.fits:
            lines.append(row + (f"tight ({c.headroom:.0%} free)" if c.tight else "yes"))
        else:
            lines.append(row + "NO: " + c.why)
    if len(plan.candidates) > limit:
        lines.append(f"... {len(plan.candidates) - limit} more (--top N, --json)")
    rec = plan.recommended
    if rec:
        rt = rec.timing
        assert rt is not None  # a recommended candidate fits: it was predicted
        extra = "".join(
            f" + {name} {value:.2f}"
            for name, value in (
                ("pipeline bubble", rt.bubble),
                ("stage sends", rt.pp_comm),
                ("cp ring", rt.cp_comm),
            )
            if value
        )
        where = f" (peak on stage {rec.stage} of {rec.layout.pp})" if rec.layout.pp > 1 else ""
        lines.append(
            f"recommended: {shlex.join(command(plan, rec))}  # predicted "
            f"{rec.seq_per_s:.1f} seq/s ({rec.seq_per_s * tokens:,.0f} tokens/s), step "
            f"{rt.step:.2f} s = compute {rt.compute:.2f} + tp comm {rt.tp_comm:.2f} + grad "
            f"reduction {rt.step_comm:.2f} + optimizer {rt.optimizer:.2f}{extra}; "
            f"{memory_total(rec) / GIB:.2f} GiB per core{where}"
        )
    else:
        lines.append(f"nothing fits: {plan.verdict}")
    lines += [f"note: {n}" for n in plan.notes]
    lines.append(f"planned in {plan.seconds:.1f} s ({plan.traces} traced steps)")
    return "\n".join(lines)
