"""MLP and attention+MLP transformer blocks built from the layers, against a plain torch
reference, with SP and with TP x DP; data-parallel gradient averaging and global grad norm."""

import pytest
import torch
import torch.nn.functional as F

import gloo_dist
import neuron_tp as ntp
from block_reference import FFN, HEADS, HID, B, S, ref_block
from neuron_tp.parallel import regions
from reference import assert_close

P_DROP = 0.25


def _dropout(x):
    """Dropout by definition, drawing the mask for the whole (global-batch) tensor."""
    return x * (torch.rand(x.shape) >= P_DROP) / (1 - P_DROP)


def _block(tp, sp, dropout=False):
    mesh = ntp.init_mesh(tp=tp)
    assert not (dropout and mesh.dp_size > 1), "the reference draws one mask for one batch"
    torch.manual_seed(0)
    block = ntp.blocks.TransformerBlock(
        HID, HEADS, FFN, sequence_parallel=sp, dropout=P_DROP if dropout else 0.0
    )
    with torch.no_grad():  # non-trivial norm parameters
        for ln in (block.ln1, block.ln2):
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.uniform_(-0.5, 0.5)
    full = {n: t.clone().requires_grad_(True) for n, t in ntp.gather_params(block, mesh).items()}
    # every dp replica sees its own batch; the reference sees the concatenation
    torch.manual_seed(1)
    x_all = torch.randn(mesh.dp_size * B, S, HID, requires_grad=True)
    torch.manual_seed(99)  # dropout: both sides draw from the same RNG state
    y_ref = ref_block(full, x_all, _dropout if dropout else (lambda t: t))
    g_all = torch.randn_like(y_ref)
    ((y_ref * g_all).sum() / mesh.dp_size).backward()

    rows = slice(mesh.dp_rank * B, (mesh.dp_rank + 1) * B)
    x = x_all.detach()[rows]
    g = g_all[rows]
    if sp:
        x = regions.split_fwd_all_gather_bwd(x, mesh.tp, 1)
        g = g.chunk(tp, 1)[mesh.tp_rank]
    x = x.clone().requires_grad_(True)
    torch.manual_seed(99)
    y = block(x)
    expect = y_ref[rows].chunk(tp, 1)[mesh.tp_rank] if sp else y_ref[rows]
    assert_close(y, expect.detach(), f"block out tp={tp} sp={sp}", atol=2e-5)
    y.backward(g)
    gx = x_all.grad[rows]
    gx = gx.chunk(tp, 1)[mesh.tp_rank] if sp else gx
    assert_close(x.grad, gx * mesh.dp_size, "block dX", atol=2e-5)  # local loss is not /dp
    ntp.sync_sequence_parallel_grads(block, mesh)
    ntp.allreduce_data_parallel_grads(block, mesh, bucket_mb=0.001)  # several buckets
    for n, got in ntp.gather_params(block, mesh, grads=True).items():
        assert_close(got, full[n].grad, f"block d{n} tp={tp} sp={sp}", atol=2e-5)
    # the global grad norm counts every element once, replicated or sharded
    ref_norm = torch.sqrt(sum(t.grad.pow(2).sum() for t in full.values()))
    assert_close(ntp.global_grad_norm(block, mesh), ref_norm, "global grad norm")
    norm = ntp.clip_grad_norm_(block, max_norm=0.5 * ref_norm.item(), mesh=mesh)
    assert_close(norm, ref_norm, "norm before clipping")
    assert_close(
        ntp.global_grad_norm(block, mesh),
        0.5 * ref_norm,
        "norm after clipping",
        atol=1e-4,
        rtol=1e-4,
    )


def _mlp_two_layers(tp):
    """A 2-layer MLP: column -> gelu -> row, repeated, no reference to neuron_tp blocks."""
    mesh = ntp.init_mesh(tp=tp)
    torch.manual_seed(2)
    refs = [
        torch.nn.Linear(HID, FFN),
        torch.nn.Linear(FFN, HID),
        torch.nn.Linear(HID, FFN),
        torch.nn.Linear(FFN, HID),
    ]
    layers = [
        ntp.ColumnParallelLinear.from_linear(refs[0]),
        ntp.RowParallelLinear.from_linear(refs[1]),
        ntp.ColumnParallelLinear.from_linear(refs[2]),
        ntp.RowParallelLinear.from_linear(refs[3]),
    ]
    x = torch.randn(B, S, HID)
    xr = x.clone().requires_grad_(True)
    xs = x.clone().requires_grad_(True)
    yr = refs[3](F.gelu(refs[2](refs[1](F.gelu(refs[0](xr))))))
    ys = layers[3](F.gelu(layers[2](layers[1](F.gelu(layers[0](xs))))))
    assert_close(ys, yr.detach(), "mlp out")
    yr.square().sum().backward()
    ys.square().sum().backward()
    assert_close(xs.grad, xr.grad, "mlp dX")
    for ref, layer in zip(refs, layers):
        for n, got in ntp.gather_params(layer, mesh, grads=True).items():
            assert_close(got, getattr(ref, n).grad, f"mlp d{n}")


BLOCK_CASES = {  # world size -> case name -> check
    2: {
        "tp2": lambda: _block(2, sp=False),
        "tp2-sp": lambda: _block(2, sp=True),
        "tp2-sp-dropout": lambda: _block(2, sp=True, dropout=True),
        "tp2-dropout": lambda: _block(2, sp=False, dropout=True),
        "mlp_two_layers-tp2": lambda: _mlp_two_layers(2),
    },
    4: {
        "tp4-sp": lambda: _block(4, sp=True),
        "tp4-sp-dropout": lambda: _block(4, sp=True, dropout=True),
        "tp2xdp2-sp": lambda: _block(2, sp=True),
        "tp2xdp2": lambda: _block(2, sp=False),
        "dp4": lambda: _block(1, sp=False),
    },  # no tensor parallelism
}


def _block_case(case: str, world: int) -> None:
    BLOCK_CASES[world][case]()


@pytest.mark.parametrize(
    "world, case",
    [(w, c) for w in BLOCK_CASES for c in BLOCK_CASES[w]],
    ids=[c for w in BLOCK_CASES for c in BLOCK_CASES[w]],
)
def test_block(world, case):
    """Every case of one world size in one launch (see gloo_dist.run_case), one ID each."""
    gloo_dist.run_case(_block_case, case, world, cases=list(BLOCK_CASES[world]), world_size=world)
