"""Each region function against its definition, forward and backward, on 2 and 4 gloo ranks."""

import pytest
import torch

import gloo_dist
import neuron_tp as ntp
from neuron_tp.parallel import regions
from reference import assert_close


def _per_rank(world, shape, seed):
    """Every rank's input, known to every rank (independent reference data)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(world)]


def _regions(tp):
    mesh = ntp.init_mesh(tp=tp)
    grp, r = mesh.tp, mesh.tp_rank
    base = mesh.dp_rank * tp
    xs = _per_rank(mesh.world_size, (2, 4, 6), seed=7)[base : base + tp]
    gs = _per_rank(mesh.world_size, (2, 4, 6), seed=8)[base : base + tp]
    cat_g = torch.cat(gs, 1)

    def run(fn, x, g_out):
        x = x.clone().requires_grad_(True)
        y = fn(x)
        y.backward(g_out)
        return y.detach(), x.grad

    y, gx = run(lambda t: regions.identity_fwd_all_reduce_bwd(t, grp), xs[r], gs[r])
    assert_close(y, xs[r], "copy fwd")
    assert_close(gx, sum(gs), "copy bwd = all-reduce")
    y, gx = run(lambda t: regions.all_reduce_fwd_identity_bwd(t, grp), xs[r], gs[r])
    assert_close(y, sum(xs), "reduce fwd = all-reduce")
    assert_close(gx, gs[r], "reduce bwd")
    full = torch.cat(xs, 1)  # replicated [2, 4*tp, 6]
    y, gx = run(lambda t: regions.split_fwd_all_gather_bwd(t, grp, 1), full, gs[r])
    assert_close(y, xs[r], "scatter fwd")
    assert_close(gx, cat_g, "scatter bwd = all-gather")
    y, gx = run(lambda t: regions.all_gather_fwd_split_bwd(t, grp, 1), xs[r], cat_g)
    assert_close(y, full, "gather fwd")
    assert_close(gx, gs[r], "gather bwd = split")
    g_full = _per_rank(mesh.world_size, (2, 4 * tp, 6), seed=9)[base : base + tp]
    y, gx = run(lambda t: regions.all_gather_fwd_reduce_scatter_bwd(t, grp, 1), xs[r], g_full[r])
    assert_close(y, full, "sp gather fwd")
    assert_close(gx, sum(g_full).chunk(tp, 1)[r], "sp gather bwd = reduce-scatter")
    x_full = _per_rank(mesh.world_size, (2, 4 * tp, 6), seed=10)[base : base + tp]
    y, gx = run(lambda t: regions.reduce_scatter_fwd_all_gather_bwd(t, grp, 1), x_full[r], gs[r])
    assert_close(y, sum(x_full).chunk(tp, 1)[r], "reduce-scatter fwd")
    assert_close(gx, cat_g, "reduce-scatter bwd = all-gather")
    # the hidden (last) dim as well as the sequence dim
    y, gx = run(lambda t: regions.split_fwd_all_gather_bwd(t, grp, -1), torch.cat(xs, -1), gs[r])
    assert_close(y, xs[r], "scatter last-dim fwd")
    assert_close(gx, torch.cat(gs, -1), "scatter last-dim bwd")


@pytest.mark.parametrize("tp, world_size", [(2, 2), (4, 4), (2, 4)], ids=["tp2", "tp4", "tp2xdp2"])
def test_regions(tp, world_size):
    gloo_dist.run(_regions, tp, world_size=world_size)
