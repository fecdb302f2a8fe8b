"""Expert parallelism on gloo ranks, ONE 4-rank launch: ep 2 (two groups), ep 3 and ep 4,
ep 2 x tp 2 (experts over the dp pairs, each a tp slice of its intermediate dim), 1 expert per
rank with k=3, dropless by default (also when a token picks one expert twice) and with capacity
factors (large: exact; small: the documented drops, counted), against the loop over experts on
the unsharded weights (ep_cases.py): outputs and gradients of x, the routing weights and the
local experts. Bad shapes are refused before any collective."""

from __future__ import annotations

import dataclasses
import functools

import ep_cases
import pytest
import torch

import gloo_dist
from neuron_tp.moe.expert_parallel import expert_capacity, expert_parallel_mlp
from neuron_tp.parallel.mesh import Group

Case = ep_cases.Case
CASES = {
    "ep2": ("tp", Case()),
    "ep4": ("world", Case()),
    "ep3_of_4_ranks": ("triple", Case(experts=6, seed=5)),
    "ep4_one_expert_per_rank_k3": ("world", Case(experts=4, k=3, tokens=5, seed=1)),
    "ep2_x_tp2": ("dp", Case(seed=2)),
    "ep4_capacity_large_exact": ("world", Case(capacity_factor=4.0, skew=2.0, seed=3)),
    "ep4_capacity_small_drops": ("world", Case(capacity_factor=0.5, skew=2.0, seed=3)),
    "ep2_capacity_drops": ("tp", Case(tokens=12, capacity_factor=1.0, skew=1.5, seed=4)),
    # every token picks expert 0 twice: 2T pairs for a T-row buffer unless repeats fold
    "ep4_repeated_expert_dropless": ("world", Case(skew=6.0, repeat=True, seed=6)),
    "bad_input": (None, None),
}


def _bad_input(mesh) -> None:
    grp = mesh.group("world")
    x, ids, w = torch.randn(6, 10), torch.zeros(6, 2, dtype=torch.long), torch.rand(6, 2)
    gu, dn = torch.randn(2, 12, 10), torch.randn(2, 10, 6)
    bad = [
        (dict(x=x[None]), r"x must be \[tokens, hidden\], got shape \(1, 6, 10\)"),
        (dict(ids=ids[:5]), r"topk_ids must be \[tokens=6, k\], got shape \(5, 2\)"),
        (dict(ids=ids.float()), r"integer expert ids, got torch.float32"),
        (dict(w=w[:, :1]), r"topk_weights must have topk_ids' shape \(6, 2\), got \(6, 1\)"),
        (dict(gu=gu[:, :11]), r"gate_up must be \[local experts, 2\*intermediate, hidden=10\]"),
        (dict(dn=dn[:, :, :5]), r"down must be \[local experts=2, hidden=10, intermediate=6\]"),
        (
            dict(ids=torch.zeros(6, 9, dtype=torch.long), w=torch.rand(6, 9)),
            r"top-k=9 must be between 1 and the number of experts 2 x ep 4 = 8",
        ),
        (dict(cf=0.0), r"capacity_factor must be > 0 \(or None: dropless\), got 0.0"),
    ]
    for change, msg in bad:
        a = dict(x=x, ids=ids, w=w, gu=gu, dn=dn, cf=None) | change
        with pytest.raises(ValueError, match=msg):
            expert_parallel_mlp(
                a["x"],
                a["ids"],
                a["w"],
                gate_up=a["gu"],
                down=a["dn"],
                group=grp,
                capacity_factor=a["cf"],
            )
    # nobody communicated: the group still works, in step
    out = expert_parallel_mlp(x, ids, w, gate_up=gu, down=dn, group=grp).output
    assert out.shape == (6, 10)
    assert expert_capacity(7, 2, 8, None) == 7 and expert_capacity(7, 2, 8, 0.5) == 1
    assert expert_capacity(256, 2, 8, 1.25) == 80 and expert_capacity(7, 2, 8, 100.0) == 7


@functools.cache
def _triple() -> Group | None:
    """Ranks 0, 1, 2 of 4 (every rank takes part in creating it); None on rank 3."""
    import torch.distributed as dist

    pg = dist.new_group([0, 1, 2])
    if dist.get_rank() == 3:
        return None
    return Group("triple", (0, 1, 2), ((0, 1, 2),), dist.get_rank(), process_group=pg)


def _check(name: str) -> None:
    mesh = gloo_dist.shared_mesh(2)
    axis, case = CASES[name]
    if axis is None:
        return _bad_input(mesh)
    ep = _triple() if axis == "triple" else mesh.group(axis)
    if ep is None:
        return None
    case = dataclasses.replace(case, seed=case.seed + 10 * ep.ranks[0])  # differs per ep group
    tp_rank, tp = (mesh.tp_rank, 2) if axis == "dp" else (0, 1)
    pending = ep_cases.checks(case, ep, tp_rank, tp)
    ep_cases.compare(pending)
    dropped = dict((w.split()[0], want) for w, _, want in pending)["dropped"]
    if "drops" in name:
        assert dropped > 0, "the case must drop pairs to test capacity"
    if "exact" in name:
        assert (
            dropped == 0
            and expert_capacity(case.tokens, case.k, case.experts, case.capacity_factor)
            == case.tokens
        )


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_gloo(name):
    gloo_dist.run_case(_check, name, cases=list(CASES), world_size=4)
