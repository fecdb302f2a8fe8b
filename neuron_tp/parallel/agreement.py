"""Ranks that must agree: compare what every rank was started with, in one small exchange.

A job whose ranks got different options, models, data or weights either hangs (the ranks build
different graphs) or trains silently wrong. :func:`check_agreement` hashes each value per key,
exchanges one fixed-size ``int32`` vector per rank through the job's host-side store (no
device graph: :func:`neuron_tp.parallel.host.all_gather`) and
raises :class:`RankMismatchError` on EVERY rank, naming the keys and which ranks hold which
value. A rank that failed locally while computing its values passes ``error=``: every rank then
raises (the failing one its own error, the others a :class:`RankMismatchError` quoting it, as
learned from :func:`neuron_tp.parallel.failures.gather_failures`), so nobody is left waiting in
the next collective.
Further exchanges happen only on a mismatch, and all ranks decide on them from the same data.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import sys
import zlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import UserError, set_reporter
from . import host
from .failures import gather_failures
from .mesh import Group, get_mesh, init_mesh, set_default_mesh

__all__ = [
    "Agreed",
    "agreed",
    "RankMismatchError",
    "check_agreement",
    "fingerprint",
    "tensor_checksum",
    "world_group",
    "exchange_device",
]

SLOTS = 128  # fixed width of the exchanged vector: same on every rank, whatever its keys
TEXT = 200  # bytes of a value shown per rank in the error
SHOWN = 4  # differing sub-keys named per key


class RankMismatchError(UserError):
    """Ranks of one job hold different options, models, data or weights (or one failed)."""


def _canonical(value: Any) -> Any:
    """JSON-able and the same on every rank: dicts as sorted pairs, other objects by repr
    without memory addresses."""
    if isinstance(value, dict):
        return sorted(([str(k), _canonical(v)] for k, v in value.items()), key=lambda kv: kv[0])
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(value))


def fingerprint(value: Any) -> int:
    """A 31-bit hash of ``value`` (see :func:`_canonical`)."""
    text = json.dumps(_canonical(value))
    return (
        int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")
        & 0x7FFFFFFF
    )


def tensor_checksum(t: torch.Tensor) -> int | str:
    """CRC32 of a tensor's bytes, dtype and shape (``"meta"`` for a meta tensor)."""
    if t.device.type == "meta":
        return "meta"
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data.data, zlib.crc32(f"{t.dtype}{tuple(t.shape)}".encode()))


