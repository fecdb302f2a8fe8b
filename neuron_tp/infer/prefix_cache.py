"""Prefix caching for the continuous-batching server: the KV of prompt blocks computed once is
copied into the slot of every later request whose prompt starts with the same tokens.

- A prompt is cut into blocks of ``block`` tokens; each full block has a key that hashes its
  tokens AND its prefix's key (:func:`block_keys`), so the same text after another prefix is a
  different block.
- Every tp rank holds a device pool per layer, ``[blocks + 1, local kv heads, block, head dim]``
  for keys and for values (:class:`PrefixCache`; index ``blocks`` is scratch). Rank 0 alone keeps
  the host index (:class:`PrefixIndex`: key -> pool block, reference counts, LRU eviction) and
  decides, per admitted request, a :class:`PrefixPlan` sent in the lease: the pool blocks to copy
  into the slot (hits) and the pool blocks its next full blocks are written to once prefilled.
- A KV cache split by sequence (:mod:`.kv_split`: the ``r`` ranks sharing a kv head each hold
  positions ``p`` with ``p % r`` their group rank, at local index ``p // r``): a block of
  ``block`` tokens (a multiple of ``r``, so every block starts on a multiple of ``r``) is
  ``block / r`` consecutive local rows on each of them, and each rank's pool holds its own
  rows of every block, ``[blocks + 1, local kv heads, block / r, head dim]``: the same plan
  and index, copies of ``1/r`` the size.
- With a draft model (:class:`~.speculative.SpeculativeGenerator`) the pool has a second part,
  the draft's layers, for the same blocks: one plan (the same block ids, reference counts and
  LRU) copies both, so a hit skips the draft's prefill too.
- Two fixed-shape graphs per part, captured like the model's steps: *load* copies up to ``per_call``
  blocks (ids and counts are data) pool -> slot rows; *store* copies up to ``per_call`` blocks
  slot rows -> pool. ``per_call = chunk // block``: one store per prefill chunk.
- A hit covers at most ``(len(prompt) - 1) // block`` blocks: the last prompt token is always
  prefilled, so there are logits to choose the first token from.
- A block is referenced from the lease that plans its copy until that copy ran (a hit: loaded;
  a stored block: written, or its request ended first, then it is dropped). A referenced block is
  never evicted, and a block not yet written is never a hit.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import torch

from ..errors import UserError

DEFAULT_BLOCK = 32  # tokens per block when not given: the largest divisor of the chunk <= this


class PrefixPlan(NamedTuple):
    """What every rank does for one admitted request: copy pool blocks ``hit`` into the slot's
    first ``len(hit)`` prompt blocks, and write the prompt blocks that follow (``len(hit)``,
    ``len(hit) + 1``, ...) into pool blocks ``store`` once they are prefilled."""

    hit: tuple[int, ...] = ()
    store: tuple[int, ...] = ()

    def to_json(self) -> list[list[int]]:
        return [list(self.hit), list(self.store)]

    @classmethod
    def from_json(cls, value: Sequence[Sequence[int]]) -> PrefixPlan:
        return cls(tuple(value[0]), tuple(value[1]))


class PrefixStats(NamedTuple):
    """Rank 0's prefix-cache counters (``/metrics``)."""

    prompt_tokens: int  # of the requests planned
    hit_tokens: int  # of those, copied from the pool instead of prefilled
    cached_blocks: int  # written and valid now
    capacity: int  # pool blocks
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def block_keys(prompt: Sequence[int], block: int, salt: bytes = b"") -> list[bytes]:
    """The chained keys of ``prompt``'s full blocks: key ``i`` hashes key ``i - 1`` and the
    tokens of block ``i``; the first hashes ``salt`` (what else the KV depends on: a LoRA
    adapter) and block 0."""
    keys, parent = [], salt
    for i in range(len(prompt) // block):
        data = array("q", prompt[i * block : (i + 1) * block]).tobytes()
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        keys.append(parent)
    return keys


def resolve_block(block: int, chunk: int) -> int:
    """The tokens per block: ``block``, or (0) the largest divisor of ``chunk`` up to
    :data:`DEFAULT_BLOCK`. UserError unless it divides the prefill chunk (a store then follows
    each chunk, and a chunk never ends inside a block)."""
    divisors = [d for d in range(1, chunk + 1) if chunk % d == 0]
    if block == 0:
        return max(d for d in divisors if d <= DEFAULT_BLOCK)
    if chunk % block:
        raise UserError(
            f"--prefix-block {block} must divide the prefill chunk ({chunk} tokens: "
            f"--prefill-chunk capped to the largest --buckets); valid: "
            f"{', '.join(map(str, divisors))}"
        )
    return block


class PrefixIndex:
    """Rank 0's host index over ``blocks`` pool blocks of ``block`` tokens (see the module
    doc): :meth:`plan` a request, :meth:`release` what a plan referenced once its copy ran
    (:meth:`written` for a stored block)."""

    def __init__(self, blocks: int, block: int):
        if blocks < 1 or block < 1:
            raise UserError(f"a prefix cache needs >= 1 block of >= 1 token, got {blocks}x{block}")
        self.blocks, self.block = blocks, block
        self._free = list(range(blocks - 1, -1, -1))  # never used; popped lowest first
        self._key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._ready: set[int] = set()  # written: may be a hit
        self._refs: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # ready, unreferenced; oldest first
        self.prompt_tokens = self.hit_tokens = self.evictions = 0

    def plan(self, prompt: Sequence[int], salt: bytes = b"") -> PrefixPlan:
        """The hits (the longest run of written blocks from the start, never the block of the
        last token's prefill) and the pool blocks for the next uncached full blocks (as many as
        can be had without evicting a referenced block); every one referenced. ``salt``: see
        :func:`block_keys`."""
        keys = block_keys(prompt, self.block, salt)
        hit: list[int] = []
        for key in keys[: (len(prompt) - 1) // self.block]:
            b = self._block_of.get(key)
            if b is None or b not in self._ready:
                break
            hit.append(b)
        for b in reversed(hit):  # deepest first: a prefix outlives its extensions in the LRU
            self._ref(b)
        store: list[int] = []
        for key in keys[len(hit) :]:
            if key in self._block_of:  # being written for another request (or not a hit)
                break
            b = self._allocate()
            if b is None:
                break
            self._key_of[b], self._block_of[key] = key, b
            self._ref(b)
            store.append(b)
        self.prompt_tokens += len(prompt)
        self.hit_tokens += len(hit) * self.block
        return PrefixPlan(tuple(hit), tuple(store))

    def written(self, blocks: Sequence[int]) -> None:
        """``blocks`` (stored by a plan) now hold their KV: they may be hits; released."""
        self._ready.update(blocks)
        self.release(blocks)

    def release(self, blocks: Sequence[int]) -> None:
        """One reference less on each of ``blocks``; an unreferenced block never written is
        dropped (its request ended before its prefill)."""
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            del self._refs[b]
            if b in self._ready:
                self._lru[b] = None
            else:
                del self._block_of[self._key_of.pop(b)]
                self._free.append(b)

    def stats(self) -> PrefixStats:
        return PrefixStats(
            self.prompt_tokens, self.hit_tokens, len(self._ready), self.blocks, self.evictions
        )

    def referenced(self, b: int) -> bool:
        return b in self._refs

    def _ref(self, b: int) -> None:
        self._refs[b] = self._refs.get(b, 0) + 1
        self._lru.pop(b, None)

    def _allocate(self) -> int | None:
        """A free block, else the least recently used unreferenced one (evicted); None when
        every block is referenced."""
        if self._free:
            return self._free.pop()
        if not self._lru:
            return None
        b, _ = self._lru.popitem(last=False)
        self._ready.discard(b)
        del self._block_of[self._key_of.pop(b)]
        self.evictions += 1
        return b


def pool_bytes_per_block(model, block: int, draft=None) -> int:
    """Device bytes of one block of every layer's keys and values on this rank (and of the
    ``draft`` model's layers: its part of the pool)."""
    from .slot_cache import kv_tensor_shapes

    size = 0
    for m in (model,) if draft is None else (model, draft):
        for heads, dim, dtype in kv_tensor_shapes(m):
            size += heads * block * dim * torch.empty((), dtype=dtype).element_size()
    return size


def pool_blocks(
    model, *, block: int, blocks: int, budget_mib: float, default: int, draft=None
) -> int:
    """The pool size: ``blocks``, else what ``budget_mib`` holds (the scratch block and the
    ``draft``'s part counted; UserError below one usable block), else ``default``."""
    if blocks and budget_mib:
        raise UserError("give --prefix-cache-blocks or --prefix-cache-mib, not both")
    if blocks:
        return blocks
    if not budget_mib:
        return default
    per = pool_bytes_per_block(model, block, draft)
    fit = int(budget_mib * 2**20 // per) - 1
    if fit < 1:
        raise UserError(
            f"--prefix-cache-mib {budget_mib:g} holds no block: one block of {block} tokens "
            f"takes {per / 2**20:.4g} MiB per rank and the pool needs two (one + its scratch "
            f"block): give at least {2 * per / 2**20:.4g}"
        )
    return fit


class PrefixCache:
    """One rank's prefix cache for the slots of ``gen`` (a SlotGenerator): the device pool of
    ``blocks`` blocks of ``block`` tokens, a part per cache of ``gen.cache_parts()`` (the model's;
    a draft's too), and the load / store graphs; rank 0 (``index``) also the host index.
    ``block`` must divide ``gen.chunk``."""

    def __init__(self, gen, *, blocks: int, block: int, index: bool):
        from .slot_cache import kv_tensor_shapes

        if gen.chunk % block:
            raise UserError(f"the prefix block {block} must divide the chunk {gen.chunk}")
        for r in (_ranks_per_head(part) for part in gen.cache_parts()):
            if block % r:
                raise UserError(
                    f"the prefix block {block} must be a multiple of the {r} ranks that split "
                    f"each kv head's positions (--kv-split sequence): e.g. {r * max(1, block // r)}"
                )
        self.block, self.blocks, self.per_call = block, blocks, gen.chunk // block
        self.index = PrefixIndex(blocks, block) if index else None
        self.pools = [
            [
                torch.zeros(blocks + 1, heads, held_per_block(part, block), dim, dtype=dtype).to(
                    part.device
                )
                for heads, dim, dtype in kv_tensor_shapes(part.model)
            ]
            for part in gen.cache_parts()
        ]
        self._held: dict[int, list[int]] = {}  # rank 0: slot -> blocks it references
        self._plans: dict[int, PrefixPlan] = {}  # slot -> its plan
        self._stored: dict[int, int] = {}  # slot -> prompt blocks written to the pool

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pool in self.pools for t in pool)

    # -- rank 0 ------------------------------------------------------------------------------
    def plan(self, prompt: Sequence[int], salt: bytes = b"") -> PrefixPlan:
        if self.index is None:
            raise RuntimeError("only rank 0's prefix cache plans")
        return self.index.plan(prompt, salt)

    def stats(self) -> PrefixStats | None:
        return self.index.stats() if self.index is not None else None

    # -- every rank ----------------------------------------------------------------------------
    def admit(self, gen, slot: int, plan: PrefixPlan, prompt: Sequence[int]) -> int:
        """Copy ``plan``'s hits into ``slot`` (acquired, nothing prefilled) for ``prompt``; the
        prompt tokens it now holds (ValueError if that would leave none to prefill)."""
        self._plans[slot], self._stored[slot] = plan, len(plan.hit)
        if self.index is not None:
            self._held[slot] = [*plan.hit, *plan.store]  # released by end() whatever happens
        if len(plan.hit) * self.block >= len(prompt):
            raise ValueError(f"{len(plan.hit)} cached blocks leave no prompt token to prefill")
        for i in range(0, len(plan.hit), self.per_call):
            ids = plan.hit[i : i + self.per_call]
            self._copy(gen, "load", ids, slot, i * self.block)
        filled = len(plan.hit) * self.block
        gen.mark_filled(slot, prompt[:filled])
        self._release(slot, plan.hit)
        return filled

    def prefilled(self, gen, slot: int, filled: int) -> None:
        """``slot`` holds ``filled`` prompt tokens: write its planned blocks now complete."""
        plan = self._plans.get(slot)
        if plan is None:
            return
        first, hits = self._stored[slot], len(plan.hit)
        last = min(filled // self.block, hits + len(plan.store))
        for j in range(first, last, self.per_call):
            n = min(self.per_call, last - j)
            blocks = plan.store[j - hits : j - hits + n]
            self._copy(gen, "store", blocks, slot, j * self.block)
            self._stored[slot] = j + n
            if self.index is not None:
                self._held[slot] = [b for b in self._held[slot] if b not in blocks]
                self.index.written(blocks)

    def end(self, slot: int) -> None:
        """``slot``'s request ended: what it still references is released."""
        self._plans.pop(slot, None)
        self._stored.pop(slot, None)
        held = self._held.pop(slot, [])
        if self.index is not None:
            self.index.release(held)

    def warmup(self, gen) -> None:
        """Capture the load and store graphs with copies that change nothing a request sees
        (slot positions and pool blocks: scratch)."""
        for kind in ("load", "store"):
            self._copy(gen, kind, (), 0, 0)

    # -- device side ---------------------------------------------------------------------------
    def _release(self, slot: int, blocks: Sequence[int]) -> None:
        if self.index is not None and blocks:
            self._held[slot] = [b for b in self._held[slot] if b not in blocks]
            self.index.release(blocks)

    def _copy(self, gen, kind: str, blocks: Sequence[int], slot: int, start: int) -> None:
        """Copy ``blocks`` (pool ids, at most ``per_call``) from / to ``slot``'s positions from
        ``start`` on, in every part of the pool."""
        ids = list(blocks) + [self.blocks] * (self.per_call - len(blocks))
        for i, part in enumerate(gen.cache_parts()):
            dev, pool = part.device, self.pools[i]
            args = [
                torch.tensor(ids, dtype=torch.long).to(dev),
                torch.tensor([slot, start, len(blocks)], dtype=torch.long).to(dev),
                *pool,
            ]
            build = self._load_fn if kind == "load" else self._store_fn
            make = partial(build, _Rows.of(part, self.block), len(pool))
            out = part.run_on_cache(("prefix", kind), make, args, writes=kind == "load")
            if kind == "store":
                self.pools[i] = out

    def _positions(self, meta: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """The slot's cache rows a copy touches: from ``start`` (local: ``start / r``) on for
        its blocks, scratch after."""
        j = torch.arange(self.per_call * rows.per_block, device=meta.device)
        valid = j < meta[2:3] * rows.per_block
        first = meta[1:2] // rows.r
        return torch.where(valid, first + j, torch.full_like(j, rows.scratch))

    def _load_fn(self, where: _Rows, n: int):
        def step(ids, meta, *rest):
            pool, kv = rest[:n], rest[n:]
            pos = self._positions(meta, where)[None]  # [1, Q]
            row = meta[0:1][:, None]  # [1, 1]
            for p, c in zip(pool, kv):
                src = p.index_select(0, ids)  # [C, H, T, D]
                src = src.permute(0, 2, 1, 3).reshape(1, -1, p.shape[1], p.shape[3])
                c[row, :, pos] = src.to(c.dtype)  # [1, Q, H, D] at (slot, positions)
            return list(kv)

        return step

    def _store_fn(self, where: _Rows, n: int):
        calls, block = self.per_call, where.per_block

        def step(ids, meta, *rest):
            pool, kv = rest[:n], rest[n:]
            pos = self._positions(meta, where)
            for p, c in zip(pool, kv):
                rows = c.index_select(0, meta[0:1])[0].index_select(1, pos)  # [H, Q, D]
                vals = rows.reshape(p.shape[1], calls, block, p.shape[3]).permute(1, 0, 2, 3)
                p.index_copy_(0, ids, vals.to(p.dtype))
            return list(pool)

        return step


def _ranks_per_head(part) -> int:
    """``r``: the ranks that split each kv head's positions in ``part``'s cache (1: by heads)."""
    return 1 if part.split is None else part.split.r


def held_per_block(part, block: int) -> int:
    """The positions of a ``block``-token block one rank holds in ``part``'s cache."""
    return block // _ranks_per_head(part)


class _Rows(NamedTuple):
    """Where a copy's positions live in one part's cache on this rank: ``per_block`` rows a
    block, local index = global position // ``r``, the ``scratch`` row."""

    per_block: int
    r: int
    scratch: int

    @classmethod
    def of(cls, part, block: int) -> _Rows:
        scratch = part.max_len if part.split is None else part.split.local_len
        return cls(held_per_block(part, block), _ranks_per_head(part), scratch)
