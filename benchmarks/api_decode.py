"""Decode time per token of the serving paths an OpenAI request can take, on the XLA CPU
device (replayed graphs), for a Llama of hidden H (64: tiny) and L layers and a vocabulary of
V tokens: greedy; sampled with top_p and the three penalties; greedy with the
log-probabilities read back; greedy under a JSON-schema grammar (each row's matcher advanced
with its token and its next packed mask built on the host, then uploaded with the step, as
the serving rows do). Each path runs the cheapest decode graph of the fixed set that covers
it (:data:`neuron_tp.infer.slot_records.DECODE_VARIANTS`). At 1
and 8 running slots: ms per decode step and per generated token, best of 3 runs of
``--steps`` steps after a warm-up. Then the grammar library's own time per token
(llguidance's ``compute_bitmask``, our packed row from it, the ``[vocab]`` row of 0 / ``-inf``
unpacked on the host, ``consume_token``) on the same
vocabulary: a synthetic byte-level one of V tokens (the 256 bytes, then lowercase and
space-led lowercase 2- and 3-grams, digits, punctuation pairs), so that the trie has the size of
a real tokenizer's.

Usage: ``PJRT_DEVICE=CPU python benchmarks/api_decode.py [--hidden 64] [--layers 8]
[--vocab 32000] [--slots 1,8] [--steps 32]``.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import os
import statistics
import string
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from slots_decode import execute_ms  # noqa: E402

SCHEMA = {  # a schema whose answers go on long enough to time
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "notes": {"type": "array", "items": {"type": "string"}},
        "score": {"type": "integer"},
    },
    "required": ["title", "notes", "score"],
}


def synthetic_vocab(size: int) -> list[bytes]:
    """``size`` distinct byte strings: the 256 bytes, then n-grams of text, then padding."""
    low = string.ascii_lowercase
    grams = [a + b for a, b in itertools.product(low, repeat=2)]
    grams += [" " + g for g in grams]
    grams += ["".join(t) for t in itertools.product(low, repeat=3)]
    grams += [" " + "".join(t) for t in itertools.product(low, repeat=3)]
    grams += [a + b for a, b in itertools.product(string.punctuation + string.digits, repeat=2)]
    out, seen = [bytes([i]) for i in range(256)], {bytes([i]) for i in range(256)}
    for g in grams:
        b = g.encode()
        if b not in seen:
            out.append(b)
            seen.add(b)
        if len(out) >= size - 1:
            break
    out += [f"<pad{i}>".encode() for i in range(size - 1 - len(out))]
    return out[: size - 1] + [b"<|endoftext|>"]


class _Tokens:
    """The synthetic vocabulary as llguidance's tokenizer interface (end token: the last)."""

    def __init__(self, tokens: list[bytes]):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, len(tokens) - 1, None
        self.special_token_ids = [self.eos_token_id]

    def __call__(self, text):
        return list(text.encode("utf-8") if isinstance(text, str) else text)


def grammars(vocab: int):
    """A :class:`~neuron_tp.infer.grammar.Grammars` over the synthetic vocabulary."""
    import llguidance as llg

    from neuron_tp.infer.grammar import Grammars

    g = Grammars.__new__(Grammars)
    wrapped = llg.TokenizerWrapper(_Tokens(synthetic_vocab(vocab)))
    g.tokens = llg.LLTokenizer(wrapped, n_vocab=vocab, eos_token=[vocab - 1])
    g.vocab, g.eos_ids = vocab, [vocab - 1]
    return g


def measure(gen, n: int, steps: int, sampling, logprobs: bool, guides=None) -> dict:
    """``n`` slots prefilled with short prompts, then ``steps`` timed decode steps;
    ``guides``: a function making a row's grammar state (None: no grammar)."""
    for s in list(gen.in_use):
        gen.release(s)
    rows = {}
    for i in range(n):
        slot = gen.acquire()
        prompt = [(7 * i + j) % 250 + 1 for j in range(5 + i % 4)]
        if logprobs:
            gen.logprob_slots.add(slot)
        allowed = None
        if guides is not None:
            rows[slot] = guides()
            allowed = rows[slot].bits()
        token = gen.prefill(slot, prompt, 0, sampling(i), prompt=prompt, allowed=allowed)
        if guides is not None:
            _advance(rows, slot, token, guides, gen)
    e0, t0 = execute_ms(), time.perf_counter()
    for _ in range(steps):
        for slot, new in gen.decode().items():
            if guides is not None:
                _advance(rows, slot, new[0], guides, gen)
    wall = (time.perf_counter() - t0) * 1e3 / steps
    return {"step_ms": wall, "token_ms": wall / n, "execute_ms": (execute_ms() - e0) / steps}