def exchange_device(group: Group) -> torch.device | None:
    """Where ``group`` can exchange tensors: the CPU (gloo), the GPU (NCCL), the XLA device
    (the ``xla`` backend, one NeuronCore or CPU device per rank); None when it cannot execute
    (a trace-only mesh, a single rank, or a mesh built without process groups)."""
    if group.virtual or group.size == 1:
        return None
    if group.process_group is not None:
        import torch.distributed as dist

        if dist.get_backend(group.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if "torch_xla" in sys.modules:  # the xla backend: XLA collectives between devices
        import torch.distributed as dist
        import torch_xla

        xla_pg = dist.is_available() and dist.is_initialized() and dist.get_backend() == "xla"
        if xla_pg or torch_xla._XLAC._xla_runtime_is_initialized():  # never start it here
            import torch_xla.runtime as xr

            if xr.world_size() >= group.size:
                from ..backend import xla as _xla

                return _xla.device()
    return None


def world_group() -> Group:
    """The whole job as one group (creating the process group from torchrun's environment if
    needed) without creating any sub-group: usable before the ranks agree on ``tp``."""
    try:
        before = get_mesh()
    except RuntimeError:
        before = None
    try:
        return init_mesh(tp=1).group("world")
    finally:
        set_default_mesh(before)


def _gather(rows: torch.Tensor, group: Group, device: torch.device) -> torch.Tensor:
    """``[group.size, n]`` int64 on the CPU: every rank's ``rows`` (``[n]`` int32).

    Exchanged through the job's host-side store (:func:`neuron_tp.parallel.host.all_gather`),
    not a device collective: no extra graph to compile on Neuron, and ranks that reach the check
    seconds apart (one still loading weights) cannot trip XLA's collective timeouts."""
    payloads = host.all_gather("agreement", rows.to(torch.int32).numpy().tobytes(), group)
    return torch.stack([torch.frombuffer(bytearray(p), dtype=torch.int32) for p in payloads]).long()


def _encode(texts: Sequence[str], width: int = TEXT) -> torch.Tensor:
    out = torch.zeros(len(texts) * width, dtype=torch.int32)
    for i, t in enumerate(texts):
        raw = t.encode("utf-8", "replace")[:width]
        out[i * width : i * width + len(raw)] = torch.tensor(list(raw), dtype=torch.int32)
    return out


def _decode(row: torch.Tensor, i: int, width: int = TEXT) -> str:
    raw = bytes(int(b) for b in row[i * width : (i + 1) * width] if b)
    return raw.decode("utf-8", "replace")


def _show(value: Any) -> str:
    text = (
        value
        if isinstance(value, str)
        else json.dumps(
            value if not isinstance(value, dict) else dict(_canonical(value)), default=repr
        )
    )
    return text if len(text) <= 80 else text[:77] + "..."


def _ranks(rs: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    rs, parts, i = sorted(rs), [], 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    return ", ".join(parts)


def _splits(column: torch.Tensor, cells: Sequence[Sequence[int]]) -> list[list[list[int]]]:
    """For each cell (ranks that must agree) holding more than one value: the ranks per value."""
    out = []
    for cell in cells:
        by_value: dict[int, list[int]] = {}
        for r in cell:
            by_value.setdefault(int(column[r]), []).append(r)
        if len(by_value) > 1:
            out.append(list(by_value.values()))
    return out


def check_agreement(
    values: Mapping[str, Any],
    group: Group,
    *,
    scopes: Mapping[str, Sequence[Sequence[int]]] | None = None,
    details: Mapping[str, Mapping[str, Any]] | None = None,
    error: BaseException | None = None,
    what: str = "the job",
) -> None:
    """Raise :class:`RankMismatchError` on every rank of ``group`` unless all agree.

    ``values``: ``{key: JSON-able value}`` that must be equal. ``scopes[key]``: lists of
    group ranks that must agree among themselves (default: the whole group), e.g. the ranks
    holding the same shard. ``details[key]``: ``{sub-key: value}`` whose hashes are exchanged
    only when ``key`` differs, to name what inside it differs (e.g. which parameter).
    ``error``: this rank's local failure; every rank then raises. Collective over ``group``
    (nothing is exchanged when the group cannot communicate, e.g. one rank)."""
    scopes, details = dict(scopes or {}), dict(details or {})
    device = exchange_device(group)
    if device is None:
        if error is not None:
            raise error
        return
    keys, sub = sorted(values), sorted(details)
    if 2 + len(keys) + len(sub) > SLOTS:
        raise ValueError(
            f"check_agreement: {len(keys)} keys + {len(sub)} detail sets do not "
            f"fit in {SLOTS} slots"
        )
    vec = torch.zeros(SLOTS, dtype=torch.int32)
    vec[0] = 0 if error is None else 1
    vec[1] = fingerprint([keys, sub])
    for i, k in enumerate(keys):
        vec[2 + i] = fingerprint(values[k])
    for i, k in enumerate(sub):
        vec[2 + len(keys) + i] = fingerprint(sorted(details[k]))
    table = _gather(vec, group, device)
    everyone = [list(range(group.size))]
    failed = [r for r in range(group.size) if table[r, 0]]
    if failed:
        msg = None if error is None else f"{type(error).__name__}: {error}"
        texts = gather_failures(group, msg, device)
        first = failed[0]  # the lowest failing rank reports its own error, once
        if error is not None:
            raise set_reporter(error, first)
        raise set_reporter(
            RankMismatchError(
                f"{what}: rank {_ranks(failed)} failed before the ranks could agree, so this "
                f"rank stops too; rank {first}: {texts[first]}"
            ),
            first,
        )
    if _splits(table[:, 1], everyone):
        raise RankMismatchError(
            f"{what}: the ranks compare different sets of keys (different "
            f"neuron_tp versions?): {_splits(table[:, 1], everyone)}"
        )
    bad = {k: _splits(table[:, 2 + i], scopes.get(k, everyone)) for i, k in enumerate(keys)}
    bad = {k: s for k, s in bad.items() if s}
    if not bad:
        return
    # Sub-keys of the differing keys whose sub-key lists agree everywhere: which ones differ.
    named: dict[str, list[tuple[str, list[list[list[int]]]]]] = {}
    for j, k in enumerate(sub):
        if k in bad and not _splits(table[:, 2 + len(keys) + j], everyone):
            names = sorted(details[k])
            col = _gather(
                torch.tensor([fingerprint(details[k][n]) for n in names], dtype=torch.int32),
                group,
                device,
            )
            cells = scopes.get(k, everyone)
            named[k] = [(n, s) for c, n in enumerate(names) if (s := _splits(col[:, c], cells))]
    shown = [(k, None) for k in bad if k not in details] + [
        (k, n) for k in named for n, _ in named[k][:SHOWN]
    ]
    shown_rows = _gather(
        _encode([_show(values[k] if n is None else details[k][n]) for k, n in shown]), group, device
    )
    at = {kn: i for i, kn in enumerate(shown)}

    def held(groups: list[list[int]], i: int | None) -> str:
        if i is None:
            return " vs ".join(f"rank {_ranks(g)}" for g in groups)
        return "; ".join(f"rank {_ranks(g)}: {_decode(shown_rows[g[0]], i)}" for g in groups)

    lines = []
    for k, splits in bad.items():
        lines += [f"  {k}: {held(g, at.get((k, None)))}" for g in splits[:2]]
        for n, s in named.get(k, [])[:SHOWN]:
            lines += [f"      {n}: {held(g, at[(k, n)])}" for g in s[:2]]
        if len(named.get(k, [])) > SHOWN:
            lines.append(f"      ... and {len(named[k]) - SHOWN} more")
    raise RankMismatchError(
        f"{what}: the ranks disagree (every rank must be started with the same options, model, "
        "data and weights; e.g. a per-node environment file that differs):\n" + "\n".join(lines)
    )


def versions() -> dict[str, str | None]:
    """Versions of the libraries that shape the graph and the math."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "torch-xla", "neuron_tp"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def config_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The model's config as a dict (without the path it was read from)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return {}
    return {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}


def check_same_model(
    model: torch.nn.Module, group: Group, options: Mapping[str, Any], what: str
) -> None:
    """Every rank of ``group`` holds the same full model: class, config, parameter names,
    shapes, dtypes and weights (checksums; meta-device parameters count as ``"meta"``) and
    the same ``options``. Collective over ``group``."""
    if exchange_device(group) is None:
        return
    params = dict(model.named_parameters())
    shapes = {n: [list(p.shape), str(p.dtype)] for n, p in params.items()}
    sums = {n: tensor_checksum(p) for n, p in params.items()}
    config = config_dict(model)
    w = "weights (checksum per parameter)"
    values = {
        "model class": type(model).__name__,
        "model config": config,
        "parameter names, shapes and dtypes": shapes,
        w: sums,
        "options": dict(options),
        "library versions": versions(),
    }
    details = {
        "model config": config,
        "parameter names, shapes and dtypes": shapes,
        w: sums,
        "options": dict(options),
    }
    check_agreement(values, group, details=details, what=what)


def check_model_replicas(
    model: torch.nn.Module, mesh, error: BaseException | None = None, what: str = "the job"
) -> None:
    """After sharding: every rank's shard equals the shard of the ranks with the same tp rank
    (its data-parallel replicas; for experts spread over ``ep``, the ranks holding the same
    experts), and replicated parameters are equal on every rank (of the same pipeline stage:
    stages hold different layers).
    ``error``: this rank's local failure (every rank raises). Collective over the world."""
    from .sharding import expert_split, named_parameter_meta

    world = mesh.group("world")
    shards: dict[str, Any] = {}
    sharded: dict[str, Any] = {}
    experts: dict[str, Any] = {}
    replicated: dict[str, Any] = {}
    if error is None:
        for name, p, meta in named_parameter_meta(model):
            if meta.sharding is None:
                replicated[name] = tensor_checksum(p)
            else:
                shards[name] = [list(p.shape), str(p.dtype)]
                held = experts if expert_split(meta.sharding) is not None else sharded
                held[name] = tensor_checksum(p)
    replicas = [list(g) for g in mesh.dp.all_groups]  # the ranks holding the same shards
    stages = [list(ranks) for ranks in zip(*mesh.pp.all_groups)]  # the ranks of each stage
    copies = [list(g) for g in mesh.group("edp").all_groups] if mesh.ep_size > 1 else replicas
    keys = (
        "parameter shards (names, shapes, dtypes)",
        "weights of the shards (checksums)",
        "weights of replicated parameters (checksums)",
        "weights of the experts (checksums)",
    )
    values = dict(zip(keys, (shards, sharded, replicated, experts)))
    check_agreement(
        values,
        world,
        error=error,
        what=what,
        details=values,
        scopes={keys[0]: replicas, keys[1]: replicas, keys[2]: stages, keys[3]: copies},
    )


@dataclass
class Agreed:
    """What the ranks must hold alike, filled inside :func:`agreed` (see
    :func:`check_agreement` for ``values`` and ``details``)."""

    values: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)


@contextlib.contextmanager
def agreed(group: Group, what: str) -> Iterator[Agreed]:
    """Run the block's local work on every rank of ``group``, then :func:`check_agreement`
    on what it put in the yielded :class:`Agreed`: an exception in the block on any rank
    makes every rank raise (this rank its own exception), and ranks that differ raise
    :class:`RankMismatchError` on every rank. Collective over ``group``: no rank is left
    waiting for one that failed."""
    box, error = Agreed(), None
    try:
        yield box
    except Exception as e:  # noqa: BLE001 - re-raised on this rank by check_agreement
        error = e
    check_agreement(box.values, group, details=box.details, error=error, what=what)
    if error is not None:
        raise error
