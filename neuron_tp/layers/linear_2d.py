"""2D tensor parallelism (SUMMA / Optimus layouts) on a ``q x q`` grid, P = q^2.

Grid rank ``(r, c)`` holds activation block ``X[r, c]`` (batch chunk r, feature chunk c, see
:data:`~neuron_tp.layers.activation_layout.LAYOUT_2D`) and weight block ``W^T[r, c]`` (input-feature
chunk r, output-feature chunk c). ``Y[r, c] = sum_k X[r, k] W^T[k, c]``.

Schedule (all-gather / reduce-scatter form of SUMMA), per rank, ring bytes, ``a``/``c`` the
in/out features, ``N`` tokens:

* forward: all-gather ``X`` along the row group -> ``X[r, :]`` (``(q-1)/q * N a/q``),
  all-gather ``W^T`` along the column group -> ``W^T[:, c]`` (``(q-1)/q * a c/q``), one GEMM;
* backward (``regather=True``, the default): autograd saved only the local blocks ``X[r, c]``
  and ``W^T[r, c]``, so both are all-gathered again (the same two sizes, issued before the
  GEMMs that need them), then reduce-scatter ``dX[r, :]`` along the row (``(q-1)/q * N a/q``)
  and ``dW^T[:, c]`` along the column (``(q-1)/q * a c/q``);
* backward (``regather=False``): the gathered ``X[r, :]`` and ``W^T[:, c]`` are the tensors
  autograd saved, so only the two reduce-scatters run.

Total per linear: ``3 (q-1)/q * (N a + a c)/q`` (six collectives, backward ``2 (q-1)/q *
(N a + a c)/q``) with the re-gather, ``2 (q-1)/q * (N a + a c)/q`` (four, backward
``(q-1)/q * (N a + a c)/q``) without; each a single large op. The re-gather is the memory for
communication trade of SUMMA: the saved activation is the local ``X[r, c]`` (1/P of ``X``)
instead of ``X[r, :]`` (1/q), so a block's saved activations shrink as 1/P.
SUMMA's q-step loop moves the same blocks as 2q broadcasts forward (and 4q backward, since it
re-broadcasts ``X`` and ``W``: Colossal-AI's ``6(q-1)/q`` per-GEMM figure, the same bytes as
the re-gather schedule), each a separate small collective plus a small GEMM. On XLA every
collective is a graph op with fixed latency and a barrier, and on Neuron small GEMMs underuse
the engines, so one all-gather + one big GEMM is the better schedule.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import gathered_linears, regions
from ..parallel.mesh import Mesh, get_mesh
from .activation_layout import LAYOUT_2D, ActivationLayout, check_layout, check_mode, tag
from .common import FromLinear, check_dtype, make_linear_parameters, require_multiple


class Linear2D(FromLinear, nn.Module):
    """``Y = X W^T + b`` on a ``q x q`` grid. Input and output layout: ``LAYOUT_2D``
    (``[b/q, ..., in/q]`` -> ``[b/q, ..., out/q]``), so 2D linears stack directly.

    Parameters: ``weight`` ``[out/q, in/q]`` (splits ``row`` on dim 0, ``col`` on dim 1),
    ``bias`` ``[out/q]`` (split over ``row``, replicated over ``col``; its gradient is summed
    over the batch shards of the column group).

    ``regather=True`` (default) saves only the local ``X`` and ``W`` blocks for backward and
    all-gathers them again there (saved activation 1/P, two more all-gathers per backward);
    ``regather=False`` saves the gathered ``X[r, :]`` and ``W^T[:, c]`` (q times the saved
    input, no backward all-gather).
    """

    input_layout: ActivationLayout = LAYOUT_2D
    output_layout: ActivationLayout = LAYOUT_2D

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        mesh: Mesh | None = None,
        device=None,
        dtype=None,
        init_method=None,
        regather: bool = True,
    ):
        super().__init__()
        self.regather = regather
        self.mesh = get_mesh(mesh)
        name = type(self).__name__
        check_mode(self.mesh, LAYOUT_2D, name)
        q = self.mesh.group("row").size
        require_multiple(in_features, q, "in_features", name)
        require_multiple(out_features, q, "out_features", name)
        self.in_features, self.out_features = in_features, out_features
        self.weight, self.bias = make_linear_parameters(
            self,
            in_features,
            out_features,
            bias,
            weight_splits=(("row", 0), ("col", 1)),
            bias_splits=(("row", 0),),
            mesh=self.mesh,
            init_method=init_method,
            device=device,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        check_layout(x, LAYOUT_2D, self.in_features, self.mesh, name)
        check_dtype(x, self.weight, name)
        row, col = self.mesh.group("row"), self.mesh.group("col")
        # X along the row (-> X[r, :]), W along the column (-> W^T[:, c]), one GEMM
        y = gathered_linears.gathered_operands_linear(
            x, self.weight, x_group=row, x_dim=-1, w_group=col, w_dim=1, regather=self.regather
        )
        if self.bias is not None:  # backward: the bias gradient is summed over the batch shards
            y = y + regions.identity_fwd_all_reduce_bwd(self.bias, col)
        return tag(y, LAYOUT_2D)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"q={self.mesh.group('row').size}, bias={self.bias is not None}"
            + ("" if self.regather else ", regather=False")
        )
