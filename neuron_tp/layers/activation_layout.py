"""Activation layouts: how the activation a layer takes or returns is split over the mesh.

Every layer declares ``input_layout`` and ``output_layout`` (for an embedding, ``input_layout``
is the layout of its ids).

1D tensor parallelism (over the ``tp`` group) uses three names:

* ``REPLICATED``: every tp rank holds the full activation;
* ``SHARDED_FEATURES``: rank r holds chunk r of the last dim (hidden features, or the
  vocabulary of logits);
* ``SHARDED_SEQUENCE``: rank r holds chunk r of the sequence dim (sequence parallelism).

2D and 3D tensor parallelism use an :class:`ActivationLayout`, which says which mesh axes split
the batch (dim 0, outermost axis first) and which axis splits the features (last dim). Sequence
and head dims are never split, so attention is local.

* ``LAYOUT_2D``: grid rank ``(r, c)`` holds batch chunk ``r`` (axis ``col``, which varies r) and
  feature chunk ``c`` (axis ``row``): ``[b/q, ..., h/q]``.
* ``LAYOUT_3D_A``: cube rank ``(i, j, l)`` holds batch chunk ``i*q + j`` (axes ``input``,
  ``weight``) and feature chunk ``l`` (axis ``output``): ``[b/q^2, ..., h/q]``.
* ``LAYOUT_3D_B``: batch chunk ``i*q + l`` (``input``, ``output``), feature chunk ``j``
  (``weight``). A :class:`~neuron_tp.layers.linear_3d.Linear3D` maps A to B or B to A (its
  ``orientation``), so an up/down pair returns to the layout it started from.

2D/3D layers tag their outputs with their layout and refuse a tensor tagged with another layout.
The tag survives shape-preserving ops (``gelu``, ``x + 1``, dropout, residual adds of tensors in
the same layout): a tagged activation is a thin tensor subclass that re-tags results of the
same shape. A tensor that was never tagged (user-made, or reshaped) is checked by shape only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..parallel import comm, regions
from ..parallel.mesh import Mesh
from .common import check_device

REPLICATED = "replicated"
SHARDED_FEATURES = "sharded(features)"
SHARDED_SEQUENCE = "sharded(sequence)"
LAYOUTS_1D = (REPLICATED, SHARDED_FEATURES, SHARDED_SEQUENCE)

_TAG = "_ntp_layout"


@dataclass(frozen=True)
class ActivationLayout:
    """A 2D/3D activation layout. ``batch_axes``: mesh axes splitting dim 0, outermost first;
    ``feature_axis``: the axis splitting the last dim; ``batch_group``: the axis whose group
    varies exactly the batch axes (replicated parameters used on batch shards reduce their
    gradients over it)."""

    name: str
    mode: str
    batch_axes: tuple[str, ...]
    feature_axis: str
    batch_group: str

    def batch_split(self, mesh: Mesh) -> int:
        return mesh.group(self.batch_group).size

    def feature_split(self, mesh: Mesh) -> int:
        return mesh.group(self.feature_axis).size

    def __str__(self) -> str:
        return self.name


Layout = ActivationLayout  # the earlier name, kept for existing imports

LAYOUT_2D = ActivationLayout("2d", "2d", ("col",), "row", "col")
LAYOUT_3D_A = ActivationLayout("3d-a", "3d", ("input", "weight"), "output", "input_weight")
LAYOUT_3D_B = ActivationLayout("3d-b", "3d", ("input", "output"), "weight", "input_output")


def residual_layout(tp_mode: str) -> ActivationLayout:
    """The layout of the residual stream between 2D / 3D transformer blocks (and into the LM
    head): ``2d`` on a 2D mesh, ``3d-a`` on a 3D one."""
    return LAYOUT_2D if tp_mode == "2d" else LAYOUT_3D_A


LAYOUTS = {layout.name: layout for layout in (LAYOUT_2D, LAYOUT_3D_A, LAYOUT_3D_B)}


def get_layout(layout: ActivationLayout | str) -> ActivationLayout:
    """The 2D/3D layout named ``layout`` (or ``layout`` itself)."""
    if isinstance(layout, ActivationLayout):
        return layout
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {sorted(LAYOUTS)}")
    return LAYOUTS[layout]


def check_mode(mesh: Mesh, layout: ActivationLayout, layer: str) -> None:
    """A clear error when ``mesh`` is not of the tp mode (2d/3d) of ``layout``."""
    if mesh.tp_mode != layout.mode:
        raise ValueError(
            f"{layer} needs a mesh with tp_mode={layout.mode!r}, got {mesh}; "
            f"build it with ntp.init_mesh(tp=..., tp_mode={layout.mode!r})"
        )


class LaidOut(torch.Tensor):
    """An activation tagged with its 2D/3D layout; results of ops that keep its shape carry
    the tag on (results mixing two different layouts carry none)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if not isinstance(out, LaidOut):
            return out
        with torch._C.DisableTorchFunctionSubclass():  # .shape must not re-enter this hook
            seen = {
                (a.__dict__.get(_TAG), tuple(a.shape))
                for a in _tensors(args, kwargs)
                if isinstance(a, LaidOut)
            }
            names = {name for name, _ in seen if name is not None}
            if len(names) == 1:
                name = names.pop()
                if (name, tuple(out.shape)) in seen:
                    out.__dict__[_TAG] = name
        return out


