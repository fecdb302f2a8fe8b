"""Dropout in training that equals the unsharded transformers model's for the same RNG state.

Between a column-parallel projection that leaves its output split over tp and the row-parallel
projection that consumes it, a rank holds only its heads (attention probabilities
``[b, heads/tp, q, k]``) or its features (``[..., features/tp]``). transformers draws the mask
of such a dropout for the whole tensor; drawn for this rank's part only, it would be a
different mask, and every later draw would shift too. So while a split activation is live the
model's forward runs under :class:`SplitDropout`, a torch function mode that gives
``F.dropout`` (``nn.Dropout``) and ``F.scaled_dot_product_attention`` with ``dropout_p`` the
mask of the full tensor, drawn as PyTorch's CPU kernels draw it (``bernoulli_(1 - p)`` of the
full shape), and keeps this rank's chunk. Dropout on replicated activations is left alone: it
already draws what the unsharded model draws. Sequence parallelism is not covered (the
residual stream is sequence-sharded there)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..parallel import comm
from ..parallel.mesh import Group


def chunk_of_full_dropout(x: torch.Tensor, p: float, group: Group, dim: int) -> torch.Tensor:
    """Dropout of ``x``, this rank's chunk along ``dim`` of a tensor split over ``group``, with
    the mask PyTorch would draw for the full tensor."""
    full = list(x.shape)
    full[dim] *= group.size
    keep = torch.empty(full, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    return x * comm.local_chunk(keep, group, dim) / (1 - p)


def _sdpa(
    group: Group, q, k, v, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw
):
    """``F.scaled_dot_product_attention`` on this rank's heads with the dropout mask of all
    heads (the math PyTorch's reference implementation does)."""
    if kw.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    lq, lk = q.shape[-2], k.shape[-2]
    if is_causal:
        causal = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = scores.softmax(-1)
    return chunk_of_full_dropout(probs, dropout_p, group, dim=-3) @ v


class SplitDropout(TorchFunctionMode):
    """Active while the activations flowing are split over tp (from a column projection's
    output to the next row projection's input)."""

    def __init__(self, group: Group):
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            names = ("input", "p", "training", "inplace")
            a = {**dict(zip(names, args)), **kwargs}
            p, training = a.get("p", 0.5), a.get("training", True)
            if training and p > 0:
                x = a["input"]
                return chunk_of_full_dropout(x, p, self.group, dim=1 if x.dim() == 4 else -1)
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            a = {**dict(zip(names, args)), **kwargs}
            if a.get("dropout_p", 0.0) > 0:
                q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
                return _sdpa(self.group, q, k, v, **a)
        return func(*args, **kwargs)


def _drops(model: nn.Module) -> bool:
    """Whether ``model`` holds any dropout probability above 0 (modules or float attributes
    named like one, e.g. ``attention_dropout``)."""
    for mod in model.modules():
        if isinstance(mod, nn.Dropout) and mod.p > 0:
            return True
        for k, v in vars(mod).items():
            if "drop" in k and isinstance(v, float) and v > 0:
                return True
    return False


def install_split_dropout(
    model: nn.Module, group: Group, columns: list[nn.Module], rows: list[nn.Module]
) -> None:
    """In training, run from the output of a column projection in ``columns`` (split output)
    to the input of the next row projection in ``rows`` under :class:`SplitDropout` (also when
    activation recompute runs them again in backward). Nothing is installed when tp is 1 or
    the model has no dropout."""
    if group.size == 1 or not columns or not _drops(model):
        return
    active: list[SplitDropout] = []

    def enter(mod, _args, _out):
        if mod.training and not active:
            active.append(SplitDropout(group))
            active[0].__enter__()

    def leave(*_):
        if active:
            active.pop().__exit__(None, None, None)

    for c in columns:
        c.register_forward_hook(enter)
    for r in rows:
        r.register_forward_pre_hook(leave)
    model.register_forward_hook(leave, always_call=True)  # a forward that raised midway
