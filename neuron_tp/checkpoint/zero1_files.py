"""A ZeRO-1 optimizer state in a checkpoint: one file per (tp, dp) rank, joined over dp on read.
Under context parallelism the state is cut over dp x cp (:mod:`neuron_tp.optim.zero1`): "dp"
below is that group (``optim-tp<T>-dp<D>``, ``D`` the rank in it).

Every rank of a :class:`~neuron_tp.optim.zero1.Zero1` run writes its own shard
(:meth:`~neuron_tp.optim.zero1.Zero1.state_dict`: device-to-host copies of local tensors, no
collective) to ``optim-tp<T>-dp<D>.safetensors``: ``optim/<name>/<key>`` (AdamW's moments as
``(chunk,)`` pieces, its 0-dim ``step``) and ``optim/<name>/master`` (the fp32 master of a
parameter of another dtype). The file header records step, tp and dp rank and degree, and per
parameter ``[shape, numel, chunk, offset]`` of this rank's tp shard. The metadata says
``meta["optimizer"]["dp_shards"] = dp``.

On load at the same (tp, dp) layout a rank reads only its own file
(:meth:`DpShards.shard_state`); otherwise :meth:`DpShards.joined` joins a key over dp on the
host into the per-parameter tensor a plain checkpoint holds, and the tp logic of
:mod:`.reshard` takes it from there.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ..optim.zero1_state import SHARD_FORMAT, check_shard_state, is_sharded, join_chunks
from ..parallel.mesh import Mesh
from .format import CheckpointError, file_record, stage_part, verify, write_tensors


def optim_file(path: str, tp_rank: int, dp_rank: int, stage: int | None = None) -> str:
    """The ZeRO-1 file of rank (tp_rank, dp_rank) (of pipeline stage ``stage``; None: pp 1)."""
    name = "optim" + stage_part(stage) + f"-tp{tp_rank:05d}-dp{dp_rank:05d}.safetensors"
    return os.path.join(path, name)


def write_shard(tmp: str, optimizer, mesh: Mesh, step: int, skip: Collection[str] = ()) -> None:
    """Write this rank's ZeRO-1 shard (local tensors copied to the host) into ``tmp``, but for
    the parameters in ``skip`` (a pipeline stage's copies of another stage's)."""
    sd = optimizer.state_dict()
    tensors, layout = {}, {}
    stage = mesh.pp.rank if mesh.pp_size > 1 else None
    for name, e in sd["params"].items():
        if name in skip:
            continue
        layout[name] = [list(e["shape"]), e["numel"], e["chunk"], e["offset"]]
        master = [("master", e["master"])] if e["master"] is not None else []
        for key, v in [*e["state"].items(), *master]:
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = v.detach().cpu().contiguous()
    info: dict[str, Any] = {"step": int(step), "tp_rank": mesh.tp_rank, "tp": mesh.tp_size}
    info.update(dp_rank=sd["dp_rank"], dp=sd["dp_size"], ep=sd.get("ep", 1), zero1=layout)
    if stage is not None:
        info.update(pp_rank=stage, pp=mesh.pp_size)
    write_tensors(optim_file(tmp, mesh.tp_rank, sd["dp_rank"], stage), tensors, info)


def _param_of(key: str) -> str:
    return key[len("optim/") :].rsplit("/", 1)[0]


class DpShards:
    """Lazy, verifying readers of the per-(tp, dp) optimizer files of checkpoint ``path``;
    ``stage_of`` (a pipeline checkpoint): the stage whose files hold each parameter."""

    def __init__(
        self,
        path: str,
        tp: int,
        dp: int,
        step: int | None = None,
        stage_of: Mapping[str, int] | None = None,
    ):
        self.path, self.tp, self.dp, self.step = path, tp, dp, step
        self.stage_of = stage_of
        self.handles: dict[tuple[int | None, int, int], Any] = {}

    def stage(self, name: str) -> int | None:
        """The pipeline stage whose files hold parameter ``name`` (None: pp 1)."""
        return None if self.stage_of is None else self.stage_of.get(name, 0)

    def _open(self, tp_rank: int, dp_rank: int, stage: int | None):
        from safetensors import safe_open

        if (stage, tp_rank, dp_rank) not in self.handles:
            f = optim_file(self.path, tp_rank, dp_rank, stage)
            try:
                handle = safe_open(f, "pt")
                rec = file_record(f, handle.metadata())
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - missing/corrupt file: one clear message
                raise CheckpointError(f"{f}: unreadable optimizer shard ({e})") from None
            want: dict[str, Any] = {"tp_rank": tp_rank, "dp_rank": dp_rank, "dp": self.dp}
            if self.step is not None:
                want["step"] = self.step
            if stage is not None:
                want["pp_rank"] = stage
            if rec is None or any(rec.get(k) != v for k, v in want.items()) or "zero1" not in rec:
                got = {k: (rec or {}).get(k) for k in want}
                raise CheckpointError(
                    f"{f}: holds {got}, expected {want} (a file from another checkpoint?)"
                )
            self.handles[stage, tp_rank, dp_rank] = (handle, rec)
        return self.handles[stage, tp_rank, dp_rank]

    def _get(self, tp_rank: int, dp_rank: int, key: str) -> torch.Tensor:
        stage = self.stage(_param_of(key))
        handle, rec = self._open(tp_rank, dp_rank, stage)
        f = optim_file(self.path, tp_rank, dp_rank, stage)
        try:
            t = handle.get_tensor(key)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{f}: tensor {key!r} missing or unreadable ({e})") from None
        return verify(f, key, t, rec)

    def _layout(self, tp_rank: int, dp_rank: int, name: str) -> list:
        stage = self.stage(name)
        rec = self._open(tp_rank, dp_rank, stage)[1]
        if name not in rec["zero1"]:
            f = optim_file(self.path, tp_rank, dp_rank, stage)
            raise CheckpointError(f"{f}: no layout for parameter {name!r}")
        return rec["zero1"][name]

    def keys(self, tp_rank: int) -> set[str]:
        stages: list[int | None] = [None]
        if self.stage_of:
            stages = list(sorted(set(self.stage_of.values())))
        return {k for s in stages for k in self._open(tp_rank, 0, s)[0].keys()}

    def joined(self, tp_rank: int, key: str) -> torch.Tensor:
        """Tensor ``optim/<name>/<key>`` of tp rank ``tp_rank``, joined over dp (host)."""
        name = _param_of(key)
        shape, numel, chunk, _ = self._layout(tp_rank, 0, name)
        first = self._get(tp_rank, 0, key)
        if not (key.endswith("/master") or is_sharded(first, chunk)):
            return first  # the same on every dp rank (e.g. AdamW's step)
        pieces = [first]
        for r in range(1, self.dp):
            pieces.append(self._get(tp_rank, r, key))
        for r, t in enumerate(pieces):
            lay = self._layout(tp_rank, r, name)
            if lay != [shape, numel, chunk, r * chunk] or tuple(t.shape) != (chunk,):
                f = optim_file(self.path, tp_rank, r, self.stage(name))
                raise CheckpointError(
                    f"{f}: {key} is piece {lay} of shape "
                    f"{tuple(t.shape)}, expected {[shape, numel, chunk, r * chunk]} of ({chunk},)"
                )
        return join_chunks(pieces, numel, shape)

    def shard_state(
        self, tp_rank: int, dp_rank: int, names: Mapping[str, str] | None = None
    ) -> dict:
        """The :meth:`~neuron_tp.optim.zero1.Zero1.state_dict` (without hyperparameters) saved by
        rank (tp_rank, dp_rank): what it loads at the same layout. ``names`` (a pipeline
        stage's): ``{name in the optimizer: saved name}`` of the parameters to read, each from
        its stage's file."""
        ep = 1
        if names is None:
            rec = self._open(tp_rank, dp_rank, None)[1]
            names = {n: n for n in rec["zero1"]}
        params = {}
        for mine, saved in names.items():
            handle, rec = self._open(tp_rank, dp_rank, self.stage(saved))
            if saved not in rec["zero1"]:
                continue  # reported by the optimizer's check (a parameter it lacks)
            shape, numel, chunk, offset = rec["zero1"][saved]
            ep = rec.get("ep", 1)
            state, master = {}, None
            for key in sorted(k for k in handle.keys() if _param_of(k) == saved):
                t = self._get(tp_rank, dp_rank, key)
                if key.endswith("/master"):
                    master = t
                else:
                    state[key.rsplit("/", 1)[1]] = t
            entry = {"shape": tuple(shape), "numel": numel, "chunk": chunk, "offset": offset}
            params[mine] = {**entry, "state": state, "master": master}
        return {
            "format": SHARD_FORMAT,
            "dp_size": self.dp,
            "dp_rank": dp_rank,
            "ep": ep,
            "params": params,
        }


def stage_shard(
    optim_files: DpShards, optimizer, mesh: Mesh, path: str, names: Mapping[str, str] | None
) -> dict:
    """This rank's own shard state, checked against ``optimizer`` (modifies nothing);
    ``names``: see :meth:`DpShards.shard_state`."""
    state = optim_files.shard_state(mesh.tp_rank, optimizer.group.rank, names)
    try:
        check_shard_state(optimizer, state)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: the optimizer state does not fit ({e})") from None
    return state
