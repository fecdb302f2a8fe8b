"""Persistent buffers in a checkpoint (e.g. a GLM-4-MoE / DeepSeek-V3 router's
``e_score_correction_bias``): state a model keeps outside its parameters that transformers
saves with them.

They are replicated (every rank holds the whole buffer, equal on every rank), so tp rank 0's
shard file stores them once, as ``buffer/<name>``, and ``meta.json`` lists them under
``buffers`` (shape, dtype). A checkpoint written before buffers were saved has no ``buffers``
entry: loading it leaves the model's buffers as they are.
"""

from __future__ import annotations

import torch

from .format import CheckpointError

PREFIX = "buffer/"


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every buffer of ``model`` that belongs in its state dict."""
    from ..hf.saving import persistent_buffers as found

    return found(model)


def buffer_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers as checkpoint tensors (``buffer/<name>``, on the host)."""
    return {PREFIX + n: b.detach().cpu().contiguous() for n, b in persistent_buffers(model)}


def buffer_meta(model: torch.nn.Module) -> dict[str, dict]:
    """``{name: {"shape", "dtype"}}`` of the persistent buffers, for ``meta.json``."""
    return {
        n: {"shape": list(b.shape), "dtype": str(b.dtype).replace("torch.", "")}
        for n, b in persistent_buffers(model)
    }


def read_buffers(
    get, meta: dict, model: torch.nn.Module, path: str, part: bool = False
) -> dict[str, torch.Tensor]:
    """The saved value of each persistent buffer of ``model`` (``get(key)`` reads tp rank 0's
    tensor ``key``), checked against the model: the same names and shapes (``part``: a
    pipeline stage's model, holding some of the saved buffers). Empty for a checkpoint that
    saved no buffers."""
    saved = meta.get("buffers")
    if saved is None:
        return {}
    mine = dict(persistent_buffers(model))
    missing = sorted(set(mine) - set(saved))
    unexpected = [] if part else sorted(set(saved) - set(mine))
    if missing or unexpected:
        raise CheckpointError(
            f"{path} does not match the model: buffers missing from the checkpoint "
            f"{missing[:5]}, not in the model {unexpected[:5]}"
        )
    out = {}
    for name, b in mine.items():
        t = get(PREFIX + name)
        if tuple(t.shape) != tuple(b.shape):
            raise CheckpointError(
                f"{path}: buffer {name} has shape {tuple(t.shape)}, the model's is {tuple(b.shape)}"
            )
        out[name] = t
    return out


def apply_buffers(model: torch.nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy ``values`` (from :func:`read_buffers`) into the model's buffers, in place."""
    if not values:
        return
    with torch.no_grad():
        for name, b in persistent_buffers(model):
            b.copy_(values[name].to(b.dtype))
