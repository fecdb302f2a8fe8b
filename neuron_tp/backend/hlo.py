"""Read collectives out of traced XLA HLO: which kind, over which replica groups, how many bytes.

Used with :meth:`neuron_tp.Mesh.virtual` to see what one rank of a large job communicates,
on a single CPU, without running the job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from math import prod

import torch

_BYTES = {
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "f64": 8,
    "s64": 8,
    "s32": 4,
    "u32": 4,
    "pred": 1,
    "s8": 1,
    "u8": 1,
}
_OP = re.compile(
    r"=\s*(?P<out>\(.*?\)|\S+)\s+(?P<kind>all-reduce|all-gather|reduce-scatter|"
    r"all-to-all)\((?P<args>[^)]*)\)(?P<attrs>.*)$"
)
_SHAPE = re.compile(r"(?P<dt>[a-z]+\d*)\[(?P<dims>[\d,]*)\]")
_GROUPS = re.compile(r"replica_groups=\{(?P<g>(\{[\d,]*\},?)*)\}")
_CHANNEL = re.compile(r"channel_id=(\d+)")


@dataclass(frozen=True)
class Collective:
    """One collective op of a traced graph, from this rank's point of view."""

    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all
    dtype: str
    shape: tuple[int, ...]  # the full buffer: all-gather output, reduce-scatter/all-reduce input
    replica_groups: tuple[tuple[int, ...], ...]
    channel_id: int | None = None  # set in the form XLA:CPU devices execute (comm module doc)
    global_device_ids: bool = False  # use_global_device_ids=true

    @property
    def group_size(self) -> int:
        return len(self.replica_groups[0]) if self.replica_groups else 1

    @property
    def buffer_bytes(self) -> int:
        return prod(self.shape) * _BYTES[self.dtype]

    @property
    def ring_bytes(self) -> float:
        """Bytes each rank sends with a ring algorithm (all-reduce = reduce-scatter +
        all-gather)."""
        p = self.group_size
        factor = 2 * (p - 1) / p if self.kind == "all-reduce" else (p - 1) / p
        return factor * self.buffer_bytes


def _shapes(text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [
        (m["dt"], tuple(int(d) for d in m["dims"].split(",") if d)) for m in _SHAPE.finditer(text)
    ]


def parse_collectives(hlo: str) -> list[Collective]:
    """Every collective in an HLO module's text, in program order."""
    found = []
    for line in hlo.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        kind = m["kind"]
        outs, args = _shapes(m["out"]), _shapes(m["args"])
        if kind == "all-reduce":
            data = args[:-1] if len(args) > 1 else args  # torch-xla appends an f32[] token
        elif kind == "all-gather":
            data = outs
        else:
            data = args
        g = _GROUPS.search(m["attrs"])
        groups = (
            tuple(
                tuple(int(r) for r in grp.strip("{}").split(",") if r)
                for grp in re.findall(r"\{[\d,]*\}", g["g"])
            )
            if g
            else ()
        )
        channel = _CHANNEL.search(m["attrs"])
        global_ids = "use_global_device_ids=true" in m["attrs"]
        for dt, shape in data:
            found.append(
                Collective(
                    kind, dt, shape, groups, int(channel[1]) if channel else None, global_ids
                )
            )
    return found


_PARAM = re.compile(r"=\s*(?P<dt>[a-z]+\d*)\[(?P<dims>[\d,]*)\]\S*\s+parameter\(\d+\)")


def entry_parameters(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every parameter of the graph's ENTRY computation: what the executable
    reads from device memory each run (weights, caches, inputs)."""
    start = hlo.find("\nENTRY ")
    if start < 0:
        raise ValueError("no ENTRY computation in this HLO text")
    end = hlo.find("\n}", start)
    body = hlo[start : end if end > 0 else len(hlo)]
    return [
        (m["dt"], tuple(int(d) for d in m["dims"].split(",") if d)) for m in _PARAM.finditer(body)
    ]


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of an HLO array of ``dtype`` (e.g. ``bf16``, ``s8``) and ``shape``."""
    return prod(shape) * _BYTES[dtype]


def trace_hlo(tensors: list[torch.Tensor]) -> str:
    """HLO text of the pending XLA graph that produces ``tensors`` (nothing is executed)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_tensors_hlo(list(tensors))


def collectives_in_fresh_process(code: str, timeout: float = 300) -> list[Collective]:
    """Run ``code`` in a new Python process on the XLA CPU device and parse the HLO it prints.

    ``code`` must ``print(neuron_tp.backend.hlo.trace_hlo([...]))``. A fresh process is needed
    because torch-xla threads an ordering token through collectives until the next ``mark_step``: a
    second trace in the same process would contain the first one's collectives, and a graph
    traced on a virtual mesh cannot be executed to clear them.
    """
    import os
    import subprocess
    import sys

    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout
    )
    if out.returncode:
        raise RuntimeError(f"trace failed:\n{out.stderr[-3000:]}")
    return parse_collectives(out.stdout)
