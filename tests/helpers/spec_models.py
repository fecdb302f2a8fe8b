"""Targets and drafts for the speculative decoding tests (tests/infer/test_speculative.py) and
benchmarks/speculative.py: a draft made of a model's first layers and its head, a draft of
random weights, and the chi-square statistic of the distribution tests."""

from __future__ import annotations

import copy

import torch


def first_layers(full, n: int):
    """A copy of causal LM ``full`` keeping its first ``n`` decoder layers (and its
    embeddings, final norm and head): a draft that agrees with ``full`` often."""
    draft = copy.deepcopy(full)
    draft.model.layers = draft.model.layers[:n]
    draft.config.num_hidden_layers = n
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = draft.config.layer_types[:n]
    return draft.eval()


def chi_square(counts: dict, probs: dict, total: int, pool: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic of observed ``counts`` against ``probs`` (cell -> probability) over
    ``total`` draws, cells expecting fewer than ``pool`` draws pooled into one; returns
    ``(statistic, degrees of freedom)``. A count in a cell of probability 0 is infinite."""
    if any(probs.get(c, 0.0) == 0.0 for c in counts):
        return float("inf"), 0
    big = [c for c, p in probs.items() if p * total >= pool]
    small = [c for c, p in probs.items() if c not in big and p > 0]
    cells = [([c], probs[c]) for c in big]
    if small:
        cells.append((small, sum(probs[c] for c in small)))
    stat = 0.0
    for group, p in cells:
        seen = sum(counts.get(c, 0) for c in group)
        stat += (seen - p * total) ** 2 / (p * total)
    return stat, len(cells) - 1


def critical(df: int) -> float:
    """The chi-square quantile of significance 1e-3 at ``df`` degrees of freedom (Wilson-
    Hilferty: within 1% for df >= 3)."""
    if df < 1:
        return 0.0  # nothing to test (an impossible cell was drawn: the statistic is inf)
    z = 3.0902  # the standard normal's 1 - 1e-3 quantile
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def exact_sequences(full, prompt: list[int], n: int, temperature: float) -> dict:
    """Probability of every ``n``-token continuation of ``prompt`` under ``full`` sampled at
    ``temperature`` (enumerated: a tiny vocabulary)."""
    vocab = full.config.vocab_size
    out = {(): 1.0}
    with torch.no_grad():
        for _ in range(n):
            nxt = {}
            for seq, p in out.items():
                logits = full(torch.tensor([prompt + list(seq)])).logits[0, -1].double()
                probs = (logits / temperature).softmax(-1)
                for t in range(vocab):
                    nxt[seq + (t,)] = p * probs[t].item()
            out = nxt
    return out
