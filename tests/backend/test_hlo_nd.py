"""XLA path of 2D/3D tensor parallelism: the traced HLO (forward + backward) of one rank of a
virtual mesh holds exactly the collectives of the documented schedule, with replica groups
computed here independently from the rank layout (numpy reshapes of the world); both schedules:
``regather=True`` (backward all-gathers the saved local X and W blocks again) and ``False``.

The eight linear layouts are traced by ONE process (forked from the session's zygote): after
each trace the device's collective ordering token is reset, so the next graph starts without
the previous one's collectives (were it not, every later case would hold its predecessors'
collectives and fail its exact count)."""

import json
import os

import numpy as np
import pytest

import xla_zygote
from neuron_tp.backend.hlo import parse_collectives

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TRACE = """
import json, sys, torch, torch_xla, neuron_tp as ntp
from neuron_tp.backend.hlo import trace_hlo
from neuron_tp.layers import nd
out = {}
for key, (world, rank, tp, mode, ctor, x_shape) in json.loads(sys.argv[1]).items():
    mesh = ntp.Mesh.virtual(world_size=world, rank=rank, tp=tp, tp_mode=mode)
    dev = ntp.xla_device()
    lin = eval(ctor, {"nd": nd, "mesh": mesh}).to(dev)
    x = torch.randn(x_shape, device=dev, requires_grad=True)
    y = lin(x)
    y.square().sum().backward()
    out[key] = trace_hlo([y, x.grad, lin.weight.grad, lin.bias.grad])
    # nothing executes (a virtual mesh's graph cannot): drop the pending collectives' ordering
    # token, as a step boundary would, so the next trace is what a fresh process would trace
    torch_xla._XLAC._set_all_reduce_token(str(dev), None)
print(json.dumps(out))
"""

LINEAR2D = [(32, 16, 21), (64, 64, 45)]  # (world, tp, rank)
LINEAR3D = [(16, 8, 13), (64, 64, 45)]


def _shape2d(tp: int) -> tuple[int, int, int, int]:
    q = int(round(tp**0.5))
    return q, 3, 4 * q, 2 * q  # b, s, a, c


def _shape3d(tp: int) -> tuple[int, int, int, int]:
    q = int(round(tp ** (1 / 3)))
    return q * q, 2, 2 * q * q, 3 * q