def _advance(rows: dict, slot: int, token: int, guides, gen) -> None:
    """What a serving row does with its token: accept it, mask the next (a new grammar when
    this one is complete, to keep the row constrained)."""
    guide = rows[slot]
    try:
        guide.accept(token)
    except ValueError:
        guide = rows[slot] = guides()
    if guide.done:
        guide = rows[slot] = guides()
    gen.masks[slot] = guide.bits()


def mask_times(g, grammar: str, tokens: int = 400) -> dict:
    """Median and p90 us per token of llguidance's bitmask, our row from it and the accept,
    on a walk that takes the lowest allowed non-end token (a new matcher when complete)."""
    import torch

    from neuron_tp.infer.grammar import Guide

    bitmask, bits, row, accept = [], [], [], []
    guide = Guide(g, grammar)
    for _ in range(tokens):
        t0 = time.perf_counter()
        guide.matcher.compute_bitmask()
        t1 = time.perf_counter()
        guide.bits()
        tb = time.perf_counter()
        mask = guide.mask()
        t2 = time.perf_counter()
        allowed = (mask == 0).nonzero().flatten()
        allowed = allowed[allowed != g.vocab - 1]
        if guide.done or not len(allowed):
            guide = Guide(g, grammar)
            continue
        pick = int(allowed[torch.randint(len(allowed), (1,))])
        t3 = time.perf_counter()
        guide.accept(pick)
        t4 = time.perf_counter()
        bitmask.append(t1 - t0)
        bits.append(tb - t1)
        row.append(t2 - tb)
        accept.append(t4 - t3)

    def stats(xs):
        xs = sorted(xs)
        return statistics.median(xs) * 1e6, xs[int(0.9 * len(xs))] * 1e6

    return {
        "bitmask": stats(bitmask),
        "bits": stats(bits),
        "row": stats(row),
        "accept": stats(accept),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--slots", default="1,8")
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.infer.grammar import Guide, json_grammar
    from neuron_tp.infer.sampling import Sampling
    from neuron_tp.infer.slot_generator import SlotGenerator

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(4, args.hidden // 64),
        num_key_value_heads=max(4, args.hidden // 64),
        max_position_embeddings=256,
    )
    model = hf.parallelize(copy.deepcopy(LlamaForCausalLM(cfg).eval()), ntp.Mesh(1, 0)).eval()
    model = model.to(ntp.xla_device())
    sizes = sorted(map(int, args.slots.split(",")))
    gen = SlotGenerator(
        model, max(sizes), max_len=3 * args.steps + 48, chunk=16, decode_buckets=sizes, top_p=True
    )
    gen.warmup()
    warm = gen.traces
    g, grammar = grammars(args.vocab), json_grammar(SCHEMA)
    penalised = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    paths = {
        "greedy": (lambda i: Sampling(), False, None),
        "top_p 0.9 + penalties": (
            lambda i: Sampling(True, 0.8, 0, i, top_p=0.9, **penalised),
            False,
            None,
        ),
        "greedy + logprobs (20 top)": (lambda i: Sampling(), True, None),
        "greedy + JSON schema": (lambda i: Sampling(), False, lambda: Guide(g, grammar)),
    }
    results: dict[tuple[str, int], dict] = {}
    for name, (sampling, logprobs, guides) in paths.items():
        for n in sizes:
            results[name, n] = min(
                (measure(gen, n, args.steps, sampling, logprobs, guides) for _ in range(3)),
                key=lambda r: r["step_ms"],
            )
    shape = f"hidden {args.hidden}, L={args.layers}, vocab {args.vocab}"
    print(f"{shape}, XLA CPU device, best of 3 x {args.steps} steps")
    head = "".join(f" {f'{n} slot ms/step':>16} {f'{n} slot ms/token':>17}" for n in sizes)
    print(f"{'path':<28}{head}")
    for name in paths:
        cells = "".join(
            f" {results[name, n]['step_ms']:>16.2f} {results[name, n]['token_ms']:>17.2f}"
            for n in sizes
        )
        print(f"{name:<28}{cells}")
    print(f"graphs after warmup(): {warm}, after the timed steps: {gen.traces}")
    t = mask_times(g, grammar)
    print(f"llguidance per token, vocabulary {args.vocab} (median / p90 us):")
    for what, label in (
        ("bitmask", "compute_bitmask"),
        ("bits", "Guide.bits (bitmask, packed row)"),
        ("row", "Guide.mask (bitmask + [vocab] row)"),
        ("accept", "consume_token"),
    ):
        print(f"  {label:<36} {t[what][0]:>8.1f} {t[what][1]:>8.1f}")


if __name__ == "__main__":
    main()
