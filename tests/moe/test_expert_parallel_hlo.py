"""Expert parallelism as a Neuron job would trace it (virtual ranks of an 8-rank mesh, ep 4 over
the tp groups; nothing executes): forward + backward hold exactly four all-to-alls of the
``[E*C, H]`` buffers (two forward, two backward) over the mesh's replica groups, no channel id,
no other collective, and ranks 1 and 6 trace the same HLO text (no rank-dependent constant:
Neuron compiles the graph once per job)."""

from __future__ import annotations

import os

import xla_zygote
from neuron_tp.backend.hlo import parse_collectives

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import torch, torch_xla
import neuron_tp as ntp
from neuron_tp.backend.hlo import trace_hlo
from neuron_tp.moe.expert_parallel import expert_parallel_mlp
dev = ntp.xla_device()
for rank in (1, 6):
    torch_xla._XLAC._clear_pending_irs(str(dev))
    torch_xla._XLAC._set_all_reduce_token(str(dev), None)
    mesh = ntp.Mesh.virtual(world_size=8, rank=rank, tp=4)
    g = torch.Generator().manual_seed(rank)  # other data per rank: the graph must not change
    x = torch.randn(6, 8, generator=g).to(dev).requires_grad_(True)
    ids = torch.randperm(8, generator=g)[:2].repeat(6, 1).to(dev)
    w = torch.rand(6, 2, generator=g).to(dev).requires_grad_(True)
    gu = torch.randn(2, 10, 8, generator=g).to(dev).requires_grad_(True)
    dn = torch.randn(2, 8, 5, generator=g).to(dev).requires_grad_(True)
    out = expert_parallel_mlp(
        x, ids, w, gate_up=gu, down=dn, group=mesh.tp, capacity_factor=1.0
    ).output
    out.backward(torch.ones_like(out))
    print(trace_hlo([out, x.grad, w.grad, gu.grad, dn.grad]))
    print("=====")
"""


def test_neuron_form_and_one_graph_for_every_rank():
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    proc = xla_zygote.python(["-c", SCRIPT], env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, six, _ = proc.stdout.split("=====")
    assert one.strip() == six.strip()
    colls = parse_collectives(one)
    cap = -(-1 * 6 * 2 // 8)  # ceil(cf * T * k / E)
    assert [c.kind for c in colls] == ["all-to-all"] * 4, colls
    for c in colls:
        assert c.shape == (8 * cap, 8) and c.replica_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
        assert c.channel_id is None
