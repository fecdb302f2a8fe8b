"""Packed rows for transformers causal LMs: several samples in one fixed-length row, each one
computed exactly as if it ran alone.

A packed batch (``neuron_tp.job`` data, one dict of equal-shape ``[micro_batch, seq_len]``
int64 tensors) carries ``position_ids`` (restarting at 0 with each sample: the rotary
positions) and ``segment_ids`` (1..k the samples of a row, 0 padding). :func:`model_inputs`
turns it into the keyword arguments of the model's forward:

- ``attention_mask``: a 4D additive mask ``[b, 1, s, s]`` (0 = attend, the dtype's minimum =
  not), causal AND block-diagonal: a token attends to itself and to the earlier tokens of its
  own sample. A padding token attends to itself only (never a fully masked row: no NaN from a
  softmax over nothing). transformers takes a 4D mask as-is (``create_causal_mask`` returns it
  before any causal / padding / packed-sequence logic of its own), for ``sdpa`` and ``eager``
  alike (eager adds it to the scores, sdpa takes a float mask as a bias).
- ``labels``: -100 on padding and at each sample's first token (its label would be predicted
  by the previous sample's last token once the model shifts the labels).
- ``position_ids``: as given, 0 on padding (any value there would do, as long as it is a
  valid index of a learned position table).

Everything is computed with tensor ops on the batch's device: on XLA the mask is part of the
step graph, built from ``segment_ids`` (data), so every packing runs the same graph. Nothing
is read back to the host (transformers' own packed-sequence detection from ``position_ids``
alone would read values: a host sync and a graph per packing, so it is never triggered).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import UserError

__all__ = [
    "model_inputs",
    "block_causal_mask",
    "packed_labels",
    "check_packable",
    "next_token_targets",
]

IGNORE_INDEX = -100
_PACKED = ("position_ids", "segment_ids")


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """The token each position predicts (``labels`` shifted left by one along the last dim,
    IGNORE_INDEX after the last): the shift a causal LM's loss makes, done on the whole row
    before it is split (context parallelism), so a part's last token keeps its target."""
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]


def block_causal_mask(
    segment_ids: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The additive ``[b, 1, s, s]`` mask of ``segment_ids`` ``[b, s]``: 0 where query ``i``
    may attend key ``j`` (``j <= i``, same non-zero segment; and ``j == i`` always), the
    minimum of ``dtype`` elsewhere."""
    s = segment_ids.shape[-1]
    idx = torch.arange(s, device=segment_ids.device)
    causal = idx[None, :] <= idx[:, None]  # [q, k]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [b, q, k]
    real_key = (segment_ids != 0)[:, None, :]
    allowed = (same & real_key & causal) | (idx[None, :] == idx[:, None])
    zero = torch.zeros((), dtype=dtype, device=segment_ids.device)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=segment_ids.device)
    return torch.where(allowed[:, None], zero, blocked)


def packed_labels(labels: torch.Tensor, segment_ids: torch.Tensor) -> torch.Tensor:
    """``labels`` with -100 on padding (segment 0) and at the first token of every sample
    (so no token is trained to predict the next sample's first token)."""
    first = torch.ones_like(segment_ids[:, :1], dtype=torch.bool)
    starts = torch.cat([first, segment_ids[:, 1:] != segment_ids[:, :-1]], dim=1)
    return labels.masked_fill(starts | (segment_ids == 0), IGNORE_INDEX)


def _check(batch: Mapping[str, torch.Tensor]) -> None:
    """Shapes and dtypes only (no values: nothing is read from the device)."""
    missing = [k for k in ("input_ids", "labels") if k not in batch]
    packed = [k for k in _PACKED if k in batch]
    if missing or len(packed) == 1:
        need = list(missing) + [k for k in _PACKED if k not in batch and packed]
        raise UserError(
            f"model_inputs: the batch lacks {need} (has {sorted(batch)}); a batch holds "
            "input_ids and labels, and when packed both position_ids and segment_ids"
        )
    shape = batch["input_ids"].shape
    for key in ("input_ids", "labels", *packed):
        t = batch[key]
        if t.dim() != 2 or t.shape != shape or t.dtype.is_floating_point or t.is_complex():
            raise UserError(
                f"model_inputs: {key} is a {t.dtype} tensor of shape {tuple(t.shape)}; every "
                f"batch tensor must be an integer [micro_batch, seq_len] tensor of input_ids' "
                f"shape {tuple(shape)}"
            )


def model_inputs(
    batch: Mapping[str, torch.Tensor],
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    segments: bool = False,
) -> dict[str, torch.Tensor]:
    """The forward kwargs of a transformers causal LM (parallelized or not) for ``batch``:
    ``input_ids`` and ``labels``, plus for a packed batch ``position_ids`` and the
    block-diagonal causal ``attention_mask`` (additive, ``dtype``), with the labels of
    padding and of every sample's first token set to -100 (and padding at position 0).

    ``device``: move the batch there first (the mask is built where ``segment_ids`` is, so
    build it on the XLA device, not on the host). ``dtype``: the mask's dtype (float32 works
    with every model dtype; the model's dtype saves memory in eager attention). ``segments``:
    pass a packed batch's ``segment_ids`` instead of building the mask (a context-parallel
    model masks each ring tile by them, :mod:`neuron_tp.hf.context_parallel`)."""
    _check(batch)
    if device is not None:
        batch = {k: v.to(device) for k, v in batch.items()}
    out = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    if "segment_ids" in batch:
        seg = batch["segment_ids"]
        out["labels"] = packed_labels(batch["labels"], seg)
        # padding at position 0: whatever the data put there stays inside the position table
        out["position_ids"] = batch["position_ids"].masked_fill(seg == 0, 0)
        if segments:
            out["segment_ids"] = seg
        else:
            out["attention_mask"] = block_causal_mask(seg, dtype)
    return out


def check_packable(config, seq_len: int) -> None:
    """Refuse a model whose attention the packed mask would change: a sliding window shorter
    than the rows (transformers applies the window through the mask it builds, and a given 4D
    mask replaces that one)."""
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    uses_window = window is not None and (types is None or any("sliding" in str(t) for t in types))
    if getattr(config, "use_sliding_window", True) is False:
        uses_window = False
    if uses_window and window is not None and window < seq_len:
        raise UserError(
            f"{getattr(config, 'model_type', 'this model')}: sliding-window attention "
            f"(window {window}) with packed rows of --seq-len {seq_len} is not supported; use "
            f"--seq-len <= {window} or --no-packing"
        )
