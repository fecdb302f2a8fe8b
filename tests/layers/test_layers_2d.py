"""2D (q x q) tensor parallelism on gloo: every layer, the loss and the block against the
unsharded computation (outputs, input grads, parameter grads), at 4 ranks and dp=2 x 4; the
linears and the block with and without the backward re-gather (``regather``)."""

import gloo_dist
import neuron_tp as ntp
from nd_reference import check_block, check_linears, check_model_loss, check_padded_vocab


def _tp4():
    mesh = ntp.init_mesh(tp=4, tp_mode="2d")
    check_linears(mesh, batch=2)
    for regather in (True, False):
        check_block(mesh, batch=2, regather=regather)
    check_model_loss(mesh, batch=2)
    for vocab in (13, 5):  # q=2 does not divide them: padded embedding / classifier / loss
        check_padded_vocab(mesh, batch=2, vocab=vocab)


def _dp2_tp4():
    mesh = ntp.init_mesh(tp=4, tp_mode="2d")
    assert mesh.dp_size == 2
    check_linears(mesh, batch=2)
    for regather in (True, False):
        check_block(mesh, batch=2, regather=regather)


def test_2d_q2_layers_block_loss():
    gloo_dist.run(_tp4, world_size=4)


def test_2d_q2_times_dp2():
    gloo_dist.run(_dp2_tp4, world_size=8)


# --- bad input: clear errors before any collective (meshes without process groups, so a
# collective reached by mistake would raise a different error) ---
import pytest  # noqa: E402
import torch  # noqa: E402

from neuron_tp.blocks.block_nd import TransformerBlockND  # noqa: E402
from neuron_tp.layers import nd  # noqa: E402
from neuron_tp.layers.activation_layout import tag  # noqa: E402


def test_bad_input_2d_3d():
    m2 = ntp.Mesh(8, 1, tp=4, tp_mode="2d")
    m3 = ntp.Mesh(8, 3, tp=8, tp_mode="3d")
    with pytest.raises(ValueError, match="in_features=7 is not divisible by 2"):
        nd.Linear2D(7, 4, mesh=m2)
    with pytest.raises(ValueError, match="in_features=6 is not divisible by 4"):
        nd.Linear3D(6, 4, mesh=m3)
    with pytest.raises(ValueError, match="orientation must be"):
        nd.Linear3D(8, 4, orientation="ac", mesh=m3)
    with pytest.raises(ValueError, match="tp_mode='2d'"):
        nd.Linear2D(8, 4, mesh=m3)
    with pytest.raises(ValueError, match="num_heads=3 is not divisible by q=2"):
        TransformerBlockND(12, 3, mesh=m2)
    with pytest.raises(ValueError, match="embedding_dim=7 is not divisible by 2"):
        nd.Embedding3D(10, 7, mesh=m3)
    # a vocabulary the split does not divide is padded (ceil(V/n) rows per shard), not refused
    assert nd.Embedding3D(10, 8, mesh=m3).weight.shape == (3, 4)
    assert nd.Classifier2D(8, 7, mesh=m2).weight.shape == (4, 4)
    with pytest.raises(ValueError, match="vocab_size=11 does not fit 2 shards of 5"):
        nd.cross_entropy_nd(
            torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), "2d", m2, vocab_size=11
        )
    with pytest.raises(ValueError, match="tp_mode='3d' needs tp = q\\*q\\*q"):
        ntp.Mesh(16, 0, tp=16, tp_mode="3d")
    lin2 = nd.Linear2D(8, 4, mesh=m2)
    with pytest.raises(ValueError, match="full tensor: move it into the layout with split_input"):
        lin2(torch.randn(2, 3, 8))
    with pytest.raises(TypeError, match="dtype"):
        lin2(torch.randn(2, 3, 4, dtype=torch.float64))
    lin3 = nd.Linear3D(8, 4, mesh=m3)  # 3d-a -> 3d-b
    wrong = tag(torch.randn(1, 3, 4), nd.LAYOUT_3D_B)
    with pytest.raises(ValueError, match="takes layout '3d-a' but got a tensor in layout '3d-b'"):
        lin3(wrong)
    with pytest.raises(ValueError, match="batch divisible by 4"):
        nd.split_input(torch.randn(2, 3, 8), "3d-a", m3)
    with pytest.raises(ValueError, match="must agree"):
        nd.cross_entropy_nd(torch.randn(2, 3, 5), torch.zeros(2, 4, dtype=torch.long), "2d", m2)
