"""Check 2a: every collective of :mod:`neuron_tp.parallel.comm` gives exact results.

all_reduce / all_gather / reduce_scatter on the tp groups, the dp groups and the whole world,
in fp32 and bf16, on several shapes and dims. Inputs are small integers drawn from the rank
and the position, so every rank can compute every other rank's input, and every sum is exact
in bf16 too: any difference is a fault of the collective, never rounding.
"""

from __future__ import annotations

import torch

from ..parallel import comm
from ..parallel.mesh import Group
from ..pipeline.exchange import Exchange, Sent
from .context import Context, describe_group
from .report import Check

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def shapes(size: int, quick: bool) -> list[tuple[tuple[int, ...], int]]:
    """(shape, dim) cases for a group of ``size`` ranks: the dim is divisible by ``size``
    (reduce-scatter splits it); dims other than 0 included, and an odd extent."""
    cases = [((2 * size, 3), 0), ((3, 2 * size, 5), 1)]
    return cases[:1] + [((2, 3 * size), -1)] if quick else cases + [((2, 3 * size), -1)]


def rank_input(world_rank: int, shape: tuple[int, ...], salt: int) -> torch.Tensor:
    """The input of ``world_rank``: integers in [-2, 2], different per rank, position and case
    (so sums over up to 128 ranks are exact in bf16)."""
    n = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).view(shape)
    return ((n * 7 + world_rank * 13 + salt * 5) % 5 - 2).float()


def expected(op: str, group: Group, shape, dim: int, salt: int) -> torch.Tensor:
    """What ``op`` must return on this rank, computed on the host from every rank's input."""
    inputs = [rank_input(r, shape, salt) for r in group.ranks]
    if op == "all_gather":
        return torch.cat(inputs, dim)
    total = torch.stack(inputs).sum(0)
    if op == "all_reduce":
        return total
    return total.chunk(group.size, dim)[group.rank]


def diagnose(op: str, got: torch.Tensor, group: Group, shape, dim: int, salt: int) -> str:
    """What the wrong result looks like: a missing rank's contribution, a chunk from the wrong
    rank, or the first differing element."""
    inputs = [rank_input(r, shape, salt) for r in group.ranks]
    want = expected(op, group, shape, dim, salt)
    if op != "all_gather":
        for i, r in enumerate(group.ranks):
            missing = torch.stack([x for j, x in enumerate(inputs) if j != i]).sum(0)
            if op == "reduce_scatter":
                missing = missing.chunk(group.size, dim)[group.rank]
            if torch.equal(got, missing):
                return f"rank {r}'s contribution is missing from the sum"
    else:
        bad = []
        for pos, chunk in enumerate(got.chunk(group.size, dim)):
            if not torch.equal(chunk, inputs[pos]):
                src = [group.ranks[j] for j, x in enumerate(inputs) if torch.equal(chunk, x)]
                what = f"rank {src[0]}'s data" if src else "data of no rank"
                bad.append(f"chunk {pos} (rank {group.ranks[pos]}'s) holds {what}")
        if bad:
            return "; ".join(bad)
    diff = (got - want).abs()
    idx = tuple(int(i) for i in torch.nonzero(diff)[0]) if diff.any() else ()
    return (
        f"{int((diff > 0).sum())} of {want.numel()} elements differ, max |error| "
        f"{float(diff.max()):g}; first at {list(idx)}: got {float(got[idx]):g}, "
        f"want {float(want[idx]):g}"
    )


