"""Norms over features that tensor parallelism splits (``sharded_norm`` in a plan, e.g. OLMo-2's
q/k norms over all heads): the checks that refuse what cannot be sharded exactly, and the
sharded replacement.

A k norm over all key/value heads when tp does not divide ``num_key_value_heads`` (tp >
kv heads: each rank holds copies of the kv heads its query heads read, as the k projection
does): each rank normalizes its copies with the statistics of every distinct head, summed over
the ranks (each head counted at its first copy, a device mask: one graph on every rank), and
the weight rows of copies get the sum of the copies' gradients."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ..parallel import regions
from ..parallel.mesh import Mesh
from ..parallel.sharding import Sharding, mark_sharded, shard_of
from .attention import Heads, ShardedRMSNorm, kv_slots
from .modules import ReplicaRows, require_even_split, runs
from .slice_map import HFSliceMap, even_pieces, set_slice_map


def check_sharded_norm(mod: nn.Module, name: str, mesh: Mesh, heads: Heads | None) -> None:
    """The refusals of :func:`build_sharded_norm`."""
    full = mod.get_parameter("weight").shape[0]
    if not _over_replicated_kv(full, heads, mesh):
        require_even_split(full, mesh, name, "normalized features")
    check_plain_rms_norm(mod, name, full)


def _over_replicated_kv(features: int, heads: Heads | None, mesh: Mesh) -> bool:
    """A norm over all kv heads that tp does not divide (their copies on the ranks)."""
    return (
        heads is not None
        and features == heads.kv * heads.dim
        and heads.kv != heads.q
        and heads.kv % mesh.tp_size != 0
    )


def build_sharded_norm(mod: nn.Module, mesh: Mesh, heads: Heads | None = None) -> ShardedRMSNorm:
    """An RMSNorm whose weight is split over tp like the features it normalizes (the kv head
    copies of each rank for a norm over all kv heads that tp does not divide)."""
    w = mod.get_parameter("weight")
    full = w.shape[0]
    if heads is not None and _over_replicated_kv(full, heads, mesh):
        return ReplicatedKVNorm(mod, mesh, heads)
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
        weight = probe.get_parameter("weight")
        weight.copy_(torch.rand(features, generator=gen) + 0.5)
        x = torch.randn(3, features, generator=gen)
        eps = getattr(probe, "variance_epsilon", getattr(probe, "eps", 1e-6))
        want = weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ok = torch.allclose(probe(x), want, atol=1e-5)
    if not ok:
        raise ValueError(
            f"{name}: sharded_norm needs a plain RMSNorm (weight * x / rms(x)); "
            f"{type(mod).__name__} computes something else"
        )


class ReplicatedKVNorm(ReplicaRows, ShardedRMSNorm):
    """RMSNorm over all ``kv`` key/value heads (``kv * dim`` features) when each rank holds
    copies of some of them (:func:`~neuron_tp.hf.attention.kv_slots`, tp > kv): its input is
    this rank's slots ``[..., L * dim]``, the mean of squares is over the ``kv`` distinct heads
    (each counted on its first copy's rank, then all-reduced over tp), the weight holds the
    slots' rows."""

    _counted: torch.Tensor  # [tp, L], a buffer

    def __init__(self, norm: nn.Module, mesh: Mesh, heads: Heads):
        full = heads.kv * heads.dim
        super().__init__(norm, mesh, full)
        tp, r = mesh.tp_size, mesh.tp_rank
        slots = kv_slots(heads, tp)
        rows = [[h * heads.dim + i for h in mine for i in range(heads.dim)] for mine in slots]
        expanded = [j for mine in rows for j in mine]
        first: dict[int, int] = {}
        for pos, j in enumerate(expanded):
            first.setdefault(j, pos)
        seen: set[int] = set()
        counted = []  # [tp, L]: 1 where the slot is its head's first copy
        for mine in slots:
            counted.append([float(h not in seen) for h in mine])
            seen.update(mine)
        self.register_buffer("_counted", torch.tensor(counted), persistent=False)
        self.slots, self.head_dim = len(slots[0]), heads.dim
        w = norm.get_parameter("weight")
        sh = Sharding((("tp", 0),), (len(expanded),))
        local = shard_of(w.detach().index_select(0, torch.tensor(expanded)), sh, mesh)
        self.weight = nn.Parameter(local.clone(), requires_grad=w.requires_grad)
        mark_sharded(self, "weight", sh)
        keep = tuple(first[j] for j in range(full))
        set_slice_map(self, "weight", HFSliceMap(0, tuple(runs(rows[r])), False, keep))
        self.set_replicas(list(range(len(rows[r]))), rows, full)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, tp = x.dtype, self.mesh.tp
        h = x.float()
        counted = self._counted.to(x.device)
        if tp.size > 1:
            counted = counted.index_select(0, tp.rank_tensor(x.device).view(1))
        per_slot = h.pow(2).unflatten(-1, (self.slots, self.head_dim)).sum(-1)
        ssq = (per_slot * counted.view(-1)).sum(-1, keepdim=True)
        ssq = regions.all_reduce_fwd_all_reduce_bwd(ssq, tp)
        h = h * torch.rsqrt(ssq / self.full_features + self.eps)
        return self._sync(self.weight, x.device) * h.to(dtype)
