"""Pipeline stages of a model built from the layer library's blocks.

A stack of blocks (``neuron_tp.blocks.TransformerBlock`` over the 1D tp group, with or without
sequence parallelism, or ``TransformerBlockND`` over a 2D / 3D mesh), with the library's
vocab-parallel embedding before it and a head (final norm + vocab-parallel classifier) after
it, is cut by blocks into ``stages x virtual`` pieces as :func:`~.stages.split_model` cuts a
transformers decoder: the embedding on the first piece, the head and the loss on the last. The
result is a :class:`~.stages.PipelineStage`, so :class:`~.runner.PipelineRunner` trains it with
the same schedules.

What crosses a stage boundary is the residual stream in the blocks' own layout
(``input_layout``): ``[b, s, h]`` replicated over tp, ``[b, s/tp, h]`` under sequence
parallelism, ``[b/q, s, h/q]`` on a 2D mesh, ``[b/q^2, s, h/q]`` on a 3D one (2D/3D: the
activation layout, :func:`neuron_tp.blocks.block_layout`). The loss follows the layout of the
classifier's logits: the vocab-parallel cross-entropy for 1D vocab-sharded logits,
:func:`~neuron_tp.layers.cross_entropy_nd` for 2D/3D ones (on this rank's batch shard of the
labels), plain cross-entropy for gathered ones; any other through ``loss=``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from ..errors import UserError
from ..layers import cross_entropy_nd, parallel_cross_entropy, split_input
from ..layers.activation_layout import (
    REPLICATED,
    SHARDED_FEATURES,
    SHARDED_SEQUENCE,
    ActivationLayout,
)
from ..parallel.mesh import Mesh
from .stages import PipelineStage, StagePlan

LossSum = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(logits, labels) -> the sum of the micro-batch's token losses`` (equal on every tp rank);
``labels`` are the full micro-batch's, already shifted (position t holds token t + 1)."""


class BlockStack(nn.Module):
    """This rank's part of a block model: ``embedding`` (first stage), ``blocks`` (its own,
    under their index in the whole stack), ``head`` (last stage)."""

    def __init__(self, embedding: nn.Module | None, blocks: dict, head: nn.Module | None):
        super().__init__()
        self.embedding = embedding
        self.blocks = nn.ModuleDict(blocks)
        self.head = head


