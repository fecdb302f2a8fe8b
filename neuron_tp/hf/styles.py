"""The vocabulary of tensor-parallel plans: the :class:`Style` of one module, the
:class:`ArchPlan` of an architecture family (:mod:`neuron_tp.hf.plans` holds them) and the
:class:`ModelStructure` of one model (:mod:`neuron_tp.hf.resolve` reads it)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum


class Style(str, Enum):
    """How one module is sharded; the value is its name in ``plan=`` dicts."""

    # Output features split (q/k/v projections per attention head; GQA key/value heads that
    # tp does not divide are replicated on as few ranks as needed).
    COLUMN = "colwise"
    # Column, the full output gathered (the LM head: vocab padded to a multiple of tp; with
    # ``parallel_loss`` it stays vocab-sharded).
    COLUMN_GATHER_OUTPUT = "colwise_gather_output"
    # Input features split, partial outputs summed.
    ROW = "rowwise"
    # The same for a replicated input (it is split first).
    ROW_SPLIT_INPUT = "rowwise_split_input"
    # Two packed projections (gate_up) split per half.
    COLUMN_PACKED = "packed_colwise"
    # A fused ``[q | k | v]`` projection split per head of each part.
    COLUMN_PACKED_QKV = "packed_qkv"
    # CodeGen's fused qkv: 4 blocks of ``[q | v | k]`` (neuron_tp.hf.grouped_qkv).
    COLUMN_GROUPED_QKV = "grouped_qkv"
    # Vocabulary-parallel embedding.
    VOCAB_EMBEDDING = "embedding_rowwise"
    # Kept whole, gradients summed over tp after backward (Qwen3's per-head q/k norms).
    REPLICATED_GRAD_ALLREDUCE = "replicated_with_grad_allreduce"
    # An RMSNorm over features sharded like the preceding projection (OLMo-2's q/k norms).
    SHARDED_NORM = "sharded_norm"
    # The fused experts of an MoE block (planned on ``<block>.experts``): the whole block is
    # replaced by neuron_tp.moe.ParallelMoEBlock (router replicated, experts and shared
    # experts split by their intermediate dimension, one reduction per layer).
    MOE_EXPERTS = "moe_tp_experts"

    @property
    def is_column(self) -> bool:
        """Split by output features (a column-parallel linear)."""
        return self in _COLUMN

    @property
    def splits_output(self) -> bool:
        """Its output stays split over tp: a row-parallel projection must consume it."""
        return self in (
            Style.COLUMN,
            Style.COLUMN_PACKED,
            Style.COLUMN_PACKED_QKV,
            Style.COLUMN_GROUPED_QKV,
        )


_COLUMN = (
    Style.COLUMN,
    Style.COLUMN_GATHER_OUTPUT,
    Style.COLUMN_PACKED,
    Style.COLUMN_PACKED_QKV,
    Style.COLUMN_GROUPED_QKV,
)
STYLES = tuple(s.value for s in Style)  # the names ``plan=`` accepts


@dataclass(frozen=True)
class ArchPlan:
    """The explicit plan of one architecture family.

    Paths are dotted module names. ``layers``, ``embedding`` and ``final_norm`` are relative to
    the base model (``model.model`` of a ``LlamaForCausalLM``; the model itself when it is a
    base model); ``attention``, ``mlp``, ``prepares_input`` and the keys of ``layer_styles``
    are relative to one decoder layer; ``lm_head`` is relative to the model with a head.
    """

    layers: str  # the ModuleList of decoder layers (sequence parallelism scatters before it)
    embedding: str  # sharded as Style.VOCAB_EMBEDDING
    attention: str  # its column projections are split per head; its head counts are patched
    mlp: str | None  # None: the MLP projections sit in the decoder layer itself (OPT)
    # Modules whose forward pre-hook copies (or, with sequence parallelism, all-gathers) their
    # input once for all their column projections; other column projections do it themselves.
    prepares_input: tuple[str, ...]
    final_norm: str | None  # sequence parallelism gathers the sequence after it; None: none
    layer_styles: dict[str, Style]  # projection (or norm) -> style
    lm_head: str = "lm_head"  # sharded as Style.COLUMN_GATHER_OUTPUT when the model has it
    unsupported: str | None = None  # why this configuration is refused unless plan= is given
    # Keys of ``layer_styles`` some layers lack (MoE models mixing dense-MLP and MoE layers).
    optional: tuple[str, ...] = ()

    def with_styles(self, layer_styles: dict[str, Style]) -> ArchPlan:
        """This plan with more (or other) per-layer styles."""
        return replace(self, layer_styles={**self.layer_styles, **layer_styles})


@dataclass(frozen=True)
class ModelStructure:
    """Where the modules the patcher hooks into are in one model (full module names), read
    from an :class:`ArchPlan` or guessed (:func:`neuron_tp.hf.fallback.guess_structure`)."""

    source: str  # where it comes from, for error messages
    layers: str | None  # the decoder-layer ModuleList
    final_norm: str | None
    lm_head: str | None
    attention: frozenset[str]  # modules whose column children are split per head
    prepares_input: frozenset[str]  # modules that prepare their column children's input
    units: frozenset[str]  # attention / MLP modules: split outputs made inside are used inside

    def in_layers(self, name: str) -> bool:
        """``name`` is inside the decoder-layer list."""
        return self.layers is not None and name.startswith(self.layers + ".")
