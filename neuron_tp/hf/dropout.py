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

import contextlib
import math
import threading
from collections.abc import Sequence

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


def split_features_dropout(drop: nn.Module, x: torch.Tensor, group: Group) -> torch.Tensor:
    """``drop(x)`` for ``x`` this rank's features (last dim) of a tensor split over ``group``
    (a LoRA adapter's input next to its row-parallel base): an ``nn.Dropout`` in training
    draws the full tensor's mask."""
    if isinstance(drop, nn.Dropout) and drop.training and drop.p > 0 and group.size > 1:
        return chunk_of_full_dropout(x, drop.p, group, dim=-1)
    return drop(x)


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
    """Active while the activations flowing are split over tp: ``kind`` "features" (from a
    column projection's output to the next row projection's input: heads or features) or
    "sequence" (the residual stream of a decoder layer under sequence parallelism)."""

    def __init__(self, group: Group):
        super().__init__()
        self.group, self.kind, self.off = group, "features", False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.off:
            return func(*args, **kwargs)
        if func is F.dropout:
            names = ("input", "p", "training", "inplace")
            a = {**dict(zip(names, args)), **kwargs}
            p, training = a.get("p", 0.5), a.get("training", True)
            if training and p > 0:
                x = a["input"]
                dim = 1 if self.kind == "sequence" or x.dim() == 4 else -1
                return chunk_of_full_dropout(x, p, self.group, dim=dim)
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


_state = threading.local()  # this thread's active SplitDropout (XLA CPU ranks are threads)


def _stack() -> list:
    return [torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack())]


def _active() -> SplitDropout | None:
    """This thread's split-dropout mode if it is on the torch function mode stack (autograd
    restores the forward's stack around the backward nodes that run a recompute)."""
    mode = getattr(_state, "mode", None)
    if mode is not None and not any(m is mode for m in _stack()):
        mode = _state.mode = None
    return mode


def _activate(group: Group, kind: str) -> bool:
    """Run under a :class:`SplitDropout` of ``kind`` from now; True if it was not active."""
    mode = _active()
    started = mode is None
    if mode is None:
        mode = _state.mode = SplitDropout(group)
        mode.__enter__()
    mode.kind = kind
    return started


def _deactivate(*_) -> None:
    mode = _active()
    if mode is not None:
        _state.mode = None
        if _stack()[-1] is mode:
            mode.__exit__(None, None, None)
        else:  # a mode entered after it is still on top: leave it there, inert
            mode.off = True


@contextlib.contextmanager
def replicated_input():
    """Inside: dropout as plain dropout (on a replicated tensor read while split activations
    are live, e.g. a LoRA adapter's input next to its column-parallel base)."""
    mode = _active()
    if mode is None:
        yield
        return
    before, mode.off = mode.off, True
    try:
        yield
    finally:
        mode.off = before


def resumable(fn):
    """``fn`` (a function activation recompute runs again in backward) that runs under the
    split-dropout state active now, so the recompute draws the forward's masks."""
    mode = _active()
    if mode is None:
        return fn
    group, kind = mode.group, mode.kind

    def run(*args, **kwargs):
        started = _activate(group, kind)
        try:
            return fn(*args, **kwargs)
        finally:
            if started:
                _deactivate()

    return run


def install_split_dropout(
    model: nn.Module,
    group: Group,
    columns: Sequence[nn.Module],
    rows: Sequence[nn.Module],
    sequence_end: nn.Module | None = None,
) -> None:
    """In training, run under :class:`SplitDropout` from the output of a column projection in
    ``columns`` (split output) to the input of the next row projection in ``rows``; with
    sequence parallelism (``sequence_end``: the final norm, after which the sequence is whole
    again) from there on as "sequence" until the next column projection or the end. Nothing
    is installed when tp is 1 or the model has no dropout."""
    if group.size == 1 or not columns or not _drops(model):
        return

    def column_out(mod, _args, _out):
        if mod.training:
            _activate(group, "features")

    def row_in(mod, _args):
        if sequence_end is not None and _active() is not None:
            _activate(group, "sequence")
        else:
            _deactivate()

    for c in columns:
        c.register_forward_hook(column_out)
    for r in rows:
        r.register_forward_pre_hook(row_in)
    if sequence_end is not None:
        sequence_end.register_forward_hook(_deactivate, always_call=True)
    model.register_forward_pre_hook(_deactivate)
    model.register_forward_hook(_deactivate, always_call=True)  # a forward that raised midway
