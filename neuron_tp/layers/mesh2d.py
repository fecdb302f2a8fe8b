"""2D tensor parallelism (SUMMA / Optimus layouts) on a ``q x q`` grid, P = q^2.

Grid rank ``(r, c)`` holds activation block ``X[r, c]`` (batch chunk r, feature chunk c, see
:data:`~neuron_tp.layers.layout_nd.LAYOUT_2D`) and weight block ``W^T[r, c]`` (input-feature
chunk r, output-feature chunk c). ``Y[r, c] = sum_k X[r, k] W^T[k, c]``.

Schedule (all-gather / reduce-scatter form of SUMMA), per rank, ring bytes, ``a``/``c`` the
in/out features, ``N`` tokens:

* forward: all-gather ``X`` along the row group -> ``X[r, :]`` (``(q-1)/q * N a/q``),
  all-gather ``W^T`` along the column group -> ``W^T[:, c]`` (``(q-1)/q * a c/q``), one GEMM;
* backward: reduce-scatter ``dX[r, :]`` along the row (``(q-1)/q * N a/q``) and
  ``dW^T[:, c]`` along the column (``(q-1)/q * a c/q``); the gathered ``X`` and ``W`` are the
  tensors autograd saved, so nothing is re-gathered.

Total ``2 (q-1)/q * (N a + a c)/q``: four collectives per linear, each a single large op.
SUMMA's q-step loop moves the same blocks as 2q broadcasts forward (and 4q backward, since it
re-broadcasts ``X`` and ``W``: Colossal-AI's ``6(q-1)/q`` per-GEMM figure), each a separate small
collective plus a small GEMM. On XLA every collective is a graph op with fixed latency and a
barrier, and on Neuron small GEMMs underuse the engines, so one all-gather + one big GEMM is the
better schedule; the price is holding the gathered ``X[r, :]`` (1/q of the activation) until
backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import regions
from ..mesh import Mesh, get_mesh
from .common import FromLinear, linear_bias_init, linear_weight_init, make_parameter
from .layout_nd import LAYOUT_2D, Layout, check_layout, check_mode, tag


def require_multiple(size: int, q: int, what: str, layer: str) -> None:
    """A clear error (before any collective) when ``size`` is not a multiple of ``q``."""
    if size % q:
        raise ValueError(f"{layer}: {what}={size} is not divisible by {q}; use a multiple of "
                         f"{q} (e.g. {size + (-size) % q})")


class Linear2D(FromLinear, nn.Module):
    """``Y = X W^T + b`` on a ``q x q`` grid. Input and output layout: ``LAYOUT_2D``
    (``[b/q, ..., in/q]`` -> ``[b/q, ..., out/q]``), so 2D linears stack directly.

    Parameters: ``weight`` ``[out/q, in/q]`` (splits ``row`` on dim 0, ``col`` on dim 1),
    ``bias`` ``[out/q]`` (split over ``row``, replicated over ``col``; its gradient is summed
    over the batch shards of the column group).
    """

    input_layout: Layout = LAYOUT_2D
    output_layout: Layout = LAYOUT_2D

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 mesh: Mesh | None = None, device=None, dtype=None, init_method=None):
        super().__init__()
        self.mesh = get_mesh(mesh)
        name = type(self).__name__
        check_mode(self.mesh, LAYOUT_2D, name)
        q = self.mesh.group("row").size
        require_multiple(in_features, q, "in_features", name)
        require_multiple(out_features, q, "out_features", name)
        self.in_features, self.out_features = in_features, out_features
        init = linear_weight_init if init_method is None else init_method
        self.weight = make_parameter(
            self, "weight", (out_features, in_features), (("row", 0), ("col", 1)), self.mesh, init,
            device, dtype)
        self.bias = (make_parameter(self, "bias", (out_features,), (("row", 0),), self.mesh,
                                    linear_bias_init(in_features), device, dtype)
                     if bias else None)


    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layout(x, LAYOUT_2D, self.in_features, self.mesh, type(self).__name__)
        if x.dtype != self.weight.dtype:
            raise TypeError(f"{type(self).__name__}: input dtype {x.dtype} does not match "
                            f"weight dtype {self.weight.dtype}")
        row, col = self.mesh.group("row"), self.mesh.group("col")
        x_row = regions.gather_from_sequence_parallel(x, row, -1)  # fwd AG, bwd RS
        w_col = regions.gather_from_sequence_parallel(self.weight, col, 1)
        y = F.linear(x_row, w_col)
        if self.bias is not None:
            y = y + regions.copy_to_tensor_parallel(self.bias, col)  # bwd: sum over batch shards
        return tag(y, LAYOUT_2D)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"q={self.mesh.group('row').size}, bias={self.bias is not None}")
