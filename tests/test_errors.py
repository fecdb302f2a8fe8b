"""Bad input fails fast, with a message saying what is wrong and what would be valid,
before any collective starts (these run without any process group: a hang would be a bug)."""

import pytest
import torch

import neuron_tp as ntp
from neuron_tp.parallel.mesh import Mesh, set_default_mesh


@pytest.fixture(autouse=True)
def _no_default_mesh():
    set_default_mesh(None)
    yield
    set_default_mesh(None)


def test_tp_must_divide_world():
    with pytest.raises(ValueError, match=r"tp=3 does not divide the world size 8.*\[1, 2, 4, 8\]"):
        Mesh(8, 0, tp=3)


def test_2d_3d_need_square_cube():
    with pytest.raises(ValueError, match=r"q\*q.*valid: \[1, 4\]"):
        Mesh(8, 0, tp=8, tp_mode="2d")
    with pytest.raises(ValueError, match=r"q\*q\*q.*valid: \[1, 8\]"):
        Mesh(16, 0, tp=4, tp_mode="3d")
    with pytest.raises(ValueError, match="tp_mode must be one of"):
        Mesh(4, 0, tp=2, tp_mode="4d")


def test_init_mesh_validates_before_rendezvous(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(ValueError, match=r"valid tp degrees: \[1, 2, 3, 6\]"):
        ntp.init_mesh(tp=4)


def test_mesh_not_initialised():
    with pytest.raises(RuntimeError, match="init_mesh"):
        ntp.ColumnParallelLinear(4, 4)


def test_layer_dims_not_divisible():
    mesh = Mesh.virtual(8, 0, tp=4)
    with pytest.raises(ValueError, match=r"out_features=6 is not divisible by tp size 4.*\[1, 2\]"):
        ntp.ColumnParallelLinear(4, 6, mesh=mesh)
    with pytest.raises(ValueError, match=r"in_features=10 .*\[1, 2\]"):
        ntp.RowParallelLinear(10, 4, mesh=mesh)
    with pytest.raises(ValueError, match=r"num_heads=6 is not divisible by tp=4.*\[1, 2\]"):
        ntp.blocks.ParallelSelfAttention(24, 6, mesh=mesh)


def test_virtual_mesh_needs_xla_tensors():
    mesh = Mesh.virtual(8, 3, tp=4)
    col = ntp.ColumnParallelLinear(4, 8, mesh=mesh)
    with pytest.raises(RuntimeError, match="virtual .*XLA tensors"):
        col(torch.randn(2, 4))


def test_sequence_length_not_divisible_under_sp():
    mesh = Mesh(4, 0, tp=4)  # no process group: reaching a collective would fail differently
    row = ntp.RowParallelLinear(8, 4, mesh=mesh, sequence_parallel=True)
    with pytest.raises(ValueError, match="sequence length 6 .*multiple of 4"):
        row(torch.randn(2, 6, 2))


def test_shape_and_dtype_mismatch():
    mesh = Mesh(2, 0, tp=2)
    col = ntp.ColumnParallelLinear(4, 8, mesh=mesh)
    with pytest.raises(ValueError, match="expected 4 features"):
        col(torch.randn(2, 5))
    with pytest.raises(TypeError, match="dtype torch.float64 does not match"):
        col(torch.randn(2, 4, dtype=torch.float64))
    emb = ntp.VocabParallelEmbedding(10, 4, mesh=mesh)
    with pytest.raises(TypeError, match="ids must be int64"):
        emb(torch.randn(2, 3))


def test_cross_entropy_bad_shapes():
    mesh = Mesh.virtual(2, 0, tp=2)
    with pytest.raises(ValueError, match="must agree"):
        ntp.parallel_cross_entropy(torch.randn(3, 5), torch.zeros(4, dtype=torch.long), mesh)
    with pytest.raises(ValueError, match="does not fit 2 shards of 5"):
        ntp.parallel_cross_entropy(
            torch.randn(3, 5), torch.zeros(3, dtype=torch.long), mesh, vocab_size=20
        )


def test_import_needs_only_torch():
    import subprocess
    import sys

    code = (
        "import sys; import neuron_tp; "
        "bad = [m for m in ('torch_xla', 'transformers', 'torch_neuronx', "
        "'neuronx_distributed') if m in sys.modules]; assert not bad, bad"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