def _tensors(args, kwargs):
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from _tensors(a, None)
        elif isinstance(a, torch.Tensor):
            yield a


def tag(x: torch.Tensor, layout: ActivationLayout) -> torch.Tensor:
    """``x`` marked as laid out in ``layout`` (same data, autograd unchanged)."""
    out = x if isinstance(x, LaidOut) else x.as_subclass(LaidOut)
    out.__dict__[_TAG] = layout.name
    return out


def check_layout(
    x: torch.Tensor, layout: ActivationLayout, features: int, mesh: Mesh, layer: str
) -> None:
    """Before any collective: the input is in ``layout`` and has ``features`` full features."""
    check_device(x, mesh, layer)
    seen = getattr(x, _TAG, None)
    if seen is not None and seen != layout.name:
        raise ValueError(
            f"{layer} takes layout {layout.name!r} but got a tensor in layout "
            f"{seen!r}; use a layer (or Linear3D orientation) whose input layout "
            f"is {seen!r}, or gather_output/split_input to convert"
        )
    local = features // layout.feature_split(mesh)
    if x.dim() < 2 or x.shape[-1] != local:
        hint = (
            " (that is the full tensor: move it into the layout with split_input)"
            if x.dim() >= 2 and x.shape[-1] == features
            else ""
        )
        raise ValueError(
            f"{layer}: layout {layout.name!r} expects [batch/"
            f"{layout.batch_split(mesh)}, ..., {features}/"
            f"{layout.feature_split(mesh)}={local}], got shape {tuple(x.shape)}"
            f"{hint}"
        )


def split_input(
    x: torch.Tensor, layout: ActivationLayout | str, mesh: Mesh, feature_dim: bool = True
) -> torch.Tensor:
    """This rank's block of the full activation ``x`` (``[batch, ..., hidden]``, identical on
    every tp rank) in ``layout``; backward all-gathers. ``feature_dim=False`` splits only the
    batch (integer ids, labels)."""
    layout = get_layout(layout)
    check_mode(mesh, layout, "split_input")
    nb, nf = layout.batch_split(mesh), layout.feature_split(mesh)
    if x.shape[0] % nb or (feature_dim and x.shape[-1] % nf):
        raise ValueError(
            f"split_input: layout {layout.name!r} needs batch divisible by {nb}"
            + (f" and features by {nf}" if feature_dim else "")
            + f", got shape {tuple(x.shape)}"
        )
    if not x.is_floating_point():
        return comm.local_chunk(x, mesh.group(layout.batch_group), 0)
    x = regions.split_fwd_all_gather_bwd(x, mesh.group(layout.batch_group), dim=0)
    if feature_dim:
        x = regions.split_fwd_all_gather_bwd(x, mesh.group(layout.feature_axis), dim=-1)
    return tag(x, layout)


def gather_output(
    x: torch.Tensor, layout: ActivationLayout | str, mesh: Mesh, feature_dim: bool = True
) -> torch.Tensor:
    """The full activation from this rank's block in ``layout`` (all-gathers; backward keeps
    this rank's block). Inverse of :func:`split_input`."""
    layout = get_layout(layout)
    check_mode(mesh, layout, "gather_output")
    if feature_dim:
        x = regions.all_gather_fwd_split_bwd(x, mesh.group(layout.feature_axis), dim=-1)
    return regions.all_gather_fwd_split_bwd(x, mesh.group(layout.batch_group), dim=0)
