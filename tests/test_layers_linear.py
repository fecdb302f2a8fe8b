"""Column/row-parallel linears against nn.Linear: outputs, input grads, parameter grads."""
import itertools

import torch
from torch import nn

import dist
import neuron_tp as ntp
from neuron_tp import regions
from reference import assert_close, full_param_and_grad

B, S = 2, 4  # batch, sequence (S divisible by tp 2 and 4 for sequence parallelism)


def _check_column(mesh, in_f, out_f, bias, sp, gather, seed):
    torch.manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias)
    layer = ntp.ColumnParallelLinear.from_linear(ref, sequence_parallel=sp, gather_output=gather)
    x_full = torch.randn(B, S, in_f, requires_grad=True)
    y_ref = ref(x_full)
    gy = torch.randn_like(y_ref)
    (y_ref * gy).sum().backward()
    tp = mesh.tp
    x = x_full.detach()
    x = regions.scatter_to_sequence_parallel(x, tp, 1) if sp else x
    x = x.clone().requires_grad_(True)
    y = layer(x)
    expect_y = y_ref if gather else y_ref.chunk(tp.size, -1)[tp.rank]
    assert_close(y, expect_y.detach(), f"column out sp={sp} gather={gather}")
    y.backward(gy if gather else gy.chunk(tp.size, -1)[tp.rank])
    gx = x_full.grad.chunk(tp.size, 1)[tp.rank] if sp else x_full.grad
    assert_close(x.grad, gx, "column dX")
    for name, p in layer.named_parameters():
        full, g = full_param_and_grad(layer, name, mesh)
        assert_close(full, getattr(ref, name).detach(), f"column {name}")
        assert_close(g, getattr(ref, name).grad, f"column d{name}")


def _check_row(mesh, in_f, out_f, bias, sp, parallel_in, seed):
    torch.manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias)
    layer = ntp.RowParallelLinear.from_linear(ref, sequence_parallel=sp,
                                              input_is_parallel=parallel_in)
    x_full = torch.randn(B, S, in_f, requires_grad=True)
    y_ref = ref(x_full)
    gy = torch.randn_like(y_ref)
    (y_ref * gy).sum().backward()
    tp = mesh.tp
    x = x_full.detach().chunk(tp.size, -1)[tp.rank] if parallel_in else x_full.detach()
    x = x.clone().requires_grad_(True)
    y = layer(x)
    expect_y, g_out = (y_ref.chunk(tp.size, 1)[tp.rank], gy.chunk(tp.size, 1)[tp.rank]) if sp \
        else (y_ref, gy)
    assert_close(y, expect_y.detach(), f"row out sp={sp}")
    y.backward(g_out)
    gx = x_full.grad.chunk(tp.size, -1)[tp.rank] if parallel_in else x_full.grad
    assert_close(x.grad, gx, "row dX")
    if sp:
        ntp.sync_sequence_parallel_grads(layer, mesh)
    for name, p in layer.named_parameters():
        full, g = full_param_and_grad(layer, name, mesh)
        assert_close(full, getattr(ref, name).detach(), f"row {name}")
        assert_close(g, getattr(ref, name).grad, f"row d{name} sp={sp}")


def _linears(tp):
    mesh = ntp.init_mesh(tp=tp)
    out_col = 3 * tp  # odd sizes: 6 or 12 outputs, 7 inputs
    for bias, sp, gather in itertools.product([True, False], repeat=3):
        _check_column(mesh, 7, out_col, bias, sp, gather, seed=11)
    for bias, sp, parallel_in in itertools.product([True, False], repeat=3):
        if sp and not parallel_in:
            continue
        _check_row(mesh, 5 * tp, 7, bias, sp, parallel_in, seed=12)
    # skip_bias_add returns the bias for the caller to fuse.
    torch.manual_seed(0)
    ref = nn.Linear(7, 2 * tp)
    skip = ntp.ColumnParallelLinear.from_linear(ref, skip_bias_add=True, gather_output=True)
    y, b = skip(torch.ones(1, 7))
    assert_close(y + ntp.gather_full(b, ntp.get_sharding(skip, "bias"), mesh),
                 ref(torch.ones(1, 7)).detach(), "skip_bias_add")
    # Packed (fused QKV-style) projection: each segment is split separately.
    torch.manual_seed(1)
    segs = (2 * tp, tp, tp)
    ref = nn.Linear(5, sum(segs))
    packed = ntp.ColumnParallelLinear.from_linear(ref, segments=segs)
    x = torch.randn(3, 5)
    local = packed(x).split([s // tp for s in segs], -1)
    for got, want in zip(local, ref(x).split(segs, -1)):
        assert_close(got, want.chunk(tp, -1)[mesh.tp_rank].detach(), "packed segment")
    assert_close(ntp.gather_params(packed, mesh)["weight"], ref.weight.detach(), "packed gather")


def _tp_invariant_init(tp):
    mesh = ntp.init_mesh(tp=tp)
    torch.manual_seed(123)
    ref_col, ref_row = nn.Linear(7, 4 * tp), nn.Linear(4 * tp, 7)
    torch.manual_seed(123)
    col, row = ntp.ColumnParallelLinear(7, 4 * tp), ntp.RowParallelLinear(4 * tp, 7)
    for layer, ref in ((col, ref_col), (row, ref_row)):
        for name, full in ntp.gather_params(layer, mesh).items():
            assert_close(full, getattr(ref, name).detach(), f"init {name}")


def test_linears_tp2():
    dist.run(_linears, 2, 2)


def test_linears_tp4_and_tp2_dp2():
    dist.run(_linears, 4, 4)
    dist.run(_linears, 4, 2)


def test_tp_invariant_init():
    dist.run(_tp_invariant_init, 2, 2)
    dist.run(_tp_invariant_init, 4, 4)
