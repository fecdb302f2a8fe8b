"""Zero1 executed on 2 XLA CPU devices (dp=2; cases in zero1_xla_cases.py): parameters and
clipped gradient norms against plain AdamW on the unsharded model, no compile after warm-up
(one graph per step), each rank holding half of AdamW's moments. Both dtypes are cases of one
launch."""

from __future__ import annotations

import pytest
import zero1_xla_cases

import xla_dist

DTYPES = ("float32", "bfloat16")


@pytest.fixture(scope="module")
def launch() -> xla_dist.Cases:
    return xla_dist.run_cases(zero1_xla_cases.job, DTYPES, devices=2, timeout=600)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero1_xla_dp2(launch, dtype):
    results = launch.get(dtype)
    print(f"\n[zero1 xla dp2 {dtype}] {results}")
    assert [r["rank"] for r in results] == [0, 1]
    numel = 6 * 10 + 10 + 10 * 3 + 3
    for r in results:
        assert r["compiles_in_warmup"] > 0 and r["compiles_after_warmup"] == 0, r
        assert r["host_reads_after_warmup"] == 0, r
        assert r["min_ref_norm"] > zero1_xla_cases.CLIP  # every step clipped
        assert r["exp_avg_numel"] == sum(-(-n // 2) for n in (60, 10, 30, 3)) < numel
        if dtype == "float32":
            assert r["param_diff"] < 2e-5 and r["norm_diff"] < 2e-5, r
        else:  # the fp32 masters of a bf16 model: off by the bf16 forward/backward only
            assert r["param_diff"] < 2e-2 and r["norm_diff"] < 2e-2, r
