"""``comm.all_to_all`` and ``regions.all_to_all_fwd_all_to_all_bwd`` on gloo ranks: groups of 2
(contiguous and strided), 3 and 4 ranks in ONE 4-rank launch, fp32 and bf16, several
(split, concat) dims (cases in a2a_cases.py); bad shapes refused before any collective. The form
emitted for Neuron (a real all-to-all, no channel id) is pinned in
tests/backend/test_xla_multi.py::test_neuron_form_unchanged."""

from __future__ import annotations

import functools

import a2a_cases
import pytest
import torch

import gloo_dist
from neuron_tp.parallel import comm, regions
from neuron_tp.parallel.mesh import Group

CASES = ["world4", "tp_pairs", "dp_pairs", "triple", "single", "bad_input"]


@functools.cache
def _triple() -> Group | None:
    """Ranks 0, 1, 2 of 4 (every rank takes part in creating it); None on rank 3."""
    import torch.distributed as dist

    pg = dist.new_group([0, 1, 2])
    rank = dist.get_rank()
    if rank == 3:
        return None
    return Group("triple", (0, 1, 2), ((0, 1, 2),), rank, process_group=pg)


def _run(group: Group) -> None:
    assert a2a_cases.compare(a2a_cases.checks(group, "cpu")) == 3 * 2 * len(a2a_cases.LAYOUTS)


def _bad_input(mesh) -> None:
    grp = mesh.group("world")
    x = torch.zeros(6, 5)
    with pytest.raises(
        ValueError,
        match=r"split dim 1 of shape \(6, 5\) is not divisible by the "
        r"group size 4 .*multiple of 4.*sizes \[1, 5\]",
    ):
        comm.all_to_all(x, grp, 1, 0)
    with pytest.raises(ValueError, match=r"split dim 0 .* group size 4"):
        regions.all_to_all_fwd_all_to_all_bwd(x.requires_grad_(True), grp, 0, 1)
    with pytest.raises(ValueError, match=r"concat_dim=2 is out of range .*valid: -2 \.\. 1"):
        comm.all_to_all(torch.zeros(8, 4), grp, 0, 2)
    # every rank refused before communicating: the group still works, in step
    y = comm.all_to_all(torch.full((4, 2), float(mesh.rank)), grp, 0, 1)
    assert torch.equal(y, torch.arange(4.0).repeat_interleave(2).view(1, 8))


def _check(case: str) -> None:
    mesh = gloo_dist.shared_mesh(2)
    if case == "world4":
        _run(mesh.group("world"))
    elif case == "tp_pairs":
        _run(mesh.tp)  # [0, 1], [2, 3]
    elif case == "dp_pairs":
        _run(mesh.dp)  # [0, 2], [1, 3]
    elif case == "triple":
        group = _triple()
        if group is not None:
            _run(group)
    elif case == "single":
        one = Group("one", (mesh.rank,), tuple((r,) for r in range(4)), 0)
        x = torch.randn(4, 3)
        assert comm.all_to_all(x, one, 0, 1) is x
    elif case == "bad_input":
        _bad_input(mesh)


@pytest.mark.parametrize("case", CASES)
def test_all_to_all_gloo(case):
    gloo_dist.run_case(_check, case, cases=CASES, world_size=4)
