"""Many LoRA adapters on one parallelized model, chosen per row of a batch (serving).

A :class:`LoraBank` gives every LoRA-capable projection of a sharded model (a column-parallel
one with a split output, or a row-parallel one: the layers :mod:`neuron_tp.hf.lora` trains
LoRA on) the stacked weights of ``slots`` adapters, zero-padded to ``max_rank``:

* column base: ``A`` ``[slots * max_rank, in]`` replicated, ``B`` ``[out / tp, slots *
  max_rank]`` (this rank's rows of each adapter's ``lora_B``, the base weight's rows);
* row base: ``A`` ``[slots * max_rank, in / tp]`` (this rank's input columns), ``B`` ``[out,
  slots * max_rank]`` replicated; the LoRA partial product joins the base's before its one
  reduction (no extra collective).

peft's ``scaling`` is folded into ``B``. A step selects an adapter per batch row (an index
tensor, -1 for none): ``h = x A^T`` for every slot at once, masked to the row's slot, then
``h B^T``: two matmuls per projection whatever the mix, and the index, like the weights, is
data of the graph (:meth:`LoraBank.bound`, :meth:`LoraBank.select`): writing an adapter into a
slot (:meth:`LoraBank.write`) changes tensors, never shapes.

:func:`read_adapter` reads a PEFT adapter directory into full CPU tensors and
:meth:`LoraBank.problems` says what keeps it from this model's bank (rank, targets, shapes).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..layers import RowParallelLinear
from ..layers.quantized import Int8WeightLinear
from .lora_files import PEFT_PREFIX, SAFETENSORS, read_adapter_config
from .lora_slices import column_lora_rows, hf_out_rows, row_lora_columns
from .modules import HFColumnLinear

_BIN = "adapter_model.bin"
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])(\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class AdapterWeights:
    """A PEFT LoRA adapter read into full CPU tensors: per adapted module (its name in the
    plain transformers model), ``(A [r, in], B [out, r] * scaling)``; ``rank``: the largest
    ``r``."""

    path: str
    rank: int
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _refusals(config) -> list[str]:
    out = []
    if getattr(config, "use_dora", False):
        out.append("DoRA (use_dora) adapters")
    if getattr(config, "bias", "none") != "none":
        out.append(f"bias={config.bias!r} (trained base biases)")
    if getattr(config, "modules_to_save", None):
        out.append(f"modules_to_save {sorted(config.modules_to_save)} (full module copies)")
    if getattr(config, "target_parameters", None):
        out.append(f"target_parameters {list(config.target_parameters)}")
    return out


def _pattern(patterns: dict, module: str, default):
    """peft's per-module override (``rank_pattern`` / ``alpha_pattern``) of ``module``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _tensors(path: str) -> dict[str, torch.Tensor]:
    st, binary = os.path.join(path, SAFETENSORS), os.path.join(path, _BIN)
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise UserError(f"{path}: no {SAFETENSORS} (or {_BIN}) there: not a PEFT adapter directory")


def read_adapter(path: str) -> AdapterWeights:
    """The adapter in PEFT directory ``path``; UserError naming what is wrong when it is not a
    LoRA adapter this bank can hold."""
    if not os.path.isdir(path):
        raise UserError(f"{path}: not a directory (a PEFT adapter directory is expected)")
    config = read_adapter_config(path, what=path)
    bad = _refusals(config)
    if bad:
        raise UserError(f"{path}: {', '.join(bad)} are not supported; plain LoRA only")
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in _tensors(path).items():
        m = _KEY.match(key.removeprefix(PEFT_PREFIX))
        if m is None or t.dim() != 2:
            raise UserError(f"{path}: {key!r} is not a LoRA A/B weight of a linear projection")
        parts.setdefault(m["module"], {})[m["part"]] = t
    modules, rank = {}, 0
    for name, ab in sorted(parts.items()):
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
            raise UserError(f"{path}: {name} needs lora_A [r, in] and lora_B [out, r]")
        r = ab["A"].shape[0]
        alpha = _pattern(config.alpha_pattern, name, config.lora_alpha)
        scaling = alpha / math.sqrt(r) if config.use_rslora else alpha / r
        modules[name] = (ab["A"], ab["B"] * scaling)
        rank = max(rank, r)
    if not modules:
        raise UserError(f"{path}: the adapter holds no LoRA weights")
    return AdapterWeights(path, rank, modules)


