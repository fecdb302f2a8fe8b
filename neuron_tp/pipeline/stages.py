"""Cutting a (parallelized) transformers decoder model into pipeline stages.

The model is cut by its decoder layers into ``stages x virtual`` pieces (virtual stage ``j``
on stage ``j % stages``, its chunk ``j // stages``): evenly, at given cut points, or balanced
by parameter count (the embedding counted on the first piece, the final norm and LM head on the
last). Each rank keeps the layers of its own pieces under their original names
(``model.layers.<i>...``, so checkpoints read as at pp 1), the embedding on the first stage and
the final norm + LM head on the last. The rotary embedding holds no parameters: every stage
keeps it and computes the cos/sin of the positions itself instead of receiving them.

Tied embeddings (LM head = embedding table): the first and the last stage each keep the table;
:func:`sum_tied_grads` sums their gradients over the pp group (other stages add zeros), so both
copies take the same optimizer step and stay equal; the last stage's copy counts zero in the
global gradient norm (``distinct_row_weights``), each element once.

MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) are cut the same way: an MoE decoder layer is a
layer like any other, its experts sharded over tp as at pp 1. Their router load-balancing loss
(``output_router_logits``), a product of means over the routing of every layer of the model, is
summed over the stages by the runner (:mod:`neuron_tp.pipeline.router_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..errors import UserError
from ..hf.attention import SEGMENTS_KW
from ..hf.parallelize_nd import logits_layout
from ..layers import cross_entropy_nd, parallel_cross_entropy, split_input
from ..layers.activation_layout import LAYOUT_3D_B, residual_layout
from ..parallel import comm
from ..parallel.mesh import Mesh
from ..parallel.state import ParallelState, StageOfModel, attach, state_of

if TYPE_CHECKING:
    # One of the SUPPORTED causal LMs, read by its transformers attribute names (``.model.
    # embed_tokens``, ``.model.layers``, ``.lm_head``, ``.config``): transformers is not
    # analysed (pyproject), so this is a documented dynamic boundary.
    from transformers import PreTrainedModel

SUPPORTED = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclass(frozen=True)
class StagePlan:
    """``bounds[j]``: the decoder layers ``[start, stop)`` of virtual stage ``j``."""

    stages: int
    virtual: int
    bounds: tuple[tuple[int, int], ...]

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def layers(self, stage: int, chunk: int) -> range:
        return range(*self.bounds[self.virtual_stage(stage, chunk)])

    def describe(self) -> str:
        return ", ".join(
            f"stage {j % self.stages}"
            + (f" chunk {j // self.stages}" if self.virtual > 1 else "")
            + f": layers {a}-{b - 1}"
            for j, (a, b) in enumerate(self.bounds)
        )


def _balanced(weights: list[float], parts: int) -> list[int]:
    """Cut points (``parts - 1`` of them) of ``weights`` into contiguous non-empty parts with
    the smallest largest part (dynamic programme)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for a in range(k - 1, i):
                cost = max(best[k - 1][a], prefix[i] - prefix[a])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, a
    points, i = [], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        points.append(i)
    return sorted(points)[1:]


