"""XLA path of 2D/3D tensor parallelism: the traced HLO (forward + backward) of one rank of a
virtual mesh holds exactly the collectives of the documented schedule, with replica groups
computed here independently from the rank layout (numpy reshapes of the world)."""
import numpy as np
import pytest

from neuron_tp.hlo import collectives_in_fresh_process

TRACE = """
import torch, neuron_tp as ntp
from neuron_tp.hlo import trace_hlo
from neuron_tp.layers import nd
mesh = ntp.Mesh.virtual(world_size={world}, rank={rank}, tp={tp}, tp_mode="{mode}")
dev = ntp.xla_device()
lin = {ctor}.to(dev)
x = torch.randn({x_shape}, device=dev, requires_grad=True)
y = lin(x)
y.square().sum().backward()
print(trace_hlo([y, x.grad, lin.weight.grad, lin.bias.grad]))
"""


def _groups(lists):
    return tuple(sorted(tuple(int(r) for r in g) for g in lists))


def _summary(colls):
    """(kind, shape, groups) of each op; torch-xla may list the groups in its own order."""
    return sorted((c.kind, c.shape, _groups(c.replica_groups)) for c in colls)


@pytest.mark.parametrize("world,tp,rank", [(32, 16, 21), (64, 64, 45)])
def test_linear2d_collectives(world, tp, rank):
    q = int(round(tp ** 0.5))
    b, s, a, c = q, 3, 4 * q, 2 * q
    grid = np.arange(world).reshape(world // tp, q, q)  # (dp, r, c)
    row = _groups(grid[d, r, :] for d in range(world // tp) for r in range(q))  # vary c
    col = _groups(grid[d, :, k] for d in range(world // tp) for k in range(q))  # vary r
    colls = collectives_in_fresh_process(TRACE.format(
        world=world, rank=rank, tp=tp, mode="2d", ctor=f"nd.Linear2D({a}, {c}, mesh=mesh)",
        x_shape=(b // q, s, a // q)))
    want = [("all-gather", (b // q, s, a), row),       # fwd: X along the row
            ("all-gather", (c // q, a), col),          # fwd: W along the column
            ("reduce-scatter", (b // q, s, a), row),   # bwd: dX
            ("reduce-scatter", (c // q, a), col),      # bwd: dW
            ("all-reduce", (c // q,), col)]            # bwd: bias grad over batch shards
    assert _summary(colls) == sorted(want)
    assert all(cl.dtype == "f32" for cl in colls)
    ring = sum(cl.ring_bytes for cl in colls if cl.kind != "all-reduce")
    assert ring == pytest.approx(2 * (q - 1) / q * (b * s * a + a * c) / q * 4)


@pytest.mark.parametrize("world,tp,rank", [(16, 8, 13), (64, 64, 45)])
def test_linear3d_collectives(world, tp, rank):
    q = int(round(tp ** (1 / 3)))
    b, s, a, c = q * q, 2, 2 * q * q, 3 * q
    cube = np.arange(world).reshape(world // tp, q, q, q)  # (dp, i, j, l)
    dp, r = range(world // tp), range(q)
    inp = _groups(cube[d, :, j, l] for d in dp for j in r for l in r)
    wgt = _groups(cube[d, i, :, l] for d in dp for i in r for l in r)
    out = _groups(cube[d, i, j, :] for d in dp for i in r for j in r)
    in_out = _groups(cube[d, :, j, :].reshape(-1) for d in dp for j in r)
    colls = collectives_in_fresh_process(TRACE.format(
        world=world, rank=rank, tp=tp, mode="3d",
        ctor=f"nd.Linear3D({a}, {c}, orientation='ab', mesh=mesh)",
        x_shape=(b // q // q, s, a // q)))
    want = [("all-gather", (b // q, s, a // q), wgt),      # fwd: X over weight (batch)
            ("all-gather", (c // q, a // q), inp),          # fwd: W over input
            ("reduce-scatter", (b // q, s, c // q), out),   # fwd: Y over output (batch)
            ("all-gather", (b // q, s, c // q), out),       # bwd: dY
            ("reduce-scatter", (b // q, s, a // q), wgt),   # bwd: dX
            ("reduce-scatter", (c // q, a // q), inp),      # bwd: dW
            ("all-reduce", (c // q,), in_out)]              # bwd: bias grad over batch shards
    assert _summary(colls) == sorted(want)
    ring = sum(cl.ring_bytes for cl in colls if cl.kind != "all-reduce")
    assert ring == pytest.approx(2 * (q - 1) / q ** 3 * (b * s * a + a * c + b * s * c) * 4)