class _Target:
    """One projection's stacked adapter weights (host copies; on the device: ``bank.tensors``)."""

    def __init__(self, name: str, base: HFColumnLinear | RowParallelLinear, slots: int, rank: int):
        self.name, self.base = name, base
        if isinstance(base, Int8WeightLinear):  # never dequantized here: its shape and dtype
            local_shape, self.dtype = tuple(base.qweight.shape), base.weight_scale.dtype
        else:
            local_shape, self.dtype = tuple(base.weight.shape), base.weight.dtype
        self.in_full = int(base.in_features)
        self.column = isinstance(base, HFColumnLinear)
        self.out_full = hf_out_rows(base) if isinstance(base, HFColumnLinear) else base.out_features
        width = slots * rank
        a_in = self.in_full if self.column else local_shape[1]
        b_out = local_shape[0] if self.column else self.out_full
        self.a = torch.zeros(width, a_in, dtype=self.dtype)
        self.b = torch.zeros(b_out, width, dtype=self.dtype)

    def local(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A, B)`` of the full pair."""
        if isinstance(self.base, HFColumnLinear):
            return a, column_lora_rows(self.base, b)
        return row_lora_columns(self.base, a), b


def lora_targets(model: nn.Module) -> dict[str, HFColumnLinear | RowParallelLinear]:
    """``{name: layer}`` of the projections a bank covers: column-parallel ones with a split
    output and row-parallel ones, outside the LM head."""
    out: dict[str, HFColumnLinear | RowParallelLinear] = {}
    for name, mod in model.named_modules():
        column = isinstance(mod, HFColumnLinear) and not mod.gather_output
        if isinstance(mod, RowParallelLinear) or column:
            if not mod.skip_bias_add:
                out[name] = mod
    return out


class LoraBank:
    """``slots`` LoRA adapters of rank at most ``max_rank`` on every projection of the
    parallelized ``model`` :func:`lora_targets` lists (hooks on those layers; they add
    nothing outside a step that :meth:`bound` and :meth:`select` them)."""

    def __init__(self, model: nn.Module, slots: int, max_rank: int):
        if slots < 1 or max_rank < 1:
            raise UserError(f"max_loras and max_lora_rank must be >= 1, got {slots}, {max_rank}")
        found = lora_targets(model)
        if not found:
            raise UserError(f"{type(model).__name__}: no column/row-parallel projection for LoRA")
        sp = [n for n, m in found.items() if m.sequence_parallel]
        if sp:
            raise UserError(f"{sp[0]}: LoRA serving needs a model without sequence parallelism")
        self.slots, self.max_rank = slots, max_rank
        self.device = next(model.parameters()).device
        self.targets = {n: _Target(n, m, slots, max_rank) for n, m in found.items()}
        self.tensors: list[torch.Tensor] = []
        self._upload()
        self._bound: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self._index: torch.Tensor | None = None
        for target in self.targets.values():
            if target.column:
                target.base.register_forward_hook(self._column_hook(target.name))
            else:
                pre = self._row_hook(target.name)
                target.base.register_forward_pre_hook(pre, with_kwargs=True)

    # -- adapters -----------------------------------------------------------------------
    def problems(self, weights: AdapterWeights) -> list[str]:
        """What keeps ``weights`` out of this bank (empty: it fits)."""
        out = []
        if weights.rank > self.max_rank:
            out.append(f"rank {weights.rank} exceeds --max-lora-rank {self.max_rank}")
        for name, (a, b) in weights.modules.items():
            t = self.targets.get(name)
            if t is None:
                leaf = name.rpartition(".")[2]
                names = sorted({n.rpartition(".")[2] for n in self.targets})
                out.append(
                    f"targets {name}, which is not a LoRA-capable projection of this model "
                    f"({leaf!r} is not among {names})"
                )
            elif a.shape[1] != t.in_full or b.shape[0] != t.out_full:
                out.append(
                    f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                    f"base projection [{t.out_full}, {t.in_full}]"
                )
        return out

    def write(self, slot: int, weights: AdapterWeights | None) -> None:
        """Put ``weights`` (None: nothing) in ``slot``, replacing what it held; no request
        may be using the slot."""
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} outside 0..{self.slots - 1}")
        bad = [] if weights is None else self.problems(weights)
        if weights is not None and bad:
            raise UserError(f"{weights.path}: " + "; ".join(bad))
        cols = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        for name, t in self.targets.items():
            t.a[cols], t.b[:, cols] = 0, 0
            if weights is not None and name in weights.modules:
                a, b = t.local(*weights.modules[name])
                r = a.shape[0]
                t.a[cols.start : cols.start + r] = a.to(t.dtype)
                t.b[:, cols.start : cols.start + r] = b.to(t.dtype)
        self._upload()

    def _upload(self) -> None:
        """The device copies of the stacks (the host ones themselves on the CPU)."""
        tensors = []
        for t in self.targets.values():
            tensors += [t.a.to(self.device), t.b.to(self.device)]
        self.tensors = tensors

    # -- in a step ----------------------------------------------------------------------
    @contextlib.contextmanager
    def bound(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """The step's own views of :attr:`tensors` (its graph arguments) while open."""
        names = list(self.targets)
        self._bound = {n: (tensors[2 * i], tensors[2 * i + 1]) for i, n in enumerate(names)}
        try:
            yield
        finally:
            self._bound = None

    @contextlib.contextmanager
    def select(self, index: torch.Tensor) -> Iterator[None]:
        """Each batch row adds the adapter in slot ``index[row]`` (-1: none) while open."""
        if self._bound is None:
            raise RuntimeError("LoraBank.select outside LoraBank.bound")
        self._index = index
        try:
            yield
        finally:
            self._index = None

    def _delta(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The rows' LoRA output for input ``x`` (``[rows, ...]`` or flattened ``[rows *
        positions, in]``) of projection ``name``."""
        assert self._bound is not None and self._index is not None
        a, b = self._bound[name]
        index = self._index.reshape(-1)
        rows = index.shape[0]
        h = F.linear(x.reshape(rows, -1, x.shape[-1]).to(a.dtype), a)
        slot_of = torch.arange(a.shape[0], device=h.device) // self.max_rank
        h = h * (index[:, None] == slot_of[None, :]).to(h.dtype)[:, None, :]
        return F.linear(h, b).reshape(*x.shape[:-1], b.shape[0]).to(x.dtype)

    def _column_hook(self, name: str):
        def hook(_mod, args, out):
            if self._index is None:
                return None
            return out + self._delta(name, args[0])

        return hook

    def _row_hook(self, name: str):
        def hook(_mod, args, kwargs):
            if self._index is None:
                return None
            return args, {**kwargs, "partial_addend": lambda x: self._delta(name, x)}

        return hook