@dataclass
class BlockStage(PipelineStage):
    """A :class:`PipelineStage` of a :class:`BlockStack`: ``residual`` is the blocks' layout,
    ``hidden`` the residual stream's full width, ``loss`` the last piece's loss sum."""

    residual: str | ActivationLayout = REPLICATED
    hidden: int = 0
    loss: LossSum | None = None

    def boundary_shape(
        self, batch: int, seq: int, sequence_parallel: bool | None = None
    ) -> tuple[int, int, int]:
        """The shape this rank sends and receives at a boundary: the residual stream's block.
        ``sequence_parallel`` (the runner's): None, or what the blocks do."""
        sp = self.residual == SHARDED_SEQUENCE
        if sequence_parallel is not None and sequence_parallel != sp:
            raise ValueError(
                f"the runner was told sequence_parallel={sequence_parallel}, but the blocks' "
                f"residual stream is {self.residual}"
            )
        tp = self.mesh.tp_size
        if isinstance(self.residual, ActivationLayout):
            nb, nf = self.residual.batch_split(self.mesh), self.residual.feature_split(self.mesh)
            if batch % nb or self.hidden % nf:
                raise UserError(
                    f"the {self.residual} layout splits the micro-batch by {nb} and the hidden "
                    f"size by {nf}: micro-batch {batch} / hidden {self.hidden} must be multiples"
                )
            return (batch // nb, seq, self.hidden // nf)
        if sp and seq % tp:
            raise UserError(f"sequence parallelism needs seq {seq} divisible by tp {tp}")
        return (batch, seq // tp if sp else seq, self.hidden)

    def check_inputs(self, micro_batches: Sequence[dict]) -> None:
        """Blocks attend causally over the whole row: packed rows (a mask) are refused."""
        if any("segment_ids" in b or "attention_mask" in b for b in micro_batches):
            raise UserError(
                "library blocks attend causally over the whole row: packed rows or an "
                "attention mask cannot run through them; give plain [batch, seq] rows"
            )

    def forward(
        self,
        chunk: int,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Piece ``chunk``: token ids ``[b, s]`` (first piece: this rank's batch shard goes
        through the embedding) or the residual stream in; the residual stream out (a plain
        tensor), or the logits on the last piece. ``position_ids`` are not read (the blocks
        hold no position embedding)."""
        del position_ids
        if attention_mask is not None or segment_ids is not None:
            raise UserError("library blocks take no attention mask (see check_inputs)")
        model = cast(BlockStack, self.model)
        if self.is_first_piece(chunk):
            assert model.embedding is not None  # the first stage keeps it
            layout = _layout(model.embedding, "output_layout")
            if isinstance(layout, ActivationLayout):
                x = split_input(x, layout, self.mesh, feature_dim=False)
            x = model.embedding(x)
        for i in self.plan.layers(self.stage, chunk):
            x = model.blocks[str(i)](x)
        if self.is_last_piece(chunk):
            assert model.head is not None  # the last stage keeps it
            return model.head(x)
        return x.as_subclass(torch.Tensor)  # the layout tag stays on this side of the wire

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The sum of the micro-batch's token losses; ``targets``: the token each position
        predicts (the labels shifted by one), ``-100``: none."""
        assert self.loss is not None  # stages_of_blocks sets it
        return self.loss(logits, targets.to(logits.device))


def _layout(module: nn.Module, which: str) -> str | ActivationLayout:
    """``module``'s ``input_layout`` / ``output_layout``, or that of the first / last of its
    submodules that states one (an ``nn.Sequential`` head)."""
    found = [getattr(m, which) for m in module.modules() if hasattr(m, which)]
    if not found:
        raise UserError(f"{type(module).__name__} states no {which} (use the library's layers)")
    return cast(str | ActivationLayout, found[0] if which == "input_layout" else found[-1])


def _classifier(head: nn.Module) -> nn.Module:
    return [m for m in head.modules() if hasattr(m, "output_layout")][-1]


def default_loss(head: nn.Module, mesh: Mesh) -> LossSum:
    """The loss sum for the logits of ``head``'s classifier, by their layout."""
    classifier = _classifier(head)
    layout = _layout(classifier, "output_layout")
    vocab = cast(int, getattr(classifier, "vocab_size", None) or classifier.out_features)
    if layout == SHARDED_FEATURES:
        return lambda z, y: parallel_cross_entropy(z, y, mesh, vocab_size=vocab, reduction="sum")
    if layout == REPLICATED:
        return lambda z, y: nn.functional.cross_entropy(
            z.float().reshape(-1, z.shape[-1]), y.reshape(-1), reduction="sum"
        )
    if isinstance(layout, ActivationLayout):
        return lambda z, y: cross_entropy_nd(
            z,
            split_input(y, layout, mesh, feature_dim=False),
            layout,
            mesh,
            vocab_size=vocab,
            reduction="sum",
        )
    raise UserError(
        f"no built-in loss for logits in layout {layout}: give loss=(logits, labels) -> sum"
    )


def _check_layouts(blocks: Sequence[nn.Module], embedding: nn.Module, head: nn.Module) -> None:
    """UserError unless the embedding, every block and the head agree on the residual layout."""
    seen = [("embedding output", _layout(embedding, "output_layout"))]
    for i, b in enumerate(blocks):
        seen += [(f"block {i} input", _layout(b, "input_layout"))]
        seen += [(f"block {i} output", _layout(b, "output_layout"))]
    seen.append(("head input", _layout(head, "input_layout")))
    bad = [f"{what}: {lay}" for what, lay in seen if lay != seen[0][1]]
    if bad:
        raise UserError(
            "the residual stream must have one layout from the embedding through every block "
            f"into the head ({seen[0][1]} at the embedding's output); differs at: " + ", ".join(bad)
        )


def stages_of_blocks(
    blocks: Sequence[nn.Module],
    mesh: Mesh,
    plan: StagePlan,
    *,
    embedding: nn.Module,
    head: nn.Module,
    loss: LossSum | None = None,
) -> BlockStage:
    """This rank's stage of the model ``embedding -> blocks -> head`` (the whole model built
    on every rank, as for :func:`~.stages.split_model`; the stage keeps only its own parts).

    ``embedding``: ids ``[b, s]`` to the residual stream (``VocabParallelEmbedding``,
    ``Embedding2D`` / ``Embedding3D``: it takes its batch shard); ``head``: the residual
    stream to logits (e.g. ``nn.Sequential(final_norm, classifier)``); ``loss``: see
    :data:`LossSum` (default: :func:`default_loss`). Tied embeddings are not supported."""
    stage, p = mesh.pp.rank, mesh.pp_size
    if plan.stages != p:
        raise ValueError(f"the stage plan has {plan.stages} stages but the mesh pp={p}")
    if plan.bounds[-1][1] != len(blocks):
        raise UserError(
            f"the stage plan covers {plan.bounds[-1][1]} blocks, the stack has {len(blocks)}"
        )
    _check_layouts(blocks, embedding, head)
    head_params = {id(q) for q in head.parameters()}
    if any(id(q) in head_params for q in embedding.parameters()):
        raise UserError("stages_of_blocks does not support a head tied to the embedding")
    hidden = getattr(embedding, "embedding_dim", None)
    if hidden is None:
        raise UserError(f"{type(embedding).__name__} states no embedding_dim")
    mine = {str(i): blocks[i] for c in range(plan.virtual) for i in plan.layers(stage, c)}
    model = BlockStack(embedding if stage == 0 else None, mine, head if stage == p - 1 else None)
    return BlockStage(
        model,
        plan,
        stage,
        mesh,
        None,
        residual=_layout(embedding, "output_layout"),
        hidden=hidden,
        loss=loss or default_loss(head, mesh),
    )
