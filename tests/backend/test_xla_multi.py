"""The XLA path EXECUTED on several XLA CPU devices of one process (xmp.spawn, one thread per
device; harness in xla_dist.py, cases in xla_multi_cases.py): every region function,
column/row-parallel linears, vocab-parallel embedding and cross-entropy against the unsharded
computation, at tp=4 and tp2 x dp2 (two tp groups of 2 in one launch). Also pins the two forms
of XLA collectives: the channel-id form these devices execute, and the form emitted on Neuron
(unchanged)."""

from __future__ import annotations

import os
import threading

import pytest
import xla_multi_cases

import neuron_tp as ntp
import xla_dist
import xla_zygote
from neuron_tp.backend.hlo import parse_collectives


def _tp_groups(world: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous blocks of tp ranks, computed here independently of the mesh."""
    return tuple(tuple(range(s, s + tp)) for s in range(0, world, tp))


def _check_run(results: list[dict], world: int, tps: tuple[int, ...]) -> None:
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["world"] == world for r in results)
    assert len({r["checks"] for r in results}) == 1 and results[0]["checks"] >= 100 * len(tps)
    for res in results:
        for tp in tps:
            colls = res["forms"][tp]
            assert [c.kind for c in colls] == ["all-reduce", "all-gather", "reduce-scatter"]
            for c in colls:  # what XLA:CPU needs to execute across its device threads
                assert c.channel_id == 1 and c.global_device_ids, c
                assert tuple(sorted(c.replica_groups)) == _tp_groups(world, tp), c
            assert colls[0].shape == (3 * 4 * tp,)  # all-reduce operand flattened to 1-D


def test_executed_tp4_and_tp2_dp2():
    _check_run(xla_dist.run(xla_multi_cases.job, (4, 2), devices=4, timeout=300), 4, (4, 2))


NEURON_FORM = """
import torch, torch_xla, neuron_tp as ntp
import torch_xla.core.xla_model as xm
from neuron_tp import comm
from neuron_tp.backend.hlo import trace_hlo
mesh = ntp.Mesh.virtual(world_size=8, rank=5, tp=4)
dev = ntp.xla_device()
x = torch.ones(3, 8, device=dev)
print(trace_hlo([comm.all_reduce(x, mesh.tp), comm.all_gather(x, mesh.tp, 1),
                 comm.reduce_scatter(x, mesh.tp, 1), comm.all_to_all(x, mesh.tp, 1, 0)]))
print("=====")
torch_xla._XLAC._set_all_reduce_token(str(dev), None)  # a fresh ordering token
G = [[0, 1, 2, 3], [4, 5, 6, 7]]
print(trace_hlo([torch_xla._XLAC._xla_all_reduce(xm.REDUCE_SUM, x, 1.0, G, False),
                 xm.all_gather(x, dim=1, groups=G, pin_layout=False),
                 xm.reduce_scatter(xm.REDUCE_SUM, x, scale=1.0, scatter_dim=1, shard_count=4,
                                   groups=G, pin_layout=False),
                 xm.all_to_all(x, 1, 0, 4, groups=G, pin_layout=False)]))
"""


def test_neuron_form_unchanged():
    """On Neuron (and for virtual meshes, which model a Neuron job) comm emits what it always
    did, NxD's form: no channel ids, the mesh's replica groups, the token-ordered all-reduce.
    The HLO equals that of the direct torch-xla calls of that form, text for text."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": xla_dist.REPO}
    proc = xla_zygote.python(["-c", NEURON_FORM], env, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours, direct = proc.stdout.split("=====")
    assert ours.strip() == direct.strip()
    colls = parse_collectives(ours)
    assert [(c.kind, c.shape) for c in colls] == [
        ("all-reduce", (3, 8)),
        ("all-gather", (3, 32)),
        ("reduce-scatter", (3, 8)),
        ("all-to-all", (3, 8)),  # a real all-to-all on Neuron (XLA:CPU: see all_to_all_xla)
    ]
    for c in colls:
        assert c.channel_id is None and not c.global_device_ids, c
        assert c.replica_groups == _tp_groups(8, 4), c
    assert "channel_id" not in ours and "use_global_device_ids" not in ours
    assert "(f32[3,8]{1,0}, f32[]) all-reduce(" in ours  # the ordering token rides along


def test_default_mesh_is_per_thread():
    """xmp.spawn ranks are threads of one process: each sees the mesh it set; a thread that
    set none falls back to the process-wide one, unless ranks disagree (then a clear error)."""
    meshes = [ntp.Mesh.virtual(world_size=2, rank=r, tp=2) for r in range(2)]
    both_set, checked = threading.Barrier(3), threading.Barrier(3)
    seen, errors = {}, []

    def rank_thread(r):
        ntp.set_default_mesh(meshes[r])
        both_set.wait()
        seen[r] = ntp.get_mesh()
        checked.wait()
        ntp.set_default_mesh(None)

    def other_thread():
        try:
            ntp.get_mesh()
        except RuntimeError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    both_set.wait()
    probe = threading.Thread(target=other_thread)
    probe.start()
    probe.join()
    checked.wait()
    for t in threads:
        t.join()
    assert seen == {0: meshes[0], 1: meshes[1]}
    assert len(errors) == 1 and "different ranks [0, 1]" in errors[0]
    try:  # one rank (the usual single-threaded job): other threads fall back to its mesh
        ntp.set_default_mesh(meshes[1])
        fallback = []
        probe = threading.Thread(target=lambda: fallback.append(ntp.get_mesh()))
        probe.start()
        probe.join()
        assert fallback == [meshes[1]]
    finally:
        ntp.set_default_mesh(None)
    with pytest.raises(RuntimeError, match="no mesh"):
        ntp.get_mesh()
