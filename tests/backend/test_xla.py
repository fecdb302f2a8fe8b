"""The XLA path: collectives traced for one rank of a 32-rank job on a single CPU device
(Mesh.virtual), and a tp=1 block executed on the real XLA CPU device."""

import pytest

import xla_zygote
from neuron_tp.backend.hlo import parse_collectives

B, S, H, FFN = 2, 16, 64, 256
WORLD, TP, RANK = 32, 8, 5

MLP_TRACE = f"""
import torch, neuron_tp as ntp
from neuron_tp.backend.hlo import trace_hlo
mesh = ntp.Mesh.virtual(world_size={WORLD}, rank={RANK}, tp={TP})
dev = ntp.xla_device()
sp = {{sp}}
col = ntp.ColumnParallelLinear({H}, {FFN}, mesh=mesh, sequence_parallel=sp).to(dev)
row = ntp.RowParallelLinear({FFN}, {H}, mesh=mesh, sequence_parallel=sp).to(dev)
x = torch.randn({B}, {S} // ({TP} if sp else 1), {H}, device=dev, requires_grad=True)
y = row(torch.nn.functional.gelu(col(x)))
y.square().sum().backward()
print(trace_hlo([y, x.grad, col.weight.grad, row.weight.grad]))
"""


def _expected_groups():
    # tp groups are contiguous blocks of TP ranks, computed here independently of the mesh
    return tuple(tuple(range(s, s + TP)) for s in range(0, WORLD, TP))


def _summary(colls):
    return sorted((c.kind, c.shape, c.replica_groups) for c in colls)


@pytest.mark.parametrize("sp", [False, True])
def test_mlp_collectives_virtual_world32_tp8(sp):
    # a fresh process per trace (see neuron_tp.backend.hlo.collectives_in_fresh_process),
    # forked from the zygote that has the imports
    out = xla_zygote.python(["-c", MLP_TRACE.format(sp=sp)], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    colls = parse_collectives(out.stdout)
    full = (B, S, H)
    if sp:
        # fwd: all-gather before col, reduce-scatter after row; bwd: the reverse pair, and
        # col's input all-gathered again for its weight gradient (it saved only its shard)
        want = [("all-gather", full)] * 3 + [("reduce-scatter", full)] * 2
    else:
        # fwd: all-reduce after row; bwd: all-reduce of col's input gradient
        want = [("all-reduce", full)] * 2
    assert _summary(colls) == sorted((k, s, _expected_groups()) for k, s in want)
    assert all(c.dtype == "f32" for c in colls)
    # plain TP: 4 x (p-1)/p x b*s*h*4 bytes per rank; SP 5 x (the backward re-gather)
    steps = 5 if sp else 4
    assert sum(c.ring_bytes for c in colls) == steps * (TP - 1) / TP * B * S * H * 4


def test_tp1_block_runs_on_xla_cpu_device():
    code = """
import torch, neuron_tp as ntp
from neuron_tp.backend.hlo import trace_hlo, parse_collectives
dev = ntp.xla_device()  # before any backward: autograd sizes its device queues once
mesh = ntp.init_mesh(tp=1)
torch.manual_seed(0)
block = ntp.blocks.TransformerBlock(32, 4, 64)
x = torch.randn(2, 8, 32)
ref = block(x); ref.square().sum().backward()
ref_grads = [p.grad.clone() for p in block.parameters()]
block.zero_grad(); block.to(dev)
xd = x.to(dev)
y = block(xd); y.square().sum().backward()
assert not parse_collectives(trace_hlo([y] + [p.grad for p in block.parameters()]))
torch.testing.assert_close(y.cpu(), ref, atol=1e-4, rtol=1e-4)
for p, g in zip(block.parameters(), ref_grads):
    torch.testing.assert_close(p.grad.cpu(), g, atol=1e-4, rtol=1e-4)
print("ok", y.device)
"""
    out = xla_zygote.python(["-c", code], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok xla" in out.stdout


RANK_GRAPH = """
import torch, neuron_tp as ntp
from neuron_tp import regions
from neuron_tp.backend.hlo import trace_hlo
mesh = ntp.Mesh.virtual(world_size=8, rank={rank}, tp=4)
dev = ntp.xla_device()
torch.manual_seed(0)
emb = ntp.VocabParallelEmbedding(50, 32, mesh=mesh).to(dev)
block = ntp.blocks.TransformerBlock(32, 4, mesh=mesh, sequence_parallel=True).to(dev)
head = ntp.ColumnParallelLinear(32, 50, bias=False, pad_output=True, sequence_parallel=True,
                                mesh=mesh).to(dev)
ids = torch.randint(0, 50, (2, 8)).to(dev)
x = regions.split_fwd_all_gather_bwd(emb(ids), mesh.tp, 1)
loss = ntp.parallel_cross_entropy(head(block(x)), ids, mesh=mesh, vocab_size=50)
loss.backward()
params = (*emb.parameters(), *block.parameters(), *head.parameters())
print(trace_hlo([loss] + [p.grad for p in params]))
"""


def test_every_rank_traces_the_same_graph():
    """Rank-dependent values (vocab slice starts, sequence chunk index) enter the graph as data,
    so all ranks share one graph: one Neuron compile instead of one per rank."""
    hlo = []
    for rank in (1, 6):
        out = xla_zygote.python(["-c", RANK_GRAPH.format(rank=rank)], timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        hlo.append(out.stdout)
    assert "all-gather" in hlo[0] and "reduce-scatter" in hlo[0]
    assert hlo[0] == hlo[1]


def test_init_mesh_adopts_xla_process_group():
    """On Neuron the job runs init_process_group("xla"); init_mesh must adopt it (world 1 here)."""
    code = """
import torch, torch.distributed as dist
import torch_xla.distributed.xla_backend
import neuron_tp as ntp
dev = ntp.xla_device()
dist.init_process_group("xla", init_method="xla://")
mesh = ntp.init_mesh(tp=1)
assert ntp.get_mesh() is mesh and dist.get_backend() == "xla"
torch.manual_seed(0)
ref = torch.nn.Linear(4, 6)
col = ntp.ColumnParallelLinear.from_linear(ref).to(dev)
x = torch.randn(2, 4)
torch.testing.assert_close(col(x.to(dev)).cpu(), ref(x), atol=1e-5, rtol=1e-5)
print("ok", mesh)
"""
    out = xla_zygote.python(["-c", code], timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok Mesh(world=1" in out.stdout
