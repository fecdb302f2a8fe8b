"""``comm.all_to_all`` and its region EXECUTED on 4 XLA CPU devices of one process (one
launch): groups of 2 (contiguous and strided) and 4, fp32 and bf16, three (split, concat) dim
pairs, forward and backward bit-exact against the host computation (a2a_cases.py). On this
runtime the exchange is carried by a channel-id all-gather (torch-xla 2.9 has no channel-id
all-to-all)."""

from __future__ import annotations

import a2a_cases

import xla_dist


def test_all_to_all_xla_devices():
    results = xla_dist.run(a2a_cases.xla_job, devices=4, timeout=600)
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    per_group = 2 * len(a2a_cases.XLA_LAYOUTS) * len(a2a_cases.DTYPES)
    assert all(r["checks"] == 3 * per_group for r in results)
    for r in results:
        (coll,) = r["form"]
        assert coll.kind == "all-gather" and coll.channel_id == 1 and coll.global_device_ids
        assert coll.replica_groups == ((0, 1, 2, 3),) and coll.shape == (4, 4, 3)