def plan_stages(
    num_layers: int,
    stages: int,
    virtual: int = 1,
    *,
    cuts: list[int] | None = None,
    layer_params: int | None = None,
    first_params: int = 0,
    last_params: int = 0,
) -> StagePlan:
    """Where each virtual stage starts and ends. ``cuts``: the first layer of every piece but
    the first; else, with ``layer_params``, balanced by parameters (``first_params`` on the
    first piece, ``last_params`` on the last); else an even split."""
    parts = stages * virtual
    if num_layers < parts:
        raise UserError(
            f"{num_layers} decoder layers cannot fill {stages} stages x {virtual} chunk(s): "
            f"pp x virtual stages must be at most {num_layers}"
        )
    if cuts is not None:
        if (
            len(cuts) != parts - 1
            or list(cuts) != sorted(set(cuts))
            or not (0 < cuts[0] and cuts[-1] < num_layers)
        ):
            raise UserError(
                f"cut points {cuts} must be {parts - 1} increasing layer indices in 1.."
                f"{num_layers - 1} (one per boundary of {parts} pieces)"
            )
        points = list(cuts)
    elif layer_params is not None:
        weights = [float(layer_params)] * num_layers
        weights[0] += first_params
        weights[-1] += last_params
        points = _balanced(weights, parts)
    else:
        if num_layers % parts:
            valid = [d for d in range(1, num_layers + 1) if num_layers % (d * virtual) == 0]
            raise UserError(
                f"{num_layers} decoder layers do not split evenly into pp={stages} x "
                f"virtual stages {virtual}; valid pp at {virtual} virtual stage(s): {valid} "
                "(or give cut points)"
            )
        points = [num_layers // parts * k for k in range(1, parts)]
    edges = [0, *points, num_layers]
    return StagePlan(stages, virtual, tuple(zip(edges[:-1], edges[1:])))


@dataclass
class PipelineStage:
    """This rank's part of the model: ``model`` holds only its parameters (for the optimizer,
    checkpoints); ``chunks`` run through :meth:`forward`."""

    model: PreTrainedModel  # one of SUPPORTED, its own layers only
    plan: StagePlan
    stage: int
    mesh: Mesh
    tied_shape: tuple[int, ...] | None  # the (sharded) tied table's shape, or None

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.plan.stages - 1

    def is_last_piece(self, chunk: int) -> bool:
        return self.plan.virtual_stage(self.stage, chunk) == len(self.plan.bounds) - 1

    def is_first_piece(self, chunk: int) -> bool:
        return self.plan.virtual_stage(self.stage, chunk) == 0

    def boundary_shape(
        self, batch: int, seq: int, sequence_parallel: bool | None = None
    ) -> tuple[int, int, int]:
        """The hidden states this rank sends and receives at a boundary: ``[b, s, h]``, the
        sequence shard ``[b, s/tp, h]`` under ``sequence_parallel``."""
        hidden = self.model.config.hidden_size
        if self.mesh.tp_mode != "1d":  # the 2D / 3D residual layout: [b/nb, s, h/nf]
            layout = residual_layout(self.mesh.tp_mode)
            nb, nf = layout.batch_split(self.mesh), layout.feature_split(self.mesh)
            return (batch // nb, seq, hidden // nf)
        tp = self.mesh.tp_size
        local = seq // tp if sequence_parallel else seq
        return (batch, local, hidden)

    def check_inputs(self, micro_batches: Sequence[dict]) -> None:
        """UserError for micro-batches this stage cannot run (decoder models run them all)."""

    def forward(
        self,
        chunk: int,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        segment_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Piece ``chunk`` of this stage: token ids (first piece) or the previous piece's hidden
        states in; hidden states out, or the (vocab-sharded) logits on the last piece.
        ``position_ids`` ``[1 or b, s]``; ``attention_mask``: a 4D additive mask (packed rows,
        :func:`neuron_tp.hf.packing.block_causal_mask`), None: causal; or, for blockwise and
        ring attention, packed rows as ``segment_ids`` ``[b, S]`` instead (no mask built). At
        cp > 1 (ring attention) ``x`` and ``position_ids`` are this rank's part of the sequence
        and ``segment_ids`` the global ones."""
        inner = self.model.model
        if self.mesh.tp_mode != "1d":
            x, position_ids, attention_mask = self._batch_chunk(
                chunk, x, position_ids, attention_mask
            )
        h = inner.embed_tokens(x) if self.is_first_piece(chunk) else x
        packed = {} if segment_ids is None else {SEGMENTS_KW: segment_ids}
        masked = segment_ids is not None or self.mesh.cp_size > 1  # by segment / ring: no mask
        mask = None if masked else self._mask(h, position_ids, attention_mask)
        cos_sin = inner.rotary_emb(h, position_ids=position_ids)
        for i in self.plan.layers(self.stage, chunk):
            out = inner.layers[str(i)](
                h,
                attention_mask=mask,
                position_ids=position_ids,
                position_embeddings=cos_sin,
                **packed,
            )
            h = out[0] if isinstance(out, tuple) else out
        if not self.is_last_piece(chunk):
            return h
        return self.model.lm_head(inner.norm(h))

    def _mask(self, h, position_ids, attention_mask):
        """transformers' causal mask for the layers (a given 4D mask comes back as it is)."""
        from transformers.masking_utils import create_causal_mask

        b, s = h.shape[0], position_ids.shape[-1]  # the full sequence (h: a shard under SP)
        proxy = torch.zeros(b, s, 1, dtype=h.dtype, device=h.device)  # only its shape is read
        return create_causal_mask(
            config=self.model.config,
            inputs_embeds=proxy,
            attention_mask=attention_mask,
            past_key_values=None,
            position_ids=position_ids,
        )

    def _batch_chunk(self, chunk: int, x, position_ids, attention_mask):
        """2D / 3D: this rank's batch chunk of the ids (first piece; later pieces receive the
        residual stream's chunk), of per-sample positions and of a per-sample mask (3D: the
        chunk of q/k/v, ``3d-b``, as :func:`neuron_tp.hf.parallelize_nd.parallelize_nd`)."""
        mode = self.mesh.tp_mode
        if self.is_first_piece(chunk):
            x = split_input(x, residual_layout(mode), self.mesh, feature_dim=False)
        attn = self.mesh.group((LAYOUT_3D_B if mode == "3d" else residual_layout(mode)).batch_group)
        if position_ids.shape[0] > 1:
            position_ids = comm.local_chunk(position_ids, attn, 0)
        if attention_mask is not None and attention_mask.shape[0] > 1:
            attention_mask = comm.local_chunk(attention_mask, attn, 0)
        return x, position_ids, attention_mask

    def loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The sum of the token losses of one micro-batch; ``targets``: the token each
        position predicts (the labels shifted by one: HF's causal shift), -100: none."""
        labels = targets.to(logits.device)
        if self.mesh.tp_mode != "1d":  # this rank's block of the logits: its labels' chunk
            layout = logits_layout(self.mesh)
            local = split_input(labels, layout, self.mesh, feature_dim=False)
            vocab = self.model.lm_head.vocab_size
            return cross_entropy_nd(
                logits, local, layout, self.mesh, reduction="sum", vocab_size=vocab
            )
        return self.token_losses(logits, labels, "sum")

    def token_losses(
        self, logits: torch.Tensor, targets: torch.Tensor, reduction: str = "none"
    ) -> torch.Tensor:
        """The token losses ``[b, s]`` of the last piece's logits (``--tp-mode 1d``; 0 where
        the target is -100), or their sum."""
        labels = targets.to(logits.device)
        if getattr(self.model.lm_head, "gather_output", True) and self.mesh.tp_size > 1:
            flat = logits.float().reshape(-1, logits.shape[-1])
            out = nn.functional.cross_entropy(flat, labels.reshape(-1), reduction=reduction)
            return out if reduction == "sum" else out.view(labels.shape)
        vocab = self.model.config.vocab_size
        return parallel_cross_entropy(
            logits, labels, mesh=self.mesh, vocab_size=vocab, reduction=reduction
        )


def _check_model(model: nn.Module) -> None:
    name = type(model).__name__
    inner = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if name not in SUPPORTED or inner is None or not all(hasattr(inner, a) for a in parts):
        raise UserError(
            f"pipeline parallelism cuts {', '.join(SUPPORTED)} models by their decoder layers; "
            f"{name} is not one of them (train it with --pp 1)"
        )


def sliding_window(hf_config) -> int | None:
    """The model's attention window (None: it attends over the whole sequence)."""
    window = getattr(hf_config, "sliding_window", None)
    return window if window and getattr(hf_config, "use_sliding_window", True) else None


def split_model(model: PreTrainedModel, mesh: Mesh, plan: StagePlan) -> PipelineStage:
    """Keep this rank's stage of ``model`` (in place; parallelize it first): its layers, the
    embedding on the first stage, the final norm and LM head on the last."""
    _check_model(model)
    stage, p = mesh.pp.rank, mesh.pp_size
    if plan.stages != p:
        raise ValueError(f"the stage plan has {plan.stages} stages but the mesh pp={p}")
    inner = model.model
    n = len(inner.layers)
    if plan.bounds[-1][1] != n:
        raise ValueError(f"the stage plan covers {plan.bounds[-1][1]} layers, the model has {n}")
    table = inner.embed_tokens.weight
    tied = model.lm_head.weight is table and table.requires_grad  # (LoRA: a frozen table)
    tied_shape = tuple(table.shape) if tied and p > 1 else None
    whole = {id(prm): n for n, prm in model.named_parameters()}
    mine = [i for c in range(plan.virtual) for i in plan.layers(stage, c)]
    inner.layers = nn.ModuleDict({str(i): inner.layers[i] for i in mine})
    if stage != 0:
        inner.embed_tokens = None
    if stage != p - 1:
        inner.norm = None
        model.lm_head = None
    elif tied_shape is not None:  # counted once in the norm: on the first stage
        rows = table.shape[0]
        model.lm_head.distinct_row_weights = lambda _name: torch.zeros(rows)
    _record_stage(model, mesh, tuple(whole.values()), whole[id(table)] if tied_shape else None)
    return PipelineStage(model, plan, stage, mesh, tied_shape)


def _record_stage(
    model: PreTrainedModel, mesh: Mesh, whole: tuple[str, ...], table: str | None
) -> None:
    """Record on the stage's ``model`` what it is of the whole model (checkpoints save each
    parameter under its whole-model name, a tied table once: by the first stage)."""
    copies: tuple[tuple[str, str], ...] = ()
    if table is not None and model.lm_head is not None and table != "lm_head.weight":
        copies = (("lm_head.weight", table),)
    state = state_of(model) or ParallelState(mesh)
    attach(model, state.with_stage(StageOfModel(whole, copies)))


def tied_param(stage: PipelineStage) -> nn.Parameter | None:
    """This stage's copy of the tied table (first or last stage), else None."""
    if stage.first:
        return stage.model.model.embed_tokens.weight
    if stage.last:
        return stage.model.lm_head.weight
    return None


def sum_tied_grads(stage: PipelineStage) -> None:
    """Sum the tied table's gradients of the first and last stage over the pp group, in place
    (a no-op for untied models and at pp 1). Collective over pp: every stage calls it."""
    if stage.tied_shape is None:
        return
    param = tied_param(stage)
    if param is None:
        dev = next(stage.model.parameters()).device
        dtype = next(stage.model.parameters()).dtype
        grad = torch.zeros(stage.tied_shape, dtype=dtype, device=dev)
    else:
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
    total = comm.all_reduce(grad, stage.mesh.pp)
    if param is not None:
        param.grad = total
