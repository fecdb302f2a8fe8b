"""Shared-prefix request traces for the prefix-cache tests (tests/infer/test_prefix_cache.py):
system prompts with different questions, next turns that extend an earlier prompt, repeated
prompts; greedy and seeded sampling; some clients cancel. The engine shapes and the reference
(transformers' ``generate`` per request on the unsharded model) are engine_cases'."""

from __future__ import annotations

import copy
import random

import engine_cases as ec

BLOCK = 4  # tokens per cached block: divides ec.CHUNK (8), two blocks per copy call


def make_trace(seed: int, n: int, cancel: float = 0.1, vocab: int = 256) -> list[dict]:
    """``n`` requests (``cancel``: the share cancelled by their client) of token ids
    ``1..vocab-1`` (a small ``vocab``: repetitive text)."""
    rng = random.Random(seed)

    def words(k: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(k)]

    systems = [words(12), words(9), words(5)]
    history: list[list[int]] = []
    items = []
    for _ in range(n):
        r = rng.random()
        if history and r < 0.25:  # the same prompt again
            prompt = list(rng.choice(history))
        elif history and r < 0.5:  # a next turn: an earlier prompt and more
            prompt = (rng.choice(history) + words(rng.randint(1, 6)))[: ec.MAX_PROMPT]
        else:  # a system prompt and a question
            prompt = rng.choice(systems) + words(rng.randint(1, 7))
        history.append(prompt)
        sampled = rng.random() < 1 / 3
        items.append(
            {
                "gap": rng.choice([0.0, 0.0, 0.002, 0.01]),
                "prompt": prompt,
                "max_tokens": rng.randint(1, ec.MAX_NEW),
                "sampling": (rng.choice([0.7, 1.3]), rng.choice([0, 5]), rng.randrange(10**6))
                if sampled
                else None,
                "cancel": rng.random() < cancel,
            }
        )
    return items


def engine(  # noqa: PLR0913
    model, group=None, *, blocks: int | None, rank0: bool = True, draft=None, kv_split="heads", **kw
):
    """An Engine over ``model`` with ec.SHAPES slots and a prefix cache of ``blocks`` blocks
    (None: no prefix caching); ``draft``: plain decoding (None), a draft model (speculation
    with K=3, its KV pooled too) or ``"ngram"`` (prompt lookup, K=3); ``kv_split``: the slot
    cache's layout (``sequence``: each rank of a kv head's group holds 1/r of the positions)."""
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.ngram import NgramGenerator
    from neuron_tp.infer.prefix_cache import PrefixCache
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.infer.speculative import SpeculativeGenerator
    from neuron_tp.job.data import ByteTokenizer

    replay = kw.pop("replay", True)
    eng = Engine(group, **kw)
    if draft is None:
        gen = SlotGenerator(model, **ec.SHAPES, replay=replay, kv_split=kv_split)
    elif draft == "ngram":
        gen = NgramGenerator(model, **ec.SHAPES, k=3, replay=replay)
    else:
        gen = SpeculativeGenerator(model, draft, **ec.SHAPES, k=3, replay=replay)
    prefix = None
    if blocks is not None:
        prefix = PrefixCache(gen, blocks=blocks, block=BLOCK, index=rank0)
    eng.attach(gen, ByteTokenizer(), ec.EOS, ec.MAX_NEW, prefix)
    return eng


def serve_trace(eng, items: list[dict]) -> list[dict]:
    """Rank 0: run ``items`` through ``eng`` (started on a worker thread) and shut it down."""
    eng.start()
    try:
        return ec.drive(eng, items)
    finally:
        eng.shutdown(60)


def check_greedy(results: list[dict], items: list[dict], full) -> None:
    """Every greedy request equals transformers' greedy ``generate`` (plain decoding) alone."""
    greedy = [i for i, it in enumerate(items) if it["sampling"] is None]
    refs = [ec.reference(full, items[i]) for i in greedy]
    ec.check([results[i] for i in greedy], [items[i] for i in greedy], refs)


def tp2_gloo(case: str) -> None:
    """tp=2 on gloo ranks: a shared-prefix trace through a small pool equals transformers per
    request, with hits and evictions. ``split``: a model with one kv head, its slot cache split
    by sequence (each rank's pool holds its half of every block's positions)."""
    from neuron_tp import hf, init_mesh
    from neuron_tp.job.presets import build_model
    from slot_trace import kv1_llama

    mesh = init_mesh(tp=2)
    split = case == "split"
    full = (kv1_llama() if split else build_model("tiny-llama", ec.VOCAB, ec.SEED)).eval()
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()
    eng = engine(
        model,
        mesh.group("world"),
        blocks=6,
        rank0=mesh.rank == 0,
        lease_steps=3,
        kv_split="sequence" if split else "heads",
    )
    assert eng.gen.kv_split == ("sequence" if split else "heads")
    eng.warmup()
    if mesh.rank != 0:
        eng.follow()
        return
    items = make_trace(11, 30)
    results = serve_trace(eng, items)
    ec.check(results, items, [ec.reference(full, it) for it in items])
    stats = eng.prefix_stats()
    assert stats.hit_tokens > 0 and stats.evictions > 0, stats