def _cases() -> dict[str, tuple]:
    """Every linear layout this file checks: key -> (world, rank, tp, mode, ctor, x shape)."""
    cases = {}
    for regather in (True, False):
        for world, tp, rank in LINEAR2D:
            b, s, a, c = _shape2d(tp)
            q = int(round(tp**0.5))
            ctor = f"nd.Linear2D({a}, {c}, mesh=mesh, regather={regather})"
            shape = (b // q, s, a // q)
            cases[f"2d-{world}-{tp}-{rank}-{regather}"] = (world, rank, tp, "2d", ctor, shape)
        for world, tp, rank in LINEAR3D:
            b, s, a, c = _shape3d(tp)
            q = int(round(tp ** (1 / 3)))
            ctor = f"nd.Linear3D({a}, {c}, orientation='ab', mesh=mesh, regather={regather})"
            shape = (b // q // q, s, a // q)
            cases[f"3d-{world}-{tp}-{rank}-{regather}"] = (world, rank, tp, "3d", ctor, shape)
    return cases


@pytest.fixture(scope="module")
def traced() -> dict[str, str]:
    """HLO text per case key, all traced by one process forked from the zygote."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    out = xla_zygote.python(["-c", TRACE, json.dumps(_cases())], env, 300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _groups(lists):
    return tuple(sorted(tuple(int(r) for r in g) for g in lists))


def _summary(colls):
    """(kind, shape, groups) of each op; torch-xla may list the groups in its own order."""
    return sorted((c.kind, c.shape, _groups(c.replica_groups)) for c in colls)


@pytest.mark.parametrize("regather", [True, False])
@pytest.mark.parametrize("world,tp,rank", LINEAR2D)
def test_linear2d_collectives(traced, world, tp, rank, regather):
    q = int(round(tp**0.5))
    b, s, a, c = _shape2d(tp)
    grid = np.arange(world).reshape(world // tp, q, q)  # (dp, r, c)
    row = _groups(grid[d, r, :] for d in range(world // tp) for r in range(q))  # vary c
    col = _groups(grid[d, :, k] for d in range(world // tp) for k in range(q))  # vary r
    colls = parse_collectives(traced[f"2d-{world}-{tp}-{rank}-{regather}"])
    want = [
        ("all-gather", (b // q, s, a), row),  # fwd: X along the row
        ("all-gather", (c // q, a), col),  # fwd: W along the column
        ("reduce-scatter", (b // q, s, a), row),  # bwd: dX
        ("reduce-scatter", (c // q, a), col),  # bwd: dW
        ("all-reduce", (c // q,), col),
    ]  # bwd: bias grad over batch shards
    if regather:  # bwd: the saved local blocks gathered again, as in forward
        want += [("all-gather", (b // q, s, a), row), ("all-gather", (c // q, a), col)]
    assert _summary(colls) == sorted(want)
    assert all(cl.dtype == "f32" for cl in colls)
    ring = sum(cl.ring_bytes for cl in colls if cl.kind != "all-reduce")
    factor = 3 if regather else 2  # (q-1)/q * (N a + a c)/q per pass over X and W
    assert ring == pytest.approx(factor * (q - 1) / q * (b * s * a + a * c) / q * 4)


@pytest.mark.parametrize("regather", [True, False])
@pytest.mark.parametrize("world,tp,rank", LINEAR3D)
def test_linear3d_collectives(traced, world, tp, rank, regather):
    q = int(round(tp ** (1 / 3)))
    b, s, a, c = _shape3d(tp)
    cube = np.arange(world).reshape(world // tp, q, q, q)  # (dp, i, j, l)
    dp, r = range(world // tp), range(q)
    inp = _groups(cube[d, :, j, l] for d in dp for j in r for l in r)
    wgt = _groups(cube[d, i, :, l] for d in dp for i in r for l in r)
    out = _groups(cube[d, i, j, :] for d in dp for i in r for j in r)
    in_out = _groups(cube[d, :, j, :].reshape(-1) for d in dp for j in r)
    colls = parse_collectives(traced[f"3d-{world}-{tp}-{rank}-{regather}"])
    want = [
        ("all-gather", (b // q, s, a // q), wgt),  # fwd: X over weight (batch)
        ("all-gather", (c // q, a // q), inp),  # fwd: W over input
        ("reduce-scatter", (b // q, s, c // q), out),  # fwd: Y over output (batch)
        ("all-gather", (b // q, s, c // q), out),  # bwd: dY
        ("reduce-scatter", (b // q, s, a // q), wgt),  # bwd: dX
        ("reduce-scatter", (c // q, a // q), inp),  # bwd: dW
        ("all-reduce", (c // q,), in_out),
    ]  # bwd: bias grad over batch shards
    if regather:  # bwd: the saved local blocks of X and W gathered again, as in forward
        want += [("all-gather", (b // q, s, a // q), wgt), ("all-gather", (c // q, a // q), inp)]
    assert _summary(colls) == sorted(want)
    ring = sum(cl.ring_bytes for cl in colls if cl.kind != "all-reduce")
    n_a, a_c, n_c = b * s * a, a * c, b * s * c
    units = 3 * n_a + 3 * a_c + 2 * n_c if regather else 2 * (n_a + a_c + n_c)
    assert ring == pytest.approx((q - 1) / q**3 * units * 4)


MODEL = """
import torch, neuron_tp as ntp
from neuron_tp.backend.hlo import trace_hlo
from neuron_tp.layers import nd
from neuron_tp.blocks.block_nd import TransformerBlockND
mesh = ntp.Mesh.virtual(world_size=8, rank={rank}, tp=8, tp_mode="3d")
dev = ntp.xla_device()
emb = nd.Embedding3D(16, 8, mesh=mesh).to(dev)
block = TransformerBlockND(8, 2, 8, mesh=mesh).to(dev)
head = nd.Classifier3D(8, 16, mesh=mesh).to(dev)
ids = torch.zeros(1, 3, dtype=torch.long, device=dev)
loss = nd.cross_entropy_3d(head(block(emb(ids))), ids, mesh)
loss.backward()
print(trace_hlo([loss] + [p.grad for m in (emb, block, head) for p in m.parameters()]))
"""


def test_3d_model_traces_one_graph_for_all_ranks():
    """Embedding, norms, block, classifier and loss: rank-dependent values are device data, so
    two ranks trace the same HLO (one Neuron compile), and it holds 3D collectives only."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO}
    texts = []
    for rank in (0, 6):
        out = xla_zygote.python(["-c", MODEL.format(rank=rank)], env, 300)
        assert out.returncode == 0, out.stderr[-3000:]
        texts.append(out.stdout)
    assert texts[0] == texts[1]
    sizes = {c.group_size for c in parse_collectives(texts[0])}
    assert sizes == {2, 4}  # q = 2 axes and the q^2 batch groups; never the whole tp group
