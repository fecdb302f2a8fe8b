"""Checkpoint states of a :class:`~neuron_tp.optim.zero1.Zero1` (its ``state_dict`` & co. delegate
here).

Two formats, both per parameter (named like the model's parameters) and holding THIS rank's tp
shard (tp-sharded parameters keep their tp layout; :mod:`neuron_tp.parallel.sharding` records say
how):

- shard state (:func:`state_dict`): this dp rank's chunks (inner optimizer state, fp32 masters)
  plus the layout (dp size and rank; per parameter shape, numel, chunk, offset). No
  communication; :func:`load_state_dict` takes it back at the same dp degree.
- full state (:func:`full_state_dict`, an all-gather over dp; or :func:`gather_full_state`,
  offline from every dp rank's shard state): unsharded over dp; :func:`load_full_state_dict`
  takes this rank's chunks at any dp degree.

A state value is dp-sharded when it is a tensor of at least one dim whose first dim is the
parameter's ``chunk`` (AdamW's moments, the master); others (AdamW's 0-dim ``step``) are the
same on every dp rank.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..backend.xla import set_in_place
from ..parallel import comm
from .zero1_layout import Sharded, Slot, chunk_of

__all__ = [
    "SHARD_FORMAT",
    "FULL_FORMAT",
    "state_dict",
    "load_state_dict",
    "full_state_dict",
    "load_full_state_dict",
    "gather_full_state",
    "join_chunks",
    "is_sharded",
]

SHARD_FORMAT = "neuron_tp.optim.zero1.shard/1"
FULL_FORMAT = "neuron_tp.optim.zero1.full/1"


def is_sharded(v, chunk: int) -> bool:
    """Whether state value ``v`` of a parameter cut in ``chunk``-element pieces is dp-sharded."""
    return isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == chunk


def join_chunks(pieces: list[torch.Tensor], numel: int, shape) -> torch.Tensor:
    """The full tensor of ``shape`` from its dp chunks in dp-rank order (on the host)."""
    return torch.cat([p.detach().cpu().reshape(-1) for p in pieces])[:numel].view(tuple(shape))


def _snapshot(v):
    """A copy of a replicated state value (the live one, e.g. AdamW's step, changes in place)."""
    return v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def groups_meta(zero: Sharded) -> list[dict]:
    """The inner optimizer's param groups with parameter names instead of shards."""
    by_shard = {id(s.shard): s.name for s in zero.slots.values()}
    out = []
    for g in zero.inner.param_groups:
        opts = {k: v for k, v in g.items() if k != "params"}
        opts["params"] = [by_shard[id(p)] for p in g["params"]]
        out.append(opts)
    return out


def state_dict(zero: Sharded) -> dict:
    """This rank's shards (inner state, fp32 masters) and the layout needed to assemble the
    full state (:func:`gather_full_state`). Like ``torch.optim``, the tensors are the live ones:
    save (or copy) before the next step."""
    params = {}
    for s in zero.slots.values():
        params[s.name] = {
            "shape": tuple(s.param.shape),
            "numel": s.numel,
            "chunk": s.chunk,
            "offset": s.group.rank * s.chunk,
            "state": dict(zero.inner.state.get(s.shard, {})),
            "master": s.shard if s.keeps_master else None,
        }
    return {
        "format": SHARD_FORMAT,
        "dp_size": zero.group.size,
        "dp_rank": zero.group.rank,
        "ep": _ep(zero),
        "params": params,
        "param_groups": groups_meta(zero),
    }


def _ep(zero: Sharded) -> int:
    mesh = getattr(zero, "mesh", None)
    return mesh.ep_size if mesh is not None else 1


def check_shard_state(zero: Sharded, state: dict) -> None:
    """ValueError unless ``state`` is a shard state of this dp rank, degree and layout (every
    parameter present, same shape and chunk). Modifies nothing."""
    if state.get("format") != SHARD_FORMAT:
        raise ValueError(f"not a Zero1 shard state (format {state.get('format')!r})")
    if state.get("ep", 1) != _ep(zero):
        raise ValueError(
            f"state of an ep={state.get('ep', 1)} run, this one has ep={_ep(zero)}: the "
            "experts' ZeRO-1 chunks are cut over other ranks"
        )
    if (state["dp_size"], state["dp_rank"]) != (zero.group.size, zero.group.rank):
        raise ValueError(
            f"state of dp rank {state['dp_rank']} of {state['dp_size']}, this is dp rank "
            f"{zero.group.rank} of {zero.group.size}: use gather_full_state + "
            "load_full_state_dict to change the dp degree"
        )
    missing = set(zero.slots) - set(state["params"])
    if missing:
        raise KeyError(f"shard optimizer state lacks parameters {sorted(missing)[:5]}")
    for name, entry in state["params"].items():
        s = _slot(zero, name, entry["shape"])
        if entry["chunk"] != s.chunk or entry["offset"] != s.group.rank * s.chunk:
            raise ValueError(
                f"{name}: saved chunk {entry['chunk']} at offset {entry['offset']}, this rank "
                f"holds chunk {s.chunk} at offset {s.group.rank * s.chunk}"
            )


@torch.no_grad()
def load_state_dict(zero: Sharded, state: dict, gather: bool = True) -> None:
    """Load a :func:`state_dict` saved by the same dp rank at the same dp degree (other
    degrees: :func:`gather_full_state` then :func:`load_full_state_dict`). ``gather``: set the
    parameters from the masters (an all-gather over dp; skip it when the parameters are
    loaded already). Hyperparameters are loaded when the state has ``param_groups``."""

    check_shard_state(zero, state)
    for name, entry in state["params"].items():
        s = zero.slots[name]
        _set_state(s, zero.inner, entry["state"])
        if entry["master"] is not None and s.keeps_master:
            s.shard.copy_(entry["master"].to(s.shard.device))
        elif s.keeps_master:  # saved without a master (fp32 params): from the parameter
            s.shard.copy_(chunk_of(s.param.detach(), s.chunk, s.group))
    if state.get("param_groups") is not None:
        _load_hyper(zero, state["param_groups"])
    if gather:
        zero.gather_params()


@torch.no_grad()
def full_state_dict(zero: Sharded) -> dict:
    """The unsharded (over dp) state, per parameter, on every rank: collective over dp (an
    expert's over edp: its value holds this rank's experts, the parameter's shape)."""
    params = {}
    for s in zero.slots.values():
        entry: dict[str, Any] = {"shape": tuple(s.param.shape), "state": {}, "master": None}
        for k, v in zero.inner.state.get(s.shard, {}).items():
            entry["state"][k] = _gather(zero, v, s) if is_sharded(v, s.chunk) else _snapshot(v)
        if s.keeps_master:
            entry["master"] = _gather(zero, s.shard, s)
        params[s.name] = entry
    return {"format": FULL_FORMAT, "params": params, "param_groups": groups_meta(zero)}


def _gather(zero: Sharded, v: torch.Tensor, s: Slot) -> torch.Tensor:
    full = comm.all_gather(v.detach().contiguous(), s.group, 0)
    return full[: s.numel].view(s.param.shape)


@torch.no_grad()
def load_full_state_dict(zero: Sharded, state: dict) -> None:
    """Take this rank's chunks of a :func:`full_state_dict` (made at any dp degree, same tp
    layout). A saved fp32 master also sets the parameters (to it, cast). No communication."""

    if state.get("format") != FULL_FORMAT:
        raise ValueError(f"not a Zero1 full state (format {state.get('format')!r})")
    missing = set(zero.slots) - set(state["params"])
    if missing:
        raise KeyError(f"full optimizer state lacks parameters {sorted(missing)}")
    for name, entry in state["params"].items():
        s = _slot(zero, name, entry["shape"])
        dev = s.shard.device
        shard_state = {}
        for k, v in entry["state"].items():
            if isinstance(v, torch.Tensor) and tuple(v.shape) == tuple(s.param.shape) and v.dim():
                v = chunk_of(v.to(dev), s.chunk, s.group).clone()
            shard_state[k] = v
        _set_state(s, zero.inner, shard_state)
        master = entry.get("master")
        if master is not None:
            master = master.to(dev)
            s.param.detach().copy_(master.to(s.param.dtype))
            if s.keeps_master:
                s.shard.copy_(chunk_of(master, s.chunk, s.group))
        elif s.keeps_master:  # saved without a master (fp32 params): from the parameter
            s.shard.copy_(chunk_of(s.param.detach(), s.chunk, s.group))
    _load_hyper(zero, state["param_groups"])


def _slot(zero: Sharded, name: str, shape) -> Slot:
    if name not in zero.slots:
        raise KeyError(f"optimizer state for unknown parameter {name!r}")
    s = zero.slots[name]
    if tuple(shape) != tuple(s.param.shape):
        raise ValueError(f"{name}: saved shape {tuple(shape)}, parameter {tuple(s.param.shape)}")
    return s


def _set_state(s: Slot, inner: torch.optim.Optimizer, st: dict) -> None:
    out = {}
    for k, v in st.items():
        if isinstance(v, torch.Tensor):
            keep = v.dtype if (k == "step" or not v.is_floating_point()) else s.shard.dtype
            v = v.detach().to(device=s.shard.device, dtype=keep).clone()
        out[k] = v
    if out:
        inner.state[s.shard] = out
    else:
        inner.state.pop(s.shard, None)


def _load_hyper(zero: Sharded, saved: list[dict]) -> None:
    """Hyperparameters of the saved groups (tensor values, e.g. a device lr, in place)."""
    groups = zero.inner.param_groups
    if len(saved) != len(groups):
        raise ValueError(f"{len(saved)} saved param groups, the optimizer has {len(groups)}")
    for g, sg in zip(groups, saved):
        for k, v in sg.items():
            if k == "params":
                continue
            if isinstance(g.get(k), torch.Tensor):
                set_in_place(g[k], v)
            else:
                g[k] = v


def gather_full_state(shards: list[dict]) -> dict:
    """The full state (:func:`full_state_dict` format) from every dp rank's :func:`state_dict`
    (any order; e.g. loaded from per-rank files), on the host, without a mesh."""
    if not shards or any(s.get("format") != SHARD_FORMAT for s in shards):
        raise ValueError("gather_full_state needs Zero1 shard states")
    if any(s.get("ep", 1) != 1 for s in shards):
        raise ValueError(
            "gather_full_state: states of an expert-parallel run (ep > 1) are cut over edp "
            "per expert block; they load at the same dp and ep only (load_state_dict)"
        )
    dp = shards[0]["dp_size"]
    by_rank = {s["dp_rank"]: s for s in shards}
    if sorted(by_rank) != list(range(dp)) or any(s["dp_size"] != dp for s in shards):
        raise ValueError(f"need the states of dp ranks 0..{dp - 1}, got {sorted(by_rank)}")
    ordered = [by_rank[r] for r in range(dp)]
    params = {}
    for name, first in ordered[0]["params"].items():
        entries = [o["params"][name] for o in ordered]
        shape, numel, chunk = first["shape"], first["numel"], first["chunk"]
        if [e["offset"] for e in entries] != [r * chunk for r in range(dp)]:
            raise ValueError(f"{name}: inconsistent shard offsets")
        st = {
            k: join_chunks([e["state"][k] for e in entries], numel, shape)
            if is_sharded(v, chunk)
            else v
            for k, v in first["state"].items()
        }
        master = first["master"]
        if master is not None:
            master = join_chunks([e["master"] for e in entries], numel, shape)
        params[name] = {"shape": tuple(shape), "state": st, "master": master}
    return {"format": FULL_FORMAT, "params": params, "param_groups": ordered[0]["param_groups"]}
