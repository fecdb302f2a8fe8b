"""LayerNorm and RMSNorm for 2D/3D layouts: the feature dim is split, so the per-token
statistics (sum and sum of squares) are all-reduced over the layout's feature axis, in one
``[..., 2]`` collective. The affine parameters are split like the features and replicated over
the batch shards (their gradients are summed over the layout's batch group)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn

from ..parallel import regions
from ..parallel.mesh import Mesh, get_mesh
from .activation_layout import (
    LAYOUT_2D,
    LAYOUT_3D_A,
    ActivationLayout,
    check_layout,
    check_mode,
    get_layout,
    tag,
)
from .common import load_shards_from, make_parameter, require_multiple


class _NormND(nn.Module):
    default_layout: ActivationLayout = LAYOUT_2D
    rms = False

    def __init__(
        self,
        hidden: int,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        *,
        layout: ActivationLayout | str | None = None,
        mesh: Mesh | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.mesh = get_mesh(mesh)
        self.layout = get_layout(layout or self.default_layout)
        name = type(self).__name__
        if self.layout.mode != self.default_layout.mode:
            raise ValueError(
                f"{name} takes a {self.default_layout.mode} layout, got {self.layout.name!r}"
            )
        check_mode(self.mesh, self.layout, name)
        require_multiple(hidden, self.layout.feature_split(self.mesh), "hidden", name)
        self.input_layout = self.output_layout = self.layout
        self.hidden, self.eps = hidden, eps
        split = ((self.layout.feature_axis, 0),)
        self.weight = (
            make_parameter(
                self,
                "weight",
                (hidden,),
                split,
                mesh=self.mesh,
                init_fn=nn.init.ones_,
                device=device,
                dtype=dtype,
            )
            if elementwise_affine
            else None
        )
        self.bias = (
            make_parameter(
                self,
                "bias",
                (hidden,),
                split,
                mesh=self.mesh,
                init_fn=nn.init.zeros_,
                device=device,
                dtype=dtype,
            )
            if elementwise_affine and bias and not self.rms
            else None
        )

    @classmethod
    def from_layernorm(
        cls, norm: nn.Module, layout: ActivationLayout | str | None = None, mesh: Mesh | None = None
    ) -> _NormND:
        """Shard an existing ``nn.LayerNorm`` / ``nn.RMSNorm`` over 1-D ``normalized_shape``."""
        # duck-typed: any norm module with ``normalized_shape`` and ``eps`` attributes
        shape = tuple(cast("Sequence[int]", norm.normalized_shape))
        norm_eps = cast("float | None", norm.eps)
        if len(shape) != 1:
            raise ValueError(
                f"{cls.__name__}: only a last-dim norm is supported, got normalized_shape={shape}"
            )
        weight = getattr(norm, "weight", None)
        layer = cls(
            shape[0],
            eps=norm_eps if norm_eps is not None else 1e-6,
            elementwise_affine=weight is not None,
            bias=getattr(norm, "bias", None) is not None,
            layout=layout,
            mesh=mesh,
            device="meta",
            dtype=weight.dtype if weight is not None else None,
        )
        return load_shards_from(layer, norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check_layout(x, self.layout, self.hidden, self.mesh, type(self).__name__)
        feat = self.mesh.group(self.layout.feature_axis)
        batch = self.mesh.group(self.layout.batch_group)
        if self.rms:
            ssq = x.square().sum(-1, keepdim=True)
            msq = regions.all_reduce_fwd_all_reduce_bwd(ssq, feat) / self.hidden
            y = x * torch.rsqrt(msq + self.eps)
        else:
            stats = torch.cat([x.sum(-1, keepdim=True), x.square().sum(-1, keepdim=True)], -1)
            mean, msq = (regions.all_reduce_fwd_all_reduce_bwd(stats, feat) / self.hidden).split(
                1, -1
            )
            y = (x - mean) * torch.rsqrt(msq - mean.square() + self.eps)
        # The affine parameters are replicated over the batch shards: gradients summed over them.
        if self.weight is not None:
            y = y * regions.identity_fwd_all_reduce_bwd(self.weight, batch)
        if self.bias is not None:
            y = y + regions.identity_fwd_all_reduce_bwd(self.bias, batch)
        return tag(y, self.layout)

    def extra_repr(self) -> str:
        return f"{self.hidden}, eps={self.eps}, layout={self.layout.name!r}"


class LayerNorm2D(_NormND):
    """LayerNorm over the last dim of a ``LAYOUT_2D`` activation (stats over the row group)."""


class RMSNorm2D(_NormND):
    """RMSNorm over the last dim of a ``LAYOUT_2D`` activation."""

    rms = True


class LayerNorm3D(_NormND):
    """LayerNorm of a 3D-layout activation (``layout='3d-a'`` default or ``'3d-b'``)."""

    default_layout = LAYOUT_3D_A


class RMSNorm3D(_NormND):
    """RMSNorm of a 3D-layout activation (``layout='3d-a'`` default or ``'3d-b'``)."""

    default_layout = LAYOUT_3D_A
    rms = True
