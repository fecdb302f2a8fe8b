"""What every check of one rank needs: options, the mesh, the device, how to run a graph."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from ..backend import xla as _xla
from ..parallel.mesh import Group, Mesh
from .watchdog import Watchdog


@dataclass(frozen=True)
class Options:
    """The selftest's options (``neuron-tp selftest -h``)."""

    device: str = "xla"  # xla: NeuronCores / XLA CPU devices; cpu: gloo ranks
    tp: int = 0  # 0: the ranks of a node (several nodes), else half the world (>= 4 ranks)
    quick: bool = False
    timeout: float = 300.0
    instance: str = ""  # e.g. trn1.32xlarge: theoretical figures next to the measured ones
    checks: tuple[str, ...] = ()  # empty: all
    max_bytes: int = 0  # 0: 256 MiB on Neuron (4 MiB --quick), capped off Neuron
    calibrate: str = ""  # write measured figures to this JSON file
    json: bool = False
    xla_cpu_devices: int = 0


@dataclass
class Context:
    """One rank's view of the selftest."""

    options: Options
    mesh: Mesh
    device: torch.device
    watchdog: Watchdog
    ranks_per_node: int
    lock: threading.Lock = field(default_factory=threading.Lock)  # shared by the ranks of a
    # process (threads under --xla-cpu-devices): the global RNG, transformers' lazy imports
    facts: dict = field(default_factory=dict)  # this rank's environment (env check)
    measured: dict = field(default_factory=dict)  # what one check leaves for a later one

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world(self) -> int:
        return self.mesh.world_size

    @property
    def on_xla(self) -> bool:
        return self.device.type == "xla"

    @property
    def on_neuron(self) -> bool:
        return self.on_xla and not _xla.cpu_runtime()

    @property
    def stage_limit(self) -> float | None:
        """A bound for one collective alone: XLA:CPU aborts the whole process when a
        collective's devices arrive more than 10 s apart, so on XLA CPU devices the watchdog
        names a stuck collective at 8 s, before that abort (elsewhere: the check's timeout)."""
        if self.on_xla and not self.on_neuron:
            return min(8.0, self.options.timeout)
        return None

    def groups(self) -> list[Group]:
        """The groups the collectives are checked on: tp, dp and the whole world."""
        return [self.mesh.group(n) for n in ("tp", "dp", "world")]

    def sync(self) -> None:
        """Run the pending XLA graph and wait for it (nothing on gloo ranks)."""
        if self.on_xla:
            import torch_xla

            # wait=True waits for this device's graph only (wait_device_ops() would wait for
            # every device of the process: the other ranks' threads under --xla-cpu-devices)
            torch_xla.sync(wait=True)

    @property
    def local_ranks(self) -> int:
        """Ranks in this process (they share torch-xla's process-wide metrics)."""
        return self.world if self.options.xla_cpu_devices else 1

    def barrier(self, key: str) -> None:
        """Wait for every rank, through the host store (no device graph)."""
        from ..parallel import host

        host.all_gather(f"selftest-barrier-{key}", b"", self.mesh.group("world"))

    def nodes(self, group: Group) -> int:
        """How many nodes ``group`` spans."""
        return len({r // self.ranks_per_node for r in group.ranks})


def describe_group(group: Group) -> str:
    """``tp group [0, 1]`` (its ranks; the group of this rank)."""
    return f"{group.name} group {list(group.ranks)}"


def ranks_per_node(world: int, xla_cpu_devices: int) -> int:
    """Ranks per node: torchrun's LOCAL_WORLD_SIZE, or the whole world of one process."""
    if xla_cpu_devices:
        return world
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(world))) or world


def default_tp(world: int, per_node: int) -> int:
    """The tp degree of the selftest's mesh: a node when the job spans several (dp then
    crosses nodes), else half the world from 4 ranks (so dp groups communicate), else all."""
    if per_node < world and world % per_node == 0:
        return per_node
    return world // 2 if world >= 4 and world % 2 == 0 else world
