"""Ring attention (neuron_tp.layers.ring_attention) over the cp ring against sdpa on the full
sequence: the output and the gradients of q, k and v, causal, at cp 2 and 4, MHA / GQA / MQA,
chunks that are not multiples of the block, scores large enough that the log-sum-exp merge
must shift by the max; the load-balanced chunk order; a length the ring cannot split refused.
On gloo ranks (cp 2 and 4) and on 4 XLA CPU devices (cp 4: three hops, every rank traces
the same graph; one launch)."""

from __future__ import annotations

import functools

import pytest
import ring_attention_cases as rc

import gloo_dist
import xla_dist


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("case", rc.NAMES)
def test_ring_attention_gloo(case, cp):
    gloo_dist.run_case(rc.check, case, cases=rc.NAMES, world_size=cp)


@functools.cache
def _xla(cp: int):
    return xla_dist.run_cases(rc.xla_job, rc.XLA_NAMES, devices=cp)


@pytest.mark.parametrize("case", rc.XLA_NAMES)
def test_ring_attention_xla(case):
    per_rank = _xla(4).get(case)
    if case in rc.CASES:
        assert all(h == per_rank[0] for h in per_rank), "ranks traced different graphs"
