"""Stand-in (issue 24, "sft" branch) for the model side of packed batches: the "attn" branch
owns this module and replaces it with the block-diagonal attention built from
``segment_ids``. This version passes only ``input_ids`` and ``labels``."""

from __future__ import annotations

import torch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments of the model's forward for a batch dict of
    :meth:`neuron_tp.job.data.RowData.next_batch`."""
    return {"input_ids": batch["input_ids"], "labels": batch["labels"]}
