"""ZeRO-1 over the data-parallel group: optimizer state sharded over dp, fp32 master weights.

The ranks the state is cut over are those holding the same parameters: dp, or under context
parallelism dp x cp (``mesh.replicas``: the gradients reduce over it anyway, so the state
per rank is divided by dp x cp, as Megatron's distributed optimizer does); below "dp" means
that group. Every parameter is flattened, zero-padded to a multiple of dp and cut into dp
equal chunks; dp rank ``r`` owns chunk ``r`` of every parameter (``offset = r * chunk``).
The inner optimizer (AdamW by default) sees only the owned chunks: one 1-D "shard" tensor per
parameter, in ``master_dtype`` (fp32). For parameters already in ``master_dtype`` the shard is
a working copy of the owned slice, refreshed from the parameter at every step (so it is no
extra state); for bf16 parameters it is the fp32 master copy, the true value of the weights,
kept across steps.

A step is one reduce-scatter and one all-gather per bucket (parameters of one param group and
dtype, laid out as ``(dp, chunk)`` blocks side by side so the collectives are 1-D and every
rank's piece holds its chunk of every parameter): gradients are summed over dp and divided by
dp (the mean, as :func:`neuron_tp.optim.grads.allreduce_data_parallel_grads`), cast to the master
dtype, the inner optimizer steps on the shards, and the shards are gathered back into the
parameters (cast to their dtype). No host reads, no branching on values: one graph per step.

Checkpoints (:mod:`neuron_tp.optim.zero1_state`, which the ``Zero1`` methods delegate to):
:meth:`Zero1.state_dict` is this rank's shards plus the layout (dp size, chunk, offset, names,
shapes), what a training checkpoint saves per (tp, dp) rank; :func:`gather_full_state` joins
every dp rank's shard states on the host; :meth:`Zero1.full_state_dict` does it with an
all-gather over dp, and :meth:`Zero1.load_full_state_dict` takes this rank's chunks at any dp
degree. States are per parameter and hold THIS rank's tp shard.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..parallel import comm
from ..parallel.mesh import Group, Mesh, get_mesh
from ..parallel.sharding import expert_split, named_parameter_meta
from . import zero1_state
from .grads import PPSum, norm_weights, sum_over_pp
from .zero1_layout import Slot, chunk_of, padded_blocks
from .zero1_state import FULL_FORMAT, SHARD_FORMAT, gather_full_state

__all__ = ["Zero1", "gather_full_state", "SHARD_FORMAT", "FULL_FORMAT"]


@dataclass
class _Bucket:
    """Parameters of one param group and dtype: one reduce-scatter, one all-gather."""

    slots: list[Slot] = field(default_factory=list)


class Zero1:
    """ZeRO-1 wrapper of ``optimizer_cls`` over ``mesh``'s dp group.

    ``params``: a module (all its trainable parameters, one group; its sharding records give
    the tp-aware gradient norm), or parameters, or param-group dicts (options per group, e.g.
    ``weight_decay`` or a device ``lr`` tensor); pass ``model=`` with the last two for names
    and tp-aware norms. ``opt_kwargs`` go to ``optimizer_cls``.

    Use after backward (and :func:`neuron_tp.sync_sequence_parallel_grads`), instead of
    ``allreduce_data_parallel_grads`` + ``clip_grad_norm_`` + ``optimizer.step()``::

        norm = zero.clip_grad_norm_(max_norm)   # optional; reduce-scatters the gradients
        zero.step()                             # reduce-scatter (if not yet), step, all-gather
        zero.zero_grad()
    """

    def __init__(
        self,
        params: nn.Module | Iterable[nn.Parameter] | Iterable[dict],
        mesh: Mesh | None = None,
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        master_dtype: torch.dtype = torch.float32,
        model: nn.Module | None = None,
        **opt_kwargs,
    ):
        self.mesh = get_mesh(mesh)
        # cp ranks hold the same parameters too: their state is cut over dp x cp
        self.group = self.mesh.replicas if self.mesh.cp_size > 1 else self.mesh.dp
        self.master_dtype = master_dtype
        if isinstance(params, nn.Module):
            model = params
            params = [p for p in params.parameters() if p.requires_grad]
        items: list[Any] = list(params)  # parameters, or param-group dicts
        groups: list[dict[str, Any]] = (
            [{"params": items}] if items and not isinstance(items[0], dict) else items
        )
        self.model = model
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        if self.mesh.ep_size > 1 and model is None:
            raise UserError(
                f"ZeRO-1 under expert parallelism (ep={self.mesh.ep_size}) needs the model "
                "(Zero1(model, ...) or model=...) to tell the experts, cut over edp, apart"
            )
        self._experts = (
            {n for n, _, m in named_parameter_meta(model) if expert_split(m.sharding) is not None}
            if model is not None
            else set()
        )
        self.buckets: list[_Bucket] = []
        self.slots: dict[str, Slot] = {}
        inner_groups = []
        for gi, g in enumerate(groups):
            opts = {k: v for k, v in g.items() if k != "params"}
            shards = []
            by_dtype: dict[tuple[torch.dtype, str], _Bucket] = {}
            for pi, p in enumerate(g["params"]):
                name = names.get(id(p), f"group{gi}.param{pi}")
                if name in self.slots:
                    raise ValueError(f"parameter {name!r} appears twice")
                group = self._group_of(name)
                chunk = -(-p.numel() // group.size)
                with torch.no_grad():
                    shard = chunk_of(p.detach(), chunk, group).to(master_dtype).clone()
                slot = Slot(name, p, shard, chunk, p.dtype != master_dtype, group)
                by_dtype.setdefault((p.dtype, group.name), _Bucket()).slots.append(slot)
                self.slots[name] = slot
                shards.append(shard)
            self.buckets.extend(by_dtype.values())
            inner_groups.append({"params": shards, **opts})
        self.inner = optimizer_cls(inner_groups, **opt_kwargs)
        self._reduced = False
        self._norm_weights_ready = False

    def _group_of(self, name: str) -> Group:
        """The group a parameter's chunks are cut over: dp, or for an expert spread over
        ``ep`` the ranks holding the same experts (``edp``)."""
        return self.mesh.group("edp") if name in self._experts else self.group

    # -- the optimizer interface the training loop uses ---------------------------------
    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (over shards): set ``lr`` here (schedules do)."""
        return self.inner.param_groups

    @property
    def state(self):
        """The inner optimizer's state (per shard)."""
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for slot in self.slots.values():
            for t in (slot.param, slot.shard):
                if t.grad is not None:
                    if set_to_none:
                        t.grad = None
                    else:
                        t.grad.detach().zero_()
        self._reduced = False

    def reduce_grads(self) -> None:
        """Reduce-scatter the parameters' gradients over dp (dp x cp under context
        parallelism: each cp rank holds its tokens' part) into the shards' gradients (the
        dp mean, in the master dtype). Parameters without a gradient contribute zeros and their
        shard gets none (the inner optimizer skips it): that must be the same on every rank."""
        dp = self.mesh.dp_size  # the mean over data replicas; cp ranks' parts add up
        for bucket in self.buckets:
            slots = bucket.slots
            if all(s.param.grad is None for s in slots):
                continue
            group = slots[0].group  # an expert's gradient already sums its ep group's tokens
            grads = [
                s.param.grad.detach() if s.param.grad is not None else torch.zeros_like(s.param)
                for s in slots
            ]
            chunks = [s.chunk for s in slots]
            blocks = padded_blocks(grads, chunks, group.size)
            # With the mesh's reduce_dtype the sum stays wide: it feeds the fp32 masters.
            blocks = blocks.to(comm.accumulation_dtype(blocks, group))
            mine = comm.reduce_scatter(blocks, group, 0) if group.size > 1 else blocks
            for s, piece in zip(slots, mine.split(chunks)):
                s.shard.grad = (
                    piece.to(self.master_dtype) / dp if s.param.grad is not None else None
                )
        self._reduced = True

    def _norm_weights(self) -> None:
        """Per-shard weights making every distinct element count once in the norm (as
        :func:`neuron_tp.optim.grads.global_grad_norm`): 1/tp for tp-replicated parameters, 1/copies
        on rows held by several tp ranks; padding counts zero (its gradient is zero anyway)."""
        if self._norm_weights_ready:
            return
        for s in self.slots.values():
            if self.model is None:
                factor = 1.0 / self.mesh.tp_size  # no records: replicated over tp
                rows = None
            else:
                factor, rows = norm_weights(self.model, s.name, self.mesh)
            if rows is not None:
                per_elem = rows.float().repeat_interleave(s.numel // rows.shape[0])
                w = chunk_of(per_elem.to(s.shard.device), s.chunk, s.group) * factor
                s.norm_weight = w
            else:
                s.norm_weight = factor
        self._norm_weights_ready = True

    def grad_norm(self, pp_sum: PPSum | None = None) -> torch.Tensor:
        """The L2 norm of the full (dp-mean) gradient as a device tensor, equal on every rank:
        the square sums of the shards summed over dp, then over tp (each element once), then
        over the pipeline stages (by ``pp_sum``: :data:`~neuron_tp.optim.grads.PPSum`)."""
        if not self._reduced:
            self.reduce_grads()
        self._norm_weights()
        graded = [(s, g) for s in self.slots.values() if (g := s.shard.grad) is not None]
        if not graded:
            return torch.zeros(())
        total = torch.zeros(1, dtype=torch.float32, device=graded[0][0].shard.device)
        experts = torch.zeros_like(total)  # expert parallelism: over edp, then ep
        for s, grad in graded:
            sq = (grad.detach().float().pow(2) * s.norm_weight).sum()
            if s.group is self.group:
                total = total + sq
            else:
                experts = experts + sq
        total = comm.all_reduce(total, self.group)
        if self.mesh.ep_size > 1:
            edp = self.mesh.group("edp")
            experts = comm.all_reduce(experts, edp) if edp.size > 1 else experts
            total = total + comm.all_reduce(experts, self.mesh.group("ep"))
        total = comm.all_reduce(total, self.mesh.tp)
        return sum_over_pp(total, self.mesh, pp_sum).reshape(()).sqrt()

    def clip_grad_norm_(self, max_norm: float, pp_sum: PPSum | None = None) -> torch.Tensor:
        """Scale the shard gradients so the global norm is at most ``max_norm`` (same formula as
        :func:`neuron_tp.clip_grad_norm_`); returns the norm before clipping, no host read."""
        norm = self.grad_norm(pp_sum)
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for s in self.slots.values():
            if s.shard.grad is not None:
                s.shard.grad.detach().mul_(coef.to(s.shard.grad.dtype))
        return norm

    @torch.no_grad()
    def step(self, ok: torch.Tensor | None = None) -> None:
        """Reduce-scatter the gradients (unless done), step the shards, all-gather them into
        the parameters. ``ok`` (a device bool): where false, the update is undone on the
        device (the non-finite guard's skip mode), without a host read."""
        if not self._reduced:
            self.reduce_grads()
        for s in self.slots.values():  # working copies follow the parameters
            if not s.keeps_master:
                s.shard.copy_(chunk_of(s.param.detach(), s.chunk, s.group))
        saved = []
        if ok is not None:
            for s in self.slots.values():
                if s.shard.grad is not None:
                    old = {
                        k: v.clone()
                        for k, v in self.inner.state.get(s.shard, {}).items()
                        if isinstance(v, torch.Tensor)
                    }
                    saved.append((s.shard, s.shard.clone(), old))
        self.inner.step()
        if ok is not None:  # (``saved`` is empty without ``ok``)
            for shard, old_shard, old in saved:
                shard.copy_(torch.where(ok.to(shard.device), shard, old_shard))
                for k, v in self.inner.state[shard].items():
                    if isinstance(v, torch.Tensor):
                        prev = old[k] if k in old else torch.zeros_like(v)
                        v.copy_(torch.where(ok.to(v.device), v, prev))
        self.gather_params()
        self._reduced = False

    @torch.no_grad()
    def gather_params(self) -> None:
        for bucket in self.buckets:
            slots = bucket.slots
            dtype, group = slots[0].param.dtype, slots[0].group
            mine = torch.cat([s.shard.to(dtype) for s in slots])
            full = comm.all_gather(mine, group, 0) if group.size > 1 else mine
            full = full.view(group.size, -1)
            for s, block in zip(slots, full.split([s.chunk for s in slots], 1)):
                s.param.detach().copy_(block.reshape(-1)[: s.numel].view(s.param.shape))

    # -- checkpoints (the formats and the work: neuron_tp.optim.zero1_state) -------------------
    def _groups_meta(self) -> list[dict]:
        return zero1_state.groups_meta(self)

    def state_dict(self) -> dict:
        """This rank's shards and their layout (:func:`neuron_tp.optim.zero1_state.state_dict`)."""
        return zero1_state.state_dict(self)

    def load_state_dict(self, state: dict) -> None:
        """Load a :meth:`state_dict` of the same dp rank and degree (then all-gather the
        parameters from the masters)."""
        zero1_state.load_state_dict(self, state)

    def full_state_dict(self) -> dict:
        """The state unsharded over dp, on every rank (an all-gather over dp)."""
        return zero1_state.full_state_dict(self)

    def load_full_state_dict(self, state: dict) -> None:
        """Take this rank's chunks of a full state made at any dp degree (no communication)."""
        zero1_state.load_full_state_dict(self, state)

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state: inner state tensors plus fp32 masters."""
        n = sum(
            v.numel() * v.element_size()
            for st in self.inner.state.values()
            for v in st.values()
            if isinstance(v, torch.Tensor)
        )
        return n + sum(
            s.shard.numel() * s.shard.element_size() for s in self.slots.values() if s.keeps_master
        )
