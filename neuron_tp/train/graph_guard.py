"""Every rank must run the same step graph: compare fingerprints before the first one runs.

On Neuron, ranks that trace different graphs (a rank-dependent Python branch, an option set on
one node only) do not fail: their collectives never meet and the job hangs until the runtime
gives up ("Timeout waiting for RX"). Before the first step executes, each rank fingerprints the
HLO of its pending step graph (op kinds and shapes; names and source metadata left out), and the
ranks compare digests through the job's host-side store (no device collective: those would join
the pending graph). A mismatch raises on every rank, naming the ranks that differ and the first
op where they part.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib

import torch

from ..parallel import host
from ..parallel.mesh import Group

_NAME = re.compile(r"%[\w.\-]+")
_META = re.compile(r",?\s*(metadata|frontend_attributes|sharding)=\{[^}]*\}")


class GraphMismatchError(RuntimeError):
    """Ranks traced different step graphs (they would hang in their first collective)."""


def graph_ops(tensors: list[torch.Tensor]) -> list[str]:
    """The pending XLA graph computing ``tensors`` as a list of rank-comparable op lines."""
    import torch_xla

    hlo = torch_xla._XLAC._get_xla_tensors_hlo(tensors)
    ops = []
    for line in hlo.splitlines():
        line = line.strip()
        if "=" not in line or line.startswith(("HloModule", "//")):
            continue
        ops.append(_META.sub("", _NAME.sub("%", line)))
    return ops


def _first_difference(a: list[str], b: list[str]) -> str:
    """The first differing computation (inputs and the signature are listed in order of first
    use, so the op that uses a different input tells more than the input itself)."""

    def body(ops):
        return [op for op in ops if " parameter(" not in op and not op.startswith("ENTRY")]

    a, b = body(a), body(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"op {i}: {x[:160]!r} vs {y[:160]!r}"
    return f"one graph has {len(a)} ops, the other {len(b)}"


def check_same_graph(tensors: list[torch.Tensor], group: Group, what: str = "step") -> None:
    """Raise :class:`GraphMismatchError` on every rank of ``group`` unless all ranks' pending
    graphs for ``tensors`` are identical. Call before the graph executes (before mark_step)."""
    if group.size == 1 or group.virtual:  # nothing to compare / nothing will execute
        return
    ops = graph_ops(tensors)
    digest = hashlib.sha256("\n".join(ops).encode()).hexdigest()
    digests = [d.decode() for d in host.all_gather(f"graph/{what}", digest.encode(), group)]
    if len(set(digests)) == 1:
        return
    mine = zlib.compress(json.dumps(ops).encode())
    listings = [
        json.loads(zlib.decompress(p)) for p in host.all_gather(f"graph/{what}/ops", mine, group)
    ]
    classes: dict[str, list[int]] = {}
    for rank, d in zip(group.ranks, digests):
        classes.setdefault(d, []).append(rank)
    groups = sorted(classes.values())
    ref, other = groups[0], groups[1]
    diff = _first_difference(
        listings[group.ranks.index(ref[0])], listings[group.ranks.index(other[0])]
    )
    raise GraphMismatchError(
        f"ranks traced different {what} graphs and would hang in their first collective: "
        f"{' | '.join(f'ranks {g}' for g in groups)}; first difference (ranks {ref[0]} vs "
        f"{other[0]}) at {diff}. Every rank must run the same code with the same options "
        "(no rank-dependent Python values in the step)."
    )
