"""The mesh's rank layout with pipeline and context axes (world = pp x dp x cp x tp).

The groups are checked against coordinates decoded independently of the mesh code (a rank's
digits in the mixed radix pp, dp, cp, tp): an axis' group is exactly the ranks that differ from
this one in that axis' digit(s) alone, and every axis' groups partition the world. (The
process groups are made from these lists; the pipeline tests run collectives on them.)"""

from __future__ import annotations

import itertools

import pytest

import neuron_tp as ntp
from neuron_tp.errors import UserError


def _digits(rank: int, dims: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    pp, dp, cp, tp = dims
    t = rank % tp
    c = rank // tp % cp
    d = rank // (tp * cp) % dp
    p = rank // (tp * cp * dp)
    return p, d, c, t


AXES = {"pp": (0,), "dp": (1,), "cp": (2,), "tp": (3,), "dp_cp": (1, 2), "world": (0, 1, 2, 3)}
SHAPES = [(2, 1, 1, 2), (4, 1, 1, 1), (2, 2, 1, 2), (1, 2, 2, 2), (2, 3, 2, 1), (3, 1, 2, 2)]


@pytest.mark.parametrize("dims", SHAPES, ids=lambda d: "pp{}-dp{}-cp{}-tp{}".format(*d))
def test_every_axis_varies_only_its_own_digits(dims):
    pp, dp, cp, tp = dims
    world = pp * dp * cp * tp
    for rank in range(world):
        mesh = ntp.Mesh(world, rank, tp=tp, pp=pp, cp=cp)
        mine = _digits(rank, dims)
        assert (mesh.pp_size, mesh.dp_size, mesh.cp_size, mesh.tp_size) == dims
        for axis, varying in AXES.items():
            group = mesh.group(axis)
            fixed = [i for i in range(4) if i not in varying]
            expect = [r for r in range(world) if all(_digits(r, dims)[i] == mine[i] for i in fixed)]
            assert sorted(group.ranks) == expect, (axis, rank)
            assert group.ranks[group.rank] == rank
            covered = sorted(itertools.chain.from_iterable(group.all_groups))
            assert covered == list(range(world)), axis  # a partition of the world
        assert mesh.replicas is mesh.group("dp_cp")
        assert (mesh.pp.rank, mesh.dp_rank, mesh.cp.rank, mesh.tp_rank) == mine


def test_expert_parallel_blocks_stay_inside_a_stage_and_a_ring_position():
    pp, dp, cp, tp, ep = 2, 4, 1, 2, 2
    world = pp * dp * cp * tp
    for rank in range(world):
        mesh = ntp.Mesh(world, rank, tp=tp, pp=pp, cp=cp, ep=ep)
        p, d, c, t = _digits(rank, (pp, dp, cp, tp))
        for other in mesh.group("ep").ranks:
            op, od, oc, ot = _digits(other, (pp, dp, cp, tp))
            assert (op, oc, ot, od // ep) == (p, c, t, d // ep)
        for other in mesh.group("edp").ranks:
            op, od, oc, ot = _digits(other, (pp, dp, cp, tp))
            assert (op, oc, ot, od % ep) == (p, c, t, d % ep)


@pytest.mark.parametrize(
    ("world", "kwargs", "says"),
    [
        (8, {"tp": 2, "pp": 3}, "pp=3 x cp=1 x tp=2 = 6 does not divide the world size 8"),
        (8, {"tp": 2, "cp": 0}, "cp must be a positive integer"),
        (8, {"tp": 2, "pp": 2, "ep": 4}, "ep=4 does not divide the data-parallel degree 2"),
    ],
)
def test_refusals_name_what_would_work(world, kwargs, says):
    with pytest.raises(UserError) as e:
        ntp.Mesh(world, 0, **kwargs)
    assert says in str(e.value), str(e.value)
