"""The planner's traces, shared by every plan of a process and, when asked, kept in a file.

A trace depends on the model config, the :class:`~.trace.Spec` and the code that traces it
(this package, torch, torch-xla, transformers), never on the job around it: rows of a table
at the same traced shapes (1 and 4 nodes; ``s`` at cp 1 and ``4 s`` at cp 4) trace once. The
config's ``max_position_embeddings`` is left out of the key when its rope is the default one
(positions then only index the rotary table: the traced graph is the same). A file written by
:func:`save` is read back by :func:`load` only by the same code (a fingerprint of the sources
and versions): a table computed in pieces, by several processes, traces every shape once.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from importlib import metadata

from .trace import Spec, Trace, from_json, to_json, trace_in_subprocess

_CACHE: dict[tuple[str, Spec], Trace | str] = {}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config_key(config) -> str:
    """The part of ``config`` a trace depends on, as text."""
    d = config.to_dict()
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) == "default":
        d.pop("max_position_embeddings", None)
    return json.dumps(d, sort_keys=True, default=str)


def fingerprint() -> str:
    """A hash of neuron_tp's sources and the versions of the libraries a trace runs on."""
    h = hashlib.sha256()
    for lib in ("torch", "torch-xla", "transformers"):
        try:
            h.update(f"{lib}={metadata.version(lib)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{lib}=none;".encode())
    for root, dirs, files in os.walk(_PACKAGE):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, _PACKAGE).encode())
            with open(path, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def traces(config, specs: list[Spec]) -> list[Trace | str]:
    """The traces of ``specs``: those not traced yet in child processes (up to 4 in
    parallel), the rest from this process's cache."""
    name = config_key(config)
    todo = list(dict.fromkeys(s for s in specs if (name, s) not in _CACHE))
    workers = max(1, min(4, (os.cpu_count() or 1), len(todo)))
    chunks = [todo[i::workers] for i in range(workers)]
    if todo:
        with ThreadPoolExecutor(workers) as pool:
            results = list(pool.map(lambda c: trace_in_subprocess(config, c), chunks))
        for chunk, res in zip(chunks, results):
            _CACHE.update({(name, s): r for s, r in zip(chunk, res)})
    return [_CACHE[(name, s)] for s in specs]


def save(path: str) -> int:
    """Write this process's traces to ``path`` (with the code's fingerprint); how many."""
    rows = [[name, asdict(spec), to_json(t)] for (name, spec), t in _CACHE.items()]
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"fingerprint": fingerprint(), "traces": rows}, f)
    os.replace(tmp, path)
    return len(rows)


def load(path: str) -> int:
    """Add the traces of ``path`` (written by :func:`save`) to this process's cache; how
    many (0: no file, or one written by other code)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        data = json.load(f)
    if data.get("fingerprint") != fingerprint():
        return 0
    for name, spec, t in data["traces"]:
        _CACHE[(name, Spec(**spec))] = from_json(t)
    return len(data["traces"])


def clear() -> None:
    """Forget this process's traces (the next plans trace again)."""
    _CACHE.clear()