def run_op(op: str, x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    """``op`` through the library's one collective module."""
    if op == "all_reduce":
        return comm.all_reduce(x, group)
    if op == "all_gather":
        return comm.all_gather(x, group, dim)
    return comm.reduce_scatter(x, group, dim)


def label(op: str, group: Group, dtype: str, shape, dim: int) -> str:
    """How the report and the watchdog name one collective."""
    return f"{op} on the {describe_group(group)}, {dtype}, shape {list(shape)} dim {dim}"


def check_collectives(ctx: Context) -> Check:
    """Exact results of every collective, group, dtype and shape (see the module doc)."""
    c = Check("collectives")
    done = 0
    failed_dtypes: dict[str, set[str]] = {}
    for group in ctx.groups():
        if group.size == 1:
            continue
        for dname, dtype in DTYPES.items():
            for op in OPS:
                # every shape of one (collective, group, dtype) in one graph: what a hang
                # names; fewer graphs to compile
                cases = list(enumerate(shapes(group.size, ctx.options.quick)))
                what = f"{op} on the {describe_group(group)}, {dname}"
                with ctx.watchdog.doing(what, ctx.stage_limit):
                    outs = []
                    for salt, (shape, dim) in cases:
                        x = rank_input(ctx.rank, shape, salt).to(dtype).to(ctx.device)
                        outs.append(run_op(op, x, group, dim))
                    ctx.sync()
                    outs = [o.cpu().float() for o in outs]
                for (salt, (shape, dim)), got in zip(cases, outs):
                    what = label(op, group, dname, shape, dim)
                    done += 1
                    want = expected(op, group, shape, dim, salt)
                    if got.shape != want.shape:
                        c.fail(f"{what}: shape {list(got.shape)}, want {list(want.shape)}")
                    elif not torch.equal(got, want):
                        why = diagnose(op, got, group, shape, dim, salt)
                        c.fail(f"rank {ctx.rank}: {what}: {why}")
                        failed_dtypes.setdefault(f"{op} {group.name}", set()).add(dname)
    done += check_stage_exchange(ctx, c)
    c.numbers = {"collectives": done}
    wrong = len(c.failures)
    c.summary = (
        f"{wrong} of {done} results wrong on rank {ctx.rank}"
        if wrong
        else f"{done} collectives exact (all_reduce, all_gather, reduce_scatter, the pipeline "
        "stage exchange; fp32, bf16)"
    )
    c.hint = hint(ctx, c, failed_dtypes)
    return c


def check_stage_exchange(ctx: Context, c: Check) -> int:
    """The pipeline stage exchange (:mod:`neuron_tp.pipeline.exchange`) with the world as a
    ring of stages: every rank sends its input forward and another backward in one exchange
    and must receive exactly its previous rank's and its next rank's (every pair, both
    directions). Returns the number of results checked."""
    world = ctx.mesh.group("world")
    if world.size == 1:
        return 0
    done = 0
    for dname, dtype in DTYPES.items():
        shape = (2, 3, 4)
        ex = Exchange(world, shape, dtype, ctx.device)
        what = f"stage exchange ({ex.method}) over the {describe_group(world)}, {dname}"
        with ctx.watchdog.doing(what, ctx.stage_limit):
            sent = Sent(
                *(rank_input(ctx.rank, shape, salt).to(dtype).to(ctx.device) for salt in (11, 12))
            )
            ctx.sync()
            ex.meet()
            fwd, bwd = ex(sent, True, True)
            ctx.sync()
            if fwd is None or bwd is None:  # both directions are expected
                raise RuntimeError(f"rank {ctx.rank}: {what}: a buffer was not received")
            got = [fwd.cpu().float(), bwd.cpu().float()]
        p, r = world.size, world.rank
        sources = (
            (world.ranks[(r - 1) % p], 11, "forward"),
            (world.ranks[(r + 1) % p], 12, "backward"),
        )
        for g, (src, salt, direction) in zip(got, sources):
            done += 1
            if not torch.equal(g, rank_input(src, shape, salt)):
                c.fail(f"rank {ctx.rank}: {what}: the {direction} buffer is not rank {src}'s")
    return done


def hint(ctx: Context, c: Check, failed_dtypes: dict[str, set[str]]) -> str:
    """What the failures mean, per collective and group that failed (one tip per meaning)."""
    spans = {g.name: ctx.nodes(g) > 1 for g in ctx.groups()}
    tips: dict[str, list[str]] = {}
    for key, dtypes in sorted(failed_dtypes.items()):
        if dtypes == {"bf16"}:
            tip = (
                "only bf16 is wrong: the runtime's bf16 sum is inexact (accumulation dtype); "
                "sum in fp32 (init_mesh(reduce_dtype=torch.float32), as train --bf16 does) and "
                "report the runtime version"
            )
        elif spans.get(key.split()[1]):
            tip = (
                "wrong only on groups that span nodes: check EFA (FI_PROVIDER=efa, "
                "FI_EFA_USE_DEVICE_RDMA=1, every EFA interface attached, security group open)"
            )
        else:
            tip = (
                "the collective returns wrong data: report it with the --json output and the "
                "Neuron runtime / torch-xla versions"
            )
        tips.setdefault(tip, []).append(key)
    return "; ".join(f"{', '.join(keys)}: {tip}" for tip, keys in tips.items())
