"""2D/3D layout tags survive shape-preserving ops, so a mis-composed model is refused before
any collective instead of silently computing on the wrong blocks. No communication happens:
the checks run before the first collective (a mesh without process groups is enough)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import neuron_tp as ntp
from neuron_tp.layers import Linear3D
from neuron_tp.layers.activation_layout import LAYOUT_3D_A, LAYOUT_3D_B, tag

OPS = {
    "gelu": F.gelu,
    "plus_one": lambda t: t + 1,
    "dropout": lambda t: F.dropout(t, 0.1),
    "residual": lambda t: t * 2 + t,
    "relu_inplace": lambda t: F.relu(t.clone(), inplace=True),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_3d_b_tensor_through_elementwise_op_is_refused_by_an_ab_layer(op):
    mesh = ntp.Mesh(8, 0, tp=8, tp_mode="3d")
    lin = Linear3D(8, 8, orientation="ab", mesh=mesh)  # expects 3d-a; local shapes equal
    x = tag(torch.randn(2, 3, 4, requires_grad=True), LAYOUT_3D_B)
    with pytest.raises(ValueError, match="takes layout '3d-a' but got a tensor in layout '3d-b'"):
        lin(OPS[op](x))


def test_tag_is_dropped_when_layouts_mix_or_shape_changes():
    a = tag(torch.randn(2, 3, 4), LAYOUT_3D_A)
    b = tag(torch.randn(2, 3, 4), LAYOUT_3D_B)
    assert getattr(a + b, "_ntp_layout", None) is None  # ambiguous: checked by shape only
    assert getattr(a.sum(-1), "_ntp_layout", None) is None  # not the same block any more
    assert getattr(F.gelu(a) * 3, "_ntp_layout", None) == "3d-a"
    # the tag changes neither values nor autograd
    x = torch.randn(2, 3, 4, requires_grad=True)
    y = F.gelu(tag(x, LAYOUT_3D_A)).sum()
    y.backward()
    ref = torch.autograd.grad(F.gelu(x).sum(), x)[0]
    torch.testing.assert_close(x.grad, ref)


def test_2d_layer_refuses_a_3d_tensor_after_gelu():
    from neuron_tp.layers import Linear2D

    lin = Linear2D(8, 8, mesh=ntp.Mesh(4, 0, tp=4, tp_mode="2d"))
    x = tag(torch.randn(2, 3, 4), LAYOUT_3D_A)  # local shape fits a 2D q=2 block too
    with pytest.raises(ValueError, match="takes layout '2d' but got a tensor in layout '3d-a'"):
        lin(F.gelu(x))
