"""Column/row-parallel linears against nn.Linear: outputs, input grads, parameter grads."""

import itertools

import pytest
import torch
from torch import nn

import gloo_dist
import neuron_tp as ntp
from neuron_tp.parallel import regions
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
    x = regions.split_fwd_all_gather_bwd(x, tp, 1) if sp else x
    x = x.clone().requires_grad_(True)
    y = layer(x)
    expect_y = y_ref if gather else y_ref.chunk(tp.size, -1)[tp.rank]
    assert_close(y, expect_y.detach(), f"column out sp={sp} gather={gather}")
    y.backward(gy if gather else gy.chunk(tp.size, -1)[tp.rank])
    gx = x_full.grad.chunk(tp.size, 1)[tp.rank] if sp else x_full.grad
    assert_close(x.grad, gx, "column dX")
    for name, _ in layer.named_parameters():
        full, g = full_param_and_grad(layer, name, mesh)
        assert_close(full, getattr(ref, name).detach(), f"column {name}")
        assert_close(g, getattr(ref, name).grad, f"column d{name}")


def _check_row(mesh, in_f, out_f, bias, sp, parallel_in, seed):
    torch.manual_seed(seed)
    ref = nn.Linear(in_f, out_f, bias=bias)
    layer = ntp.RowParallelLinear.from_linear(
        ref, sequence_parallel=sp, input_is_parallel=parallel_in
    )
    x_full = torch.randn(B, S, in_f, requires_grad=True)
    y_ref = ref(x_full)
    gy = torch.randn_like(y_ref)
    (y_ref * gy).sum().backward()
    tp = mesh.tp
    x = x_full.detach().chunk(tp.size, -1)[tp.rank] if parallel_in else x_full.detach()
    x = x.clone().requires_grad_(True)
    y = layer(x)
    expect_y, g_out = (
        (y_ref.chunk(tp.size, 1)[tp.rank], gy.chunk(tp.size, 1)[tp.rank]) if sp else (y_ref, gy)
    )
    assert_close(y, expect_y.detach(), f"row out sp={sp}")
    y.backward(g_out)
    gx = x_full.grad.chunk(tp.size, -1)[tp.rank] if parallel_in else x_full.grad
    assert_close(x.grad, gx, "row dX")
    if sp:
        ntp.sync_sequence_parallel_grads(layer, mesh)
    for name, _ in layer.named_parameters():
        full, g = full_param_and_grad(layer, name, mesh)
        assert_close(full, getattr(ref, name).detach(), f"row {name}")
        assert_close(g, getattr(ref, name).grad, f"row d{name} sp={sp}")


def _skip_bias_add(mesh):
    """skip_bias_add returns the bias for the caller to fuse."""
    tp = mesh.tp_size
    torch.manual_seed(0)
    ref = nn.Linear(7, 2 * tp)
    skip = ntp.ColumnParallelLinear.from_linear(ref, skip_bias_add=True, gather_output=True)
    y, b = skip(torch.ones(1, 7))
    assert_close(
        y + ntp.gather_full(b, ntp.get_sharding(skip, "bias"), mesh),
        ref(torch.ones(1, 7)).detach(),
        "skip_bias_add",
    )


def _packed_segments(mesh):
    """Packed (fused QKV-style) projection: each segment is split separately."""
    tp = mesh.tp_size
    torch.manual_seed(1)
    segs = (2 * tp, tp, tp)
    ref = nn.Linear(5, sum(segs))
    packed = ntp.ColumnParallelLinear.from_linear(ref, segments=segs)
    x = torch.randn(3, 5)
    local = packed(x).split([s // tp for s in segs], -1)
    for got, want in zip(local, ref(x).split(segs, -1)):
        assert_close(got, want.chunk(tp, -1)[mesh.tp_rank].detach(), "packed segment")
    assert_close(ntp.gather_params(packed, mesh)["weight"], ref.weight.detach(), "packed gather")


def _case_name(kind: str, **flags: bool) -> str:
    return "-".join([kind, *(name for name, on in flags.items() if on)])


# case name -> check(mesh); odd sizes: 7 inputs, 3*tp column outputs, 5*tp row inputs
LINEAR_CASES = {
    **{
        _case_name(
            "column", bias=bias, sp=sp, gather=gather
        ): lambda mesh, b=bias, s=sp, g=gather: _check_column(
            mesh, 7, 3 * mesh.tp_size, b, s, g, 11
        )
        for bias, sp, gather in itertools.product([True, False], repeat=3)
    },
    **{
        _case_name(
            "row", bias=bias, sp=sp, parallel_in=parallel_in
        ): lambda mesh, b=bias, s=sp, p=parallel_in: _check_row(
            mesh, 5 * mesh.tp_size, 7, b, s, p, 12
        )
        for bias, sp, parallel_in in itertools.product([True, False], repeat=3)
        if parallel_in or not sp
    },
    "skip_bias_add": _skip_bias_add,
    "packed_segments": _packed_segments,
}
WORLDS = {"tp2": (2, 2), "tp4": (4, 4), "tp2xdp2": (2, 4)}  # name: (tp, world size)


def _linear_case(case: str, tp: int) -> None:
    LINEAR_CASES[case](gloo_dist.shared_mesh(tp))


def _tp_invariant_init(tp):
    mesh = ntp.init_mesh(tp=tp)
    torch.manual_seed(123)
    ref_col, ref_row = nn.Linear(7, 4 * tp), nn.Linear(4 * tp, 7)
    torch.manual_seed(123)
    col, row = ntp.ColumnParallelLinear(7, 4 * tp), ntp.RowParallelLinear(4 * tp, 7)
    for layer, ref in ((col, ref_col), (row, ref_row)):
        for name, full in ntp.gather_params(layer, mesh).items():
            assert_close(full, getattr(ref, name).detach(), f"init {name}")


@pytest.mark.parametrize(
    "world, case",
    [(w, c) for w in WORLDS for c in LINEAR_CASES],
    ids=[f"{w}-{c}" for w in WORLDS for c in LINEAR_CASES],
)
def test_linear(world, case):
    """Every case of one world in one launch (see gloo_dist.run_case), one test ID each."""
    tp, world_size = WORLDS[world]
    gloo_dist.run_case(_linear_case, case, tp, cases=list(LINEAR_CASES), world_size=world_size)


@pytest.mark.parametrize("tp", [2, 4], ids=lambda tp: f"tp{tp}")
def test_tp_invariant_init(tp):
    gloo_dist.run(_tp_invariant_init, tp, world_size=tp)
