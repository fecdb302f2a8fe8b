"""The mesh's ``reduce_dtype`` on gloo ranks (tp 4, and dp 4 for ZeRO-1): every cross-rank sum
of bf16 tensors accumulates in fp32, so it equals the exact sum rounded once to bf16.

The data are bf16 values in [0.5, 2): the fp32 sum of four of them is exact, so the expectation
is order-independent; and a bf16 accumulation (what gloo and Neuron do without the option)
rounds after every addition, which changes hundreds of the 4096 sums (checked: the data
discriminate). The same sums executed on XLA devices: tests/backend/xla_multi_cases.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gloo_dist
import neuron_tp as ntp
from neuron_tp.parallel import comm

WORLD, N = 4, 4096
BF16, FP32 = torch.bfloat16, torch.float32


def _per_rank(shape, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(shape, generator=g) * 1.5 + 0.5).to(BF16) for _ in range(WORLD)]


def _exact_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    return sum(x.float() for x in xs).to(BF16)


def _bf16_running_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    out = xs[0]
    for x in xs[1:]:
        out = out + x  # rounded to bf16 at every step
    return out


def _mesh(reduce_dtype):
    # Each case builds its mesh (new process groups, created by every rank in the same order).
    return ntp.Mesh(
        WORLD, dist.get_rank(), tp=WORLD, create_process_groups=True, reduce_dtype=reduce_dtype
    )


def _check(case: str) -> None:
    r = dist.get_rank()
    xs = _per_rank((2, N), seed=1)
    exact = _exact_sum(xs)
    assert (exact != _bf16_running_sum(xs)).sum() > 100  # the data tell the two apart
    if case == "all_reduce":
        got = comm.all_reduce(xs[r], _mesh(FP32).tp)
        assert got.dtype == BF16 and torch.equal(got, exact)
    elif case == "reduce_scatter":
        got = comm.reduce_scatter(xs[r], _mesh(FP32).tp, 1)
        assert got.dtype == BF16 and torch.equal(got, exact.chunk(WORLD, 1)[r])
    elif case == "fp32_unchanged":  # fp32 tensors: reduce_dtype=fp32 changes nothing
        x = xs[r].float()
        assert torch.equal(comm.all_reduce(x, _mesh(FP32).tp), comm.all_reduce(x, _mesh(None).tp))
    elif case == "row_parallel":  # the layer's forward all-reduce of bf16 partial products
        mesh = _mesh(FP32)
        torch.manual_seed(0)
        ref = nn.Linear(64, 32).to(BF16)
        layer = ntp.RowParallelLinear.from_linear(ref, mesh=mesh, input_is_parallel=False)
        x = _per_rank((8, 64), seed=2)[0]
        parts = [F.linear(xc, wc) for xc, wc in zip(x.chunk(WORLD, -1), ref.weight.chunk(WORLD, 1))]
        assert torch.equal(layer(x), _exact_sum(parts) + ref.bias)
    elif case == "zero1_mean":  # ZeRO-1 keeps the wide dp sum for the fp32 masters
        mesh = ntp.Mesh(WORLD, r, tp=1, create_process_groups=True, reduce_dtype=FP32)
        p = nn.Parameter(torch.zeros(N, dtype=BF16))
        zero = ntp.Zero1([p], mesh, lr=1e-3)
        p.grad = xs[r][0].clone()
        zero.reduce_grads()
        chunk = N // WORLD
        want = (sum(x[0].float() for x in xs) / WORLD)[r * chunk : (r + 1) * chunk]
        got = zero.slots["group0.param0"].shard.grad
        assert got.dtype == FP32 and torch.equal(got, want)
    else:
        raise AssertionError(case)


CASES = ("all_reduce", "reduce_scatter", "fp32_unchanged", "row_parallel", "zero1_mean")


@pytest.mark.parametrize("case", CASES)
def test_reduce_dtype_fp32_sums_bf16_exactly(case):
    gloo_dist.run_case(_check, case, cases=CASES, world_size=WORLD)


def test_reduce_dtype_must_be_a_float():
    with pytest.raises(ValueError, match="reduce_dtype must be a floating dtype"):
        ntp.Mesh(2, 0, tp=2, reduce_dtype=torch.int32)
