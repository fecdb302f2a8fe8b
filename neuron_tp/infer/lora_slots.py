"""The LoRA adapters a server knows and where they sit (the host side of
:class:`~neuron_tp.hf.lora_bank.LoraBank`).

- :class:`Adapters` (rank 0): the adapters requests may name, loaded and unloaded at run time
  (``POST /v1/load_lora_adapter``): a load reads and checks the directory before it answers,
  so a bad one is refused and never reaches the engine. Each load gets a new ``uid``: a name
  unloaded and loaded again is a new adapter (a request queued before keeps its own).
- :class:`BankSlots` (every rank): which adapter each bank slot holds. Rank 0 places an
  admitted request's adapter (:meth:`BankSlots.place`: the slot already holding it, else a free
  or the least recently used slot no running request uses; None: the request waits) and every
  rank, running the lease, writes it into its bank (:meth:`BankSlots.ensure`) before the
  request's first chunk: the ranks' banks change at the same step.
- :class:`HostAdapters`: the adapters kept read in host memory (``--max-cpu-loras``, least
  recently used out).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ..errors import UserError
from ..hf.lora_bank import AdapterWeights, LoraBank, read_adapter


@dataclass(frozen=True)
class AdapterRef:
    """An adapter requests may name: ``name``, its directory and the ``uid`` of this load."""

    name: str
    path: str
    uid: int


@dataclass(frozen=True)
class AdapterUse:
    """An admitted request's adapter (what every rank needs): the load ``uid``, its directory
    and the bank slot it runs in."""

    uid: int
    path: str
    slot: int

    def to_json(self) -> list:
        return [self.uid, self.path, self.slot]

    @classmethod
    def from_json(cls, value: list) -> AdapterUse:
        return cls(int(value[0]), str(value[1]), int(value[2]))


class HostAdapters:
    """Adapters read into host memory, at most ``size`` (least recently used out);
    thread-safe (rank 0 reads on a load request, the engine when placing one)."""

    def __init__(self, size: int):
        self.size = size
        self._cache: OrderedDict[int, AdapterWeights] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, uid: int, path: str) -> AdapterWeights:
        """The weights of load ``uid`` (read from ``path`` unless kept)."""
        with self._lock:
            if uid in self._cache:
                self._cache.move_to_end(uid)
                return self._cache[uid]
        weights = read_adapter(path)
        self.put(uid, weights)
        return weights

    def put(self, uid: int, weights: AdapterWeights) -> None:
        with self._lock:
            self._cache[uid] = weights
            self._cache.move_to_end(uid)
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)


class BankSlots:
    """Which adapter each slot of ``bank`` holds (every rank), and rank 0's placement."""

    def __init__(self, bank: LoraBank, host: HostAdapters):
        self.bank, self.host = bank, host
        self.loaded: list[int | None] = [None] * bank.slots  # the uid each slot holds
        self._planned: list[int | None] = [None] * bank.slots  # rank 0's placements
        self._used = [0] * bank.slots  # when each slot was last placed (LRU)
        self._clock = 0
        self.loads = 0  # adapters written into the bank

    def place(self, uid: int, busy: set[int]) -> int | None:
        """Rank 0: the slot for load ``uid`` (``busy``: slots running requests use); None
        when every slot is busy with other adapters."""
        self._clock += 1
        if uid in self._planned:
            slot = self._planned.index(uid)
        else:
            free = [s for s in range(self.bank.slots) if s not in busy]
            if not free:
                return None
            slot = min(free, key=lambda s: (self._planned[s] is not None, self._used[s]))
            self._planned[slot] = uid
        self._used[slot] = self._clock
        return slot

    def forget(self, uid: int) -> None:
        """Rank 0: load ``uid`` was unloaded; its slot is free once no request uses it."""
        self._planned = [None if u == uid else u for u in self._planned]

    def ensure(self, use: AdapterUse) -> None:
        """Every rank: slot ``use.slot`` holds load ``use.uid`` (written now unless it does)."""
        if self.loaded[use.slot] == use.uid:
            return
        self.loaded[use.slot] = None  # a failed write leaves the slot unknown
        self.bank.write(use.slot, self.host.get(use.uid, use.path))
        self.loaded[use.slot] = use.uid
        self.loads += 1


class Adapters:
    """Rank 0: the adapters of a server whose base model is ``base`` (its served name), each
    checked against ``bank`` when loaded; thread-safe."""

    def __init__(self, base: str, bank: LoraBank, host: HostAdapters):
        self.base, self.bank, self.host = base, bank, host
        self._by_name: dict[str, AdapterRef] = {}
        self._next_uid = 0
        self._lock = threading.Lock()

    def load(self, name: str, path: str) -> AdapterRef:
        """Add adapter ``name`` from ``path``; UserError naming what is wrong (a name in use,
        a directory that is not a LoRA adapter, a rank or targets this bank cannot hold)."""
        if not name or name == self.base:
            raise UserError(f"lora_name {name!r}: give a name other than the base model's")
        with self._lock:
            if name in self._by_name:
                raise UserError(f"the adapter {name!r} is already loaded; unload it first")
        weights = read_adapter(path)
        bad = self.bank.problems(weights)
        if bad:
            raise UserError(f"{path}: " + "; ".join(bad))
        with self._lock:
            if name in self._by_name:
                raise UserError(f"the adapter {name!r} is already loaded; unload it first")
            ref = AdapterRef(name, path, self._next_uid)
            self._next_uid += 1
            self._by_name[name] = ref
        self.host.put(ref.uid, weights)
        return ref

    def unload(self, name: str) -> AdapterRef:
        """Remove adapter ``name`` (requests already queued or running keep it); KeyError
        when there is none."""
        with self._lock:
            if name not in self._by_name:
                raise KeyError(name)
            return self._by_name.pop(name)

    def get(self, name: str) -> AdapterRef | None:
        with self._lock:
            return self._by_name.get(name)

    def all(self) -> list[AdapterRef]:
        with self._lock:
            return sorted(self._by_name.values(), key=lambda r: r.uid)


def parse_lora_module(spec: str) -> tuple[str, str]:
    """``(name, path)`` of a ``--lora-modules`` entry: ``NAME=DIR`` or JSON ``{"name": ...,
    "path": ...}``; UserError otherwise."""
    import json

    if spec.lstrip().startswith("{"):
        try:
            body = json.loads(spec)
            return str(body["name"]), str(body["path"])
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f'--lora-modules {spec!r}: JSON needs "name" and "path" ({e})') from e
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise UserError(f"--lora-modules {spec!r}: give NAME=DIR")
    return name, path
