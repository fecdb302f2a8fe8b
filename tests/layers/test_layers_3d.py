"""3D (q x q x q) tensor parallelism on gloo, 8 ranks (q=2): every layer in both orientations,
the loss and the block against the unsharded computation (outputs, input/parameter grads); the
linears and the block with and without the backward re-gather (``regather``)."""

import gloo_dist
import neuron_tp as ntp
from nd_reference import check_block, check_linears, check_model_loss, check_padded_vocab


def _tp8():
    mesh = ntp.init_mesh(tp=8, tp_mode="3d")
    check_linears(mesh, batch=4)
    for regather in (True, False):
        check_block(mesh, batch=4, regather=regather)
    check_model_loss(mesh, batch=4)
    for vocab in (13, 5):  # q=2 / q^2=4 do not divide them; 5: a shard of the table is all padding
        check_padded_vocab(mesh, batch=4, vocab=vocab)


def test_3d_q2_layers_block_loss():
    gloo_dist.run(_tp8, world_size=8)
