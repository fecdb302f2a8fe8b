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
from typing import Any

import torch

from ..optim.zero1_state import SHARD_FORMAT, check_shard_state, is_sharded, join_chunks
from ..parallel.mesh import Mesh
from .format import CheckpointError, file_record, verify, write_tensors


def optim_file(path: str, tp_rank: int, dp_rank: int) -> str:
    return os.path.join(path, f"optim-tp{tp_rank:05d}-dp{dp_rank:05d}.safetensors")


def write_shard(tmp: str, optimizer, mesh: Mesh, step: int) -> None:
    """Write this rank's ZeRO-1 shard (local tensors copied to the host) into ``tmp``."""
    sd = optimizer.state_dict()
    tensors, layout = {}, {}
    for name, e in sd["params"].items():
        layout[name] = [list(e["shape"]), e["numel"], e["chunk"], e["offset"]]
        master = [("master", e["master"])] if e["master"] is not None else []
        for key, v in [*e["state"].items(), *master]:
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{name}/{key}"] = v.detach().cpu().contiguous()
    info: dict[str, Any] = {"step": int(step), "tp_rank": mesh.tp_rank, "tp": mesh.tp_size}
    info.update(dp_rank=sd["dp_rank"], dp=sd["dp_size"], ep=sd.get("ep", 1), zero1=layout)
    write_tensors(optim_file(tmp, mesh.tp_rank, sd["dp_rank"]), tensors, info)


def _param_of(key: str) -> str:
    return key[len("optim/") :].rsplit("/", 1)[0]


class DpShards:
    """Lazy, verifying readers of the per-(tp, dp) optimizer files of checkpoint ``path``."""

    def __init__(self, path: str, tp: int, dp: int, step: int | None = None):
        self.path, self.tp, self.dp, self.step = path, tp, dp, step
        self.handles: dict[tuple[int, int], Any] = {}

    def _open(self, tp_rank: int, dp_rank: int):
        from safetensors import safe_open

        if (tp_rank, dp_rank) not in self.handles:
            f = optim_file(self.path, tp_rank, dp_rank)
            try:
                handle = safe_open(f, "pt")
                rec = file_record(f, handle.metadata())
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - missing/corrupt file: one clear message
                raise CheckpointError(f"{f}: unreadable optimizer shard ({e})") from None
            want = {"tp_rank": tp_rank, "dp_rank": dp_rank, "dp": self.dp}
            if self.step is not None:
                want["step"] = self.step
            if rec is None or any(rec.get(k) != v for k, v in want.items()) or "zero1" not in rec:
                got = {k: (rec or {}).get(k) for k in want}
                raise CheckpointError(
                    f"{f}: holds {got}, expected {want} (a file from another checkpoint?)"
                )
            self.handles[tp_rank, dp_rank] = (handle, rec)
        return self.handles[tp_rank, dp_rank]

    def _get(self, tp_rank: int, dp_rank: int, key: str) -> torch.Tensor:
        handle, rec = self._open(tp_rank, dp_rank)
        f = optim_file(self.path, tp_rank, dp_rank)
        try:
            t = handle.get_tensor(key)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{f}: tensor {key!r} missing or unreadable ({e})") from None
        return verify(f, key, t, rec)

    def _layout(self, tp_rank: int, dp_rank: int, name: str) -> list:
        rec = self._open(tp_rank, dp_rank)[1]
        if name not in rec["zero1"]:
            f = optim_file(self.path, tp_rank, dp_rank)
            raise CheckpointError(f"{f}: no layout for parameter {name!r}")
        return rec["zero1"][name]

    def keys(self, tp_rank: int) -> set[str]:
        return set(self._open(tp_rank, 0)[0].keys())

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
                raise CheckpointError(
                    f"{optim_file(self.path, tp_rank, r)}: {key} is piece {lay} of shape "
                    f"{tuple(t.shape)}, expected {[shape, numel, chunk, r * chunk]} of ({chunk},)"
                )
        return join_chunks(pieces, numel, shape)

    def shard_state(self, tp_rank: int, dp_rank: int) -> dict:
        """The :meth:`~neuron_tp.optim.zero1.Zero1.state_dict` (without hyperparameters) saved by
        rank (tp_rank, dp_rank): what it loads at the same layout."""
        handle, rec = self._open(tp_rank, dp_rank)
        by_name: dict[str, list[str]] = {}
        for key in sorted(handle.keys()):
            by_name.setdefault(_param_of(key), []).append(key)
        params = {}
        for name, (shape, numel, chunk, offset) in rec["zero1"].items():
            state, master = {}, None
            for key in by_name.get(name, []):
                t = self._get(tp_rank, dp_rank, key)
                if key.endswith("/master"):
                    master = t
                else:
                    state[key.rsplit("/", 1)[1]] = t
            entry = {"shape": tuple(shape), "numel": numel, "chunk": chunk, "offset": offset}
            params[name] = {**entry, "state": state, "master": master}
        return {
            "format": SHARD_FORMAT,
            "dp_size": self.dp,
            "dp_rank": dp_rank,
            "ep": rec.get("ep", 1),
            "params": params,
        }


def stage_shard(optim_files: DpShards, optimizer, mesh: Mesh, path: str) -> dict:
    """This rank's own shard state, checked against ``optimizer`` (modifies nothing)."""
    state = optim_files.shard_state(mesh.tp_rank, optimizer.group.rank)
    try:
        check_shard_state(optimizer, state)
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}: the optimizer state does not fit ({e})") from None
    return state
