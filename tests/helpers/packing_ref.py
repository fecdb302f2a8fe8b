"""Packed batches and their independent reference: plain transformers on the unsharded model,
each sample run on its own (no packing, no mask, default positions)."""

from __future__ import annotations

import torch
from torch import nn

# Sample lengths per row (their sum <= S; the rest is padding, segment 0). Row 0 ends without
# padding; row 1 has padding; both have samples of length 1 and 2 (edge cases of the shift).
S = 16
LAYOUTS = {
    "a": [[5, 1, 7, 3], [2, 6, 4]],  # 16 tokens, then 12 + 4 padding
    "b": [[9, 4, 2], [3, 3, 3, 3, 1]],  # 15 + 1 padding, then 13 + 3 padding
    "c": [[16], [1, 10]],  # one sample filling the row; then 11 + 5 padding
}


def packed_batch(
    layout: list[list[int]], vocab: int, seed: int, length: int = S
) -> dict[str, torch.Tensor]:
    """A packed batch dict (the data interface) of rows of ``length`` tokens: random tokens,
    labels = tokens with -100 at each sample's first token and on padding, positions
    restarting per sample."""
    S = length  # noqa: N806
    g = torch.Generator().manual_seed(seed)
    b = len(layout)
    ids = torch.randint(1, vocab, (b, S), generator=g)
    seg = torch.zeros(b, S, dtype=torch.long)
    pos = torch.zeros(b, S, dtype=torch.long)
    for r, lengths in enumerate(layout):
        at = 0
        for k, n in enumerate(lengths, start=1):
            seg[r, at : at + n] = k
            pos[r, at : at + n] = torch.arange(n)
            at += n
        pos[r, at:] = torch.arange(S - at)  # padding: any positions
    labels = ids.clone()
    starts = torch.cat([torch.ones(b, 1, dtype=torch.bool), seg[:, 1:] != seg[:, :-1]], 1)
    labels[starts | (seg == 0)] = -100
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "segment_ids": seg}


def samples(batch: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every (input_ids, labels) sample of a packed batch, in order."""
    out = []
    for r in range(batch["input_ids"].shape[0]):
        seg = batch["segment_ids"][r]
        for k in range(1, int(seg.max()) + 1):
            sel = seg == k
            out.append((batch["input_ids"][r][sel], batch["labels"][r][sel]))
    return out


def reference_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over samples of the sample's token-loss sum / total labelled tokens, each sample
    through ``model`` alone (HF's causal shift: token t predicts label t+1)."""
    total, count = 0.0, 0
    for ids, labels in samples(batch):
        logits = model(input_ids=ids[None]).logits[0].float()
        target = labels[1:]
        total = total + nn.functional.cross_entropy(
            logits[:-1], target, ignore_index=-100, reduction="sum"
        )
        count += int((target != -100).sum())
    return total / count
