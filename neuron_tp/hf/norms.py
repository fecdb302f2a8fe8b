"""Norms over features that tensor parallelism splits (``sharded_norm`` in a plan, e.g. Qwen3's
q/k norms over all heads): the checks that refuse what cannot be sharded exactly, and the
sharded replacement."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..parallel.mesh import Mesh, valid_tp_degrees
from ..parallel.sharding import Sharding, mark_sharded, shard_of
from .attention import Heads, ShardedRMSNorm
from .modules import require_even_split
from .slice_map import HFSliceMap, even_pieces, set_slice_map


def check_sharded_norm(mod: nn.Module, name: str, mesh: Mesh, heads: Heads | None) -> None:
    """The refusals of :func:`build_sharded_norm`."""
    full = mod.weight.shape[0]
    require_even_split(full, mesh, name, "normalized features")
    if heads is not None and full == heads.kv * heads.dim and heads.kv % mesh.tp_size:
        raise ValueError(
            f"{name}: a norm over all key/value heads cannot be sharded when "
            f"num_key_value_heads={heads.kv} is not divisible by tp="
            f"{mesh.tp_size}; tp degrees that work: "
            f"{valid_tp_degrees(mesh.world_size, heads.kv, heads.q)}"
        )
    check_plain_rms_norm(mod, name, full)


def build_sharded_norm(mod: nn.Module, mesh: Mesh) -> ShardedRMSNorm:
    """An RMSNorm whose weight is split over tp like the features it normalizes."""
    w = mod.weight
    full = w.shape[0]
    sh = Sharding((("tp", 0),), (full,))
    norm = ShardedRMSNorm(mod, mesh, full)
    norm.weight = nn.Parameter(
        shard_of(w.detach(), sh, mesh).clone(), requires_grad=w.requires_grad
    )
    mark_sharded(norm, "weight", sh)
    set_slice_map(
        norm, "weight", HFSliceMap(0, tuple(even_pieces(full, mesh.tp_rank, mesh.tp_size)))
    )
    return norm


def check_plain_rms_norm(mod: nn.Module, name: str, features: int) -> None:
    """``sharded_norm`` re-implements ``weight * x / rms(x)``: check the module computes that."""
    probe = copy.deepcopy(mod).to_empty(device="cpu").float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        probe.weight.copy_(torch.rand(features, generator=gen) + 0.5)
        x = torch.randn(3, features, generator=gen)
        eps = getattr(probe, "variance_epsilon", getattr(probe, "eps", 1e-6))
        want = probe.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ok = torch.allclose(probe(x), want, atol=1e-5)
    if not ok:
        raise ValueError(
            f"{name}: sharded_norm needs a plain RMSNorm (weight * x / rms(x)); "
            f"{type(mod).__name__} computes something else"
        )
