"""3D tensor parallelism (Agarwal et al.; Bian et al. 2021) on a ``q x q x q`` cube, P = q^3.

Cube rank ``(i, j, l)``. A :class:`Linear3D` with orientation ``"ab"`` maps
:data:`~neuron_tp.layers.activation_layout.LAYOUT_3D_A` (batch chunk ``(i, j)``, features ``l``) to
``LAYOUT_3D_B`` (batch ``(i, l)``, features ``j``); ``"ba"`` maps B back to A by swapping the
roles of the ``weight`` and ``output`` axes. The weight block ``W^T[l, j]`` (in chunk of the
input's feature axis, out chunk of the other) is further split over ``input`` (i).

Schedule (orientation ``ab``; ``N`` tokens, ``a``/``c`` in/out features; ring bytes per rank):

* forward: all-gather ``X`` over ``weight`` along the batch -> ``X[i, l]`` (``(q-1)/q * N a/q^2``),
  all-gather ``W`` over ``input`` -> ``W^T[l, j]`` (``(q-1)/q * a c/q^2``), GEMM -> partial
  ``Y[i, j]``, reduce-scatter over ``output`` along the batch (``(q-1)/q * N c/q^2``);
* backward (``regather=True``, the default): all-gather ``dY`` over ``output``; autograd saved
  only the local blocks of ``X`` and ``W``, so both are all-gathered again (the forward's two
  sizes, issued before the GEMMs that need them); reduce-scatter ``dX`` over ``weight`` and
  ``dW`` over ``input``: five collectives;
* backward (``regather=False``): the gathered ``X[i, l]`` and ``W^T[l, j]`` were saved, so only
  all-gather ``dY``, reduce-scatter ``dX`` and ``dW`` (the same three sizes as forward).

Total per linear with the re-gather ``(q-1)/q^3 * (3 N a + 3 a c + 2 N c)`` (eight collectives;
backward ``(q-1)/q^3 * (2 N a + 2 a c + N c)``), the saved input ``X`` being the local 1/P
block; without it ``2 (q-1)/q^3 * (N a + a c + N c)`` (six collectives, backward
``(q-1)/q^3 * (N a + a c + N c)``; Colossal-AI's ``6(q-1)/q^3`` for square operands) for a
saved ``X[i, l]`` q times larger. Every collective is a single op over q ranks, against 1D's
``2 * 2(P-1)/P * N a`` for a column/row pair over all P ranks.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import gathered_linears, regions
from ..parallel.mesh import Mesh, get_mesh
from .activation_layout import LAYOUT_3D_A, LAYOUT_3D_B, check_layout, check_mode, tag
from .common import FromLinear, check_dtype, make_linear_parameters, require_multiple

ORIENTATIONS = {"ab": (LAYOUT_3D_A, LAYOUT_3D_B), "ba": (LAYOUT_3D_B, LAYOUT_3D_A)}


class Linear3D(FromLinear, nn.Module):
    """``Y = X W^T + b`` on a ``q x q x q`` cube.

    ``orientation="ab"``: input ``LAYOUT_3D_A`` ``[b/q^2, ..., in/q]`` -> output ``LAYOUT_3D_B``
    ``[b/q^2, ..., out/q]``; ``"ba"`` the reverse. Stack ``ab`` then ``ba`` (an MLP) to return
    to the input layout. ``in_features`` must divide by ``q^2``, ``out_features`` by ``q``.
    Parameters: ``weight`` ``[out/q, in/q^2]``, ``bias`` ``[out/q]`` (replicated over the batch
    shards, gradient summed over them).

    ``regather=True`` (default) saves only the local ``X`` and ``W`` blocks for backward and
    all-gathers them again there (saved input 1/P, two more all-gathers per backward);
    ``regather=False`` saves the gathered ``X[i, l]`` and ``W^T[l, j]`` (q times the saved
    input, no backward re-gather).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        orientation: str = "ab",
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
        check_mode(self.mesh, LAYOUT_3D_A, name)
        if orientation not in ORIENTATIONS:
            raise ValueError(
                f"{name}: orientation must be 'ab' (layout 3d-a -> 3d-b) or 'ba' "
                f"(3d-b -> 3d-a), got {orientation!r}"
            )
        self.orientation = orientation
        self.input_layout, self.output_layout = ORIENTATIONS[orientation]
        q = self.mesh.group("input").size
        require_multiple(in_features, q * q, "in_features", name)
        require_multiple(out_features, q, "out_features", name)
        self.in_features, self.out_features = in_features, out_features
        f_in, f_out = self.input_layout.feature_axis, self.output_layout.feature_axis
        self.weight, self.bias = make_linear_parameters(
            self,
            in_features,
            out_features,
            bias,
            weight_splits=((f_out, 0), (f_in, 1), ("input", 1)),
            bias_splits=((f_out, 0),),
            mesh=self.mesh,
            init_method=init_method,
            device=device,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        name = type(self).__name__
        check_layout(x, self.input_layout, self.in_features, self.mesh, name)
        check_dtype(x, self.weight, name)
        m = self.mesh
        gather_x = m.group(self.output_layout.feature_axis)  # inner batch axis of the input
        scatter_y = m.group(self.input_layout.feature_axis)  # summed-over in-feature axis
        # X over the inner batch axis, W over input; the GEMM's Y is a partial sum over the
        # in-feature chunks
        y = gathered_linears.gathered_operands_linear(
            x,
            self.weight,
            x_group=gather_x,
            x_dim=0,
            w_group=m.group("input"),
            w_dim=1,
            regather=self.regather,
        )
        y = regions.reduce_scatter_fwd_all_gather_bwd(y, scatter_y, dim=0)
        if self.bias is not None:  # backward: the bias gradient is summed over the batch shards
            y = y + regions.identity_fwd_all_reduce_bwd(
                self.bias, m.group(self.output_layout.batch_group)
            )
        return tag(y, self.output_layout)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"q={self.mesh.group('input').size}, orientation={self.orientation!r}, "
            f"bias={self.bias is not None}" + ("" if self.regather else ", regather=False")
        )
