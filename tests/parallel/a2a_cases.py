"""All-to-all cases shared by the gloo tier (test_all_to_all.py) and the XLA CPU devices tier
(test_all_to_all_xla.py): ``comm.all_to_all`` forward and the differentiable region's backward
against what every rank computes on the host from every rank's data (chunks and
concatenations with torch.chunk / torch.cat, no collective).

Every world rank's input and upstream gradient come from a generator seeded by (case, rank), so
every rank knows them all. Data movement is exact: results are compared bit for bit.
"""

from __future__ import annotations

import torch

from neuron_tp.parallel import comm, regions
from neuron_tp.parallel.mesh import Group

# (shape, split_dim, concat_dim); 12 splits over groups of 2, 3 and 4; 5 and 7 are odd.
LAYOUTS = [
    ((12, 5), 0, 0),
    ((5, 12, 7), 1, 0),
    ((12, 5, 7), 0, 2),
    ((7, 5, 12), -1, 1),
    ((3, 12), 1, 1),
]
DTYPES = [torch.float32, torch.bfloat16]
# On XLA CPU devices (each device thread compiles the whole graph): dim 0 only, split before
# concat, split after concat (negative index); the region's forward is comm.all_to_all.
XLA_LAYOUTS = (LAYOUTS[0], LAYOUTS[2], LAYOUTS[3])


def _data(shape, dtype, seed: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=g).to(dtype)


def expected(xs: list[torch.Tensor], me: int, split_dim: int, concat_dim: int) -> torch.Tensor:
    """What group rank ``me`` receives: chunk ``me`` of every rank's tensor, in rank order."""
    n = len(xs)
    return torch.cat([x.chunk(n, split_dim)[me] for x in xs], concat_dim)


def expected_grad(gs: list[torch.Tensor], me: int, split_dim: int, concat_dim: int) -> torch.Tensor:
    """Gradient of group rank ``me``'s input: its chunk ``j`` (sent to rank ``j``) gets the
    piece of rank ``j``'s upstream gradient that came from ``me``."""
    n = len(gs)
    return torch.cat([g.chunk(n, concat_dim)[me] for g in gs], split_dim)


def checks(
    group: Group, device: torch.device | str, layouts=tuple(LAYOUTS), plain: bool = True
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(what, result on ``device``, host expectation) for every layout of ``layouts`` and dtype
    over ``group``: the region forward and backward, and (``plain``) ``comm.all_to_all``
    itself; on XLA the results are pending until the caller syncs."""
    out = []
    for i, (shape, split_dim, concat_dim) in enumerate(LAYOUTS):
        if (shape, split_dim, concat_dim) not in layouts:
            continue
        for dtype in DTYPES:
            seed = 10 * i + DTYPES.index(dtype)
            xs = [_data(shape, dtype, seed, r) for r in group.ranks]
            y_shape = list(shape)
            y_shape[split_dim] //= group.size
            y_shape[concat_dim] *= group.size
            gs = [_data(tuple(y_shape), dtype, seed + 500, r) for r in group.ranks]
            me = group.rank
            what = (
                f"{group.name}{group.ranks} {shape} split {split_dim} concat {concat_dim} {dtype}"
            )
            if plain:
                y_plain = comm.all_to_all(xs[me].to(device), group, split_dim, concat_dim)
                out.append((f"comm fwd {what}", y_plain, expected(xs, me, split_dim, concat_dim)))
            xg = xs[me].to(device).requires_grad_(True)
            y = regions.all_to_all_fwd_all_to_all_bwd(xg, group, split_dim, concat_dim)
            y.backward(gs[me].to(device))
            out.append((f"region fwd {what}", y, expected(xs, me, split_dim, concat_dim)))
            out.append(
                (f"region bwd {what}", xg.grad, expected_grad(gs, me, split_dim, concat_dim))
            )
    return out


def compare(pending: list[tuple[str, torch.Tensor, torch.Tensor]]) -> int:
    """Bit-exact comparison of every pending check (results moved to the host)."""
    for what, got, want in pending:
        got = got.detach().cpu()
        assert got.dtype == want.dtype and got.shape == want.shape, (
            f"{what}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
        )
        assert torch.equal(got, want), f"{what}: values differ"
    return len(pending)


def xla_job() -> dict:
    """On each XLA CPU device thread (xla_dist.run): every case over the tp pairs ([0, 1],
    [2, 3]), the strided dp pairs ([0, 2], [1, 3]) and the world of 4, one graph, one sync;
    returns the number of checks and the collectives of one traced all-to-all."""
    import torch_xla

    import neuron_tp as ntp
    from neuron_tp.backend.hlo import parse_collectives, trace_hlo

    mesh = ntp.init_mesh(tp=2)
    dev = torch_xla.device()
    probe = comm.all_to_all(torch.ones(4, 3, device=dev), mesh.group("world"), 0, 1)
    form = parse_collectives(trace_hlo([probe]))
    pending = []
    for name in ("tp", "dp", "world"):
        pending += checks(mesh.group(name), dev, XLA_LAYOUTS, plain=False)
    torch_xla.sync()
    return {"rank": mesh.rank, "checks": compare(pending), "form": form}
