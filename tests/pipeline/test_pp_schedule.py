"""Schedules as data: every task exactly once, dependencies respected in lockstep ticks, the
1F1B memory bound, the bubble of the ticks equal to the textbook formula, refusals; the
forward-only schedule of evaluation (any number of micro-batches)."""

from __future__ import annotations

import pytest

from neuron_tp.errors import UserError
from neuron_tp.pipeline.schedule import build, forward_only
from neuron_tp.pipeline.stages import plan_stages

SHAPES = [("1f1b", p, m, 1) for p in (2, 3, 4) for m in (p, 4, 8)] + [
    ("interleaved", p, m, v) for p in (2, 4) for m in (p, 2 * p, 8) for v in (2, 3)
]


def _when(s) -> dict:
    out = {}
    for t, tick in enumerate(s.ticks):
        for stage, task in enumerate(tick):
            if task is not None:
                key = (task.kind, task.micro, s.virtual_stage(stage, task.chunk))
                assert key not in out, f"{key} twice"
                out[key] = t
    return out


@pytest.mark.parametrize("name,p,m,v", SHAPES)
def test_dependencies_and_bubble(name, p, m, v):
    s = build(name, p, m, v)
    when, last = _when(s), p * v - 1
    assert len(when) == 2 * m * p * v  # every F and B of every micro-batch on every piece
    for mb in range(m):
        for j in range(p * v):
            f, b = when[("F", mb, j)], when[("B", mb, j)]
            assert f < b
            if j > 0:  # the activation arrives through the exchange of an earlier tick
                assert when[("F", mb, j - 1)] < f
            if j < last:
                assert when[("B", mb, j + 1)] < b
    assert s.tick_bubble == pytest.approx(s.predicted_bubble)
    if name == "1f1b":
        assert s.in_flight(0) <= p
        assert [s.in_flight(i) for i in range(p)] == [min(p - i, m) for i in range(p)]
    assert f"bubble {s.predicted_bubble:.1%}" in s.summary()


@pytest.mark.parametrize("p,m,v", [(2, 1, 1), (2, 3, 1), (4, 5, 1), (2, 3, 2), (4, 2, 2)])
def test_forward_only(p, m, v):
    s = forward_only(p, m, v)
    when = _when(s)
    assert len(when) == m * p * v and all(kind == "F" for kind, _, _ in when)
    for mb in range(m):
        for j in range(1, p * v):
            assert when[("F", mb, j - 1)] < when[("F", mb, j)]
    if v == 1:  # the textbook pipeline fill and drain
        assert len(s.ticks) == m + p - 1


def test_refusals_name_what_works():
    with pytest.raises(UserError, match="at least 4"):
        build("1f1b", 4, 3)
    with pytest.raises(UserError, match="multiple of 4"):
        build("interleaved", 4, 6, 2)
    with pytest.raises(UserError, match="interleaved"):
        build("1f1b", 2, 4, 2)
    with pytest.raises(UserError, match="valid: 1f1b, interleaved"):
        build("gpipe", 2, 4)
    with pytest.raises(UserError, match=r"valid pp at 1 virtual stage\(s\): \[1, 2, 3, 6\]"):
        plan_stages(6, 4)


def test_stage_plans():
    assert plan_stages(8, 4).bounds == ((0, 2), (2, 4), (4, 6), (6, 8))
    assert plan_stages(8, 2, 2).layers(1, 1) == range(6, 8)
    assert plan_stages(6, 2, cuts=[2]).bounds == ((0, 2), (2, 6))
    # balanced by parameters: the embedding and head weigh two layers each
    plan = plan_stages(8, 2, layer_params=10, first_params=20, last_params=20)
    assert plan.bounds == ((0, 4), (4, 8))
    plan = plan_stages(8, 3, layer_params=10, first_params=20, last_params=0)
    sizes = [b - a for a, b in plan.bounds]
    assert sizes[0] < min(sizes[1:]) and sum(sizes) == 8  # the embedding's stage: fewer layers
    with pytest.raises(UserError, match="increasing"):
        plan_stages(6, 2, cuts=[7])
