"""Samples (ids + loss mask) into fixed ``[rows, seq_len]`` int64 tensors: packed (several
samples per row, best-fit decreasing) or padded (one sample per row).

Packed rows hold ``input_ids``, ``labels`` (the id where the loss is taken, -100 elsewhere:
on padding, on prompt tokens, and on each sample's first token, since HF shifts labels left by
one inside the model: the last token of one sample never predicts the first of the next),
``position_ids`` (0, 1, ... restarting at each sample; 0 on padding) and ``segment_ids`` (the
samples of a row are 1..k, padding 0). Padded rows hold ``input_ids`` and ``labels``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from ..hf.packing import IGNORE_INDEX  # the label of a token the loss skips

TRUNCATE, DROP = "truncate", "drop"


@dataclass
class FitCounts:
    """How many samples :func:`fit` kept (``truncated`` of them cut to ``seq_len``) or dropped
    (too long with ``--overlong drop``; or without a loss token left within ``seq_len``)."""

    kept: int = 0
    truncated: int = 0
    dropped_long: int = 0
    dropped_no_loss: int = 0

    def describe(self, seq_len: int, overlong: str) -> str:
        """One line for the startup log."""
        total = self.kept + self.dropped_long + self.dropped_no_loss
        line = f"data: {self.kept} of {total} samples used"
        if overlong == TRUNCATE:
            line += f"; {self.truncated} longer than --seq-len {seq_len} truncated"
        else:
            line += f"; {self.dropped_long} longer than --seq-len {seq_len} dropped"
        if self.dropped_no_loss:
            line += f"; {self.dropped_no_loss} dropped: no loss token within --seq-len"
        return line + f" (--overlong {overlong})"


def fit(
    samples: list[tuple[list[int], list[bool]]], seq_len: int, overlong: str
) -> tuple[list[tuple[list[int], list[bool]]], FitCounts]:
    """The samples that fit ``seq_len`` (longer ones truncated to their first ``seq_len``
    tokens, or dropped with ``overlong="drop"``) and take a loss on at least one token after
    their first (the first token is never predicted); with the counts."""
    out, counts = [], FitCounts()
    for whole, whole_mask in samples:
        if len(whole) > seq_len and overlong == DROP:
            counts.dropped_long += 1
            continue
        ids, mask = whole[:seq_len], whole_mask[:seq_len]
        if not any(mask[1:]):
            counts.dropped_no_loss += 1
            continue
        out.append((ids, mask))
        counts.kept += 1
        counts.truncated += len(ids) < len(whole)
    return out, counts


def _labels(ids: list[int], mask: list[bool]) -> torch.Tensor:
    labels = torch.tensor(ids, dtype=torch.long)
    labels[~torch.tensor(mask, dtype=torch.bool)] = IGNORE_INDEX
    labels[0] = (
        IGNORE_INDEX  # never a target (HF shifts); in a packed row: not the previous' target
    )
    return labels


def assign_rows(lengths: list[int], seq_len: int) -> list[list[int]]:
    """Sample indices per row, best-fit decreasing: longest sample first, each into the row
    with the least room that still holds it (a new row when none does); within a row the
    samples keep their data order. Deterministic (same rows on every rank)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row), sorted
    for i in order:
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k == len(room):
            rows.append([i])
            free, row = seq_len - lengths[i], len(rows) - 1
        else:
            free, row = room.pop(k)
            rows[row].append(i)
            free -= lengths[i]
        if free > 0:
            bisect.insort(room, (free, row))
    return [sorted(r) for r in rows]


def pack(
    samples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Packed rows of ``samples`` (each at most ``seq_len`` long, see :func:`fit`)."""
    rows = assign_rows([len(ids) for ids, _ in samples], seq_len)
    n = len(rows)
    out = {
        "input_ids": torch.full((n, seq_len), pad_id, dtype=torch.long),
        "labels": torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long),
        "position_ids": torch.zeros((n, seq_len), dtype=torch.long),
        "segment_ids": torch.zeros((n, seq_len), dtype=torch.long),
    }
    for r, members in enumerate(rows):
        at = 0
        for seg, i in enumerate(members, 1):
            ids, mask = samples[i]
            end = at + len(ids)
            out["input_ids"][r, at:end] = torch.tensor(ids, dtype=torch.long)
            out["labels"][r, at:end] = _labels(ids, mask)
            out["position_ids"][r, at:end] = torch.arange(len(ids))
            out["segment_ids"][r, at:end] = seg
            at = end
    return out


def pad(
    samples: list[tuple[list[int], list[bool]]], seq_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """One sample per row, right-padded with ``pad_id`` (labels -100 there)."""
    n = len(samples)
    out = {
        "input_ids": torch.full((n, seq_len), pad_id, dtype=torch.long),
        "labels": torch.full((n, seq_len), IGNORE_INDEX, dtype=torch.long),
    }
    for r, (ids, mask) in enumerate(samples):
        out["input_ids"][r, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        out["labels"][r, : len(ids)] = _labels(ids, mask)
    return out
