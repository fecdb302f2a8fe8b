"""Running one optimizer step's micro-batches through the stages, tick by tick.

Every rank walks the same :class:`~neuron_tp.pipeline.schedule.Schedule`: in a tick it runs its
stage's task (forward of a micro-batch piece, keeping the piece's input and output; or its
backward, from the loss on the last piece or from the gradient the next stage sent), then every
rank takes part in the tick's :class:`~neuron_tp.pipeline.exchange.Exchange`. On XLA each task
and each exchange is its own graph, so a stage compiles a fixed set (a forward and a backward
per piece, the exchange) whatever the number of micro-batches; gradients are accumulated into
buffers that exist from the start (the backward graph is the same for every micro-batch).

The loss is the sum of the last stage's token losses times ``scale`` (1 / the step's loss
tokens: the mean over every loss token of the global batch, as at pp 1); :meth:`step` returns
it summed over the pp group, so every rank holds the step's loss. An MoE model's router
load-balancing loss (``output_router_logits``) adds ``coef * aux`` per micro-batch, as at pp 1:
after the tick in which the last piece ran a micro-batch's forward, every rank sums that
micro-batch's routing counts over the pp group (:mod:`neuron_tp.pipeline.router_loss`).

A micro-batch is the data's batch dict: packed rows (``segment_ids``, ``position_ids``) are
data every stage reads from its own copy (the block-diagonal mask and the per-sample positions
are built on each stage, the labels of sample starts and padding ignored on the last: as
:func:`neuron_tp.hf.packing.model_inputs` at pp 1; under blockwise attention the segment ids go
to the attention instead of a mask); only hidden states cross stages.

Context parallelism inside the stages (``mesh.cp`` > 1, the stage's attention made ring
attention by :func:`neuron_tp.hf.context_parallel.context_parallel`): every rank of a cp ring
holds the same micro-batches and runs its part of each sequence (chunks r and 2cp-1-r of the
ids, the global positions, the targets shifted on the whole sequence first); packed rows give
the ring their global ``segment_ids`` instead of a mask; the boundary carries ``seq / cp``
positions (``/ tp`` more under SP). Each rank's loss is the sum over its own targets (its
backward is its part of the gradient, as at pp 1); the step's loss and eval totals are summed
over cp with the pp sum.

:meth:`evaluate` walks a forward-only schedule (no gradients) and returns the eval totals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..backend.graphs import step_boundary
from ..hf.attention import takes_segments
from ..hf.context_parallel import split_rows
from ..hf.moe import recorded_router_logits
from ..hf.packing import IGNORE_INDEX, model_inputs, next_token_targets
from ..parallel import comm
from . import router_loss
from .exchange import Exchange, Sent
from .schedule import Schedule, Task, forward_only
from .stages import PipelineStage

# the last piece's (loss, values) / totals of a micro-batch: (logits, targets, micro-batch)
LossFn = Callable[[torch.Tensor, torch.Tensor, dict], tuple[torch.Tensor, torch.Tensor]]
TotalsFn = Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]


class PipelineRunner:
    """Runs :meth:`step` for ``stage`` under ``schedule``; micro-batches are ``[batch, seq]``.

    ``sequence_parallel``: the boundary carries this rank's sequence shard (``seq / tp``);
    None: what the stage's own layers do (a decoder model: not; library blocks: their layout,
    :meth:`PipelineStage.boundary_shape`)."""

    def __init__(
        self,
        stage: PipelineStage,
        schedule: Schedule,
        *,
        batch: int,
        seq: int,
        device: torch.device,
        sequence_parallel: bool | None = None,
        method: str | None = None,
    ):
        if schedule.stages != stage.plan.stages or schedule.virtual != stage.plan.virtual:
            raise ValueError(
                f"schedule of {schedule.stages} x {schedule.virtual} pieces for a stage plan of "
                f"{stage.plan.stages} x {stage.plan.virtual}"
            )
        self.stage, self.schedule, self.device = stage, schedule, torch.device(device)
        self.ring = stage.mesh.cp  # context parallelism: this rank's part of each sequence
        shape = stage.boundary_shape(batch, seq // self.ring.size, sequence_parallel)
        dtype = next(stage.model.parameters()).dtype
        self.exchange = Exchange(stage.mesh.pp, shape, dtype, self.device, method)
        self.mask_dtype = dtype  # packed rows' mask: the model's dtype, as at pp 1
        self.positions = torch.arange(seq, device=self.device).unsqueeze(0)
        self.busy_seconds = 0.0  # host time in tasks (eager devices: compute), for reports
        self.router = router_loss.router_loss_of(stage.model)

    def cut(self) -> None:
        """End the pending graph (XLA; nothing elsewhere)."""
        step_boundary(self.device)

    def pp_sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the pp group in a graph of its own (a
        :data:`~neuron_tp.optim.grads.PPSum`): cut this stage's pending work, meet the other
        stages (:meth:`Exchange.meet`), then a graph holding only the all-reduce. Stages trace
        different graphs before it; a pp collective inside them would wait for the slowest
        stage's compile and run (XLA:CPU aborts past 10 s; on Neuron, every stage must load the
        graph holding the collective together)."""
        self.meet()
        total = comm.all_reduce(t, self.stage.mesh.pp)
        self.cut()
        return total

    def meet(self) -> None:
        """Cut this stage's pending work and wait for the other stages (XLA:CPU devices): the
        next graph may hold pp collectives."""
        self.cut()
        self.exchange.meet()

    def _grads_ready(self) -> None:
        """Gradient buffers exist before the first backward (one backward graph)."""
        for p in self.stage.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def step(
        self,
        micro_batches: Sequence[dict],
        scale: torch.Tensor,
        loss_fn: LossFn | None = None,
        extra: int = 0,
    ) -> torch.Tensor:
        """Forward and backward of every micro-batch (the data's batch dicts: ``input_ids``
        and ``labels``, packed rows with ``position_ids`` and ``segment_ids``; the same on
        every stage); gradients accumulate in the parameters' ``.grad``. Returns the step's
        loss (device tensor, equal on every rank of the pp group), summed over pp in a new
        graph the stages begin together: add the step's other pp collectives (the tied
        table's gradients) to it, then :meth:`cut`.

        ``loss_fn(logits, targets, micro_batch) -> (loss, values)``: the last piece's loss
        of a micro-batch instead of the token losses' sum (e.g. a preference loss of per-row
        sums), and ``extra`` values (detached) summed over the micro-batches: the result is
        then ``[loss, *values]``."""
        if len(micro_batches) != self.schedule.micro_batches:
            raise ValueError(
                f"the schedule takes {self.schedule.micro_batches} micro-batches, got "
                f"{len(micro_batches)}"
            )
        self.stage.check_inputs(micro_batches)
        self._grads_ready()
        state = _StepState(
            micro_batches,
            scale.to(self.device).reshape(1).float(),
            torch.zeros(1 + extra, dtype=torch.float32, device=self.device),
            loss_fn=loss_fn,
        )
        self._walk(self.schedule, state)
        return self._whole(state.loss)

    def _whole(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the last stage's, this rank's part of the sequences) summed over the pp
        group and the cp ring: the micro-batches' totals, on every rank."""
        t = comm.all_reduce(t, self.stage.mesh.pp)
        return comm.all_reduce(t, self.ring) if self.ring.size > 1 else t

    def evaluate(
        self, micro_batches: Sequence[dict], totals_fn: TotalsFn | None = None, size: int = 2
    ) -> torch.Tensor:
        """``[loss sum, label tokens]`` (fp32, this dp rank's) of ``micro_batches`` (any number),
        forward only under ``no_grad`` in eval mode; the last stage's totals, summed over the
        pp group (in a graph of its own) so every stage holds them. ``totals_fn(logits,
        targets, micro_batch)``: the ``size`` values the last piece adds up instead."""
        self.stage.check_inputs(micro_batches)
        model = self.stage.model
        training = model.training
        model.eval()
        state = _StepState(
            micro_batches,
            torch.ones(1, device=self.device),
            torch.zeros(size, dtype=torch.float32, device=self.device),
            forward_only=True,
            totals_fn=totals_fn,
        )
        sched = forward_only(self.schedule.stages, len(micro_batches), self.schedule.virtual)
        try:
            with torch.no_grad():
                self._walk(sched, state)
        finally:
            model.train(training)
        total = self._whole(state.loss)
        self.cut()
        return total

    def _walk(self, schedule: Schedule, state: _StepState) -> None:
        """Every tick of ``schedule``: this stage's task, then the tick's exchange; ends
        where the stages meet (the caller's next graph may hold pp collectives)."""
        self.cut()
        for tick in schedule.ticks:
            task = tick[self.stage.stage]
            sent = Sent()
            if task is not None:
                began = time.perf_counter()
                out = self._run(task, state)
                self.busy_seconds += time.perf_counter() - began
                if task.kind == "F":
                    sent.forward = out
                else:
                    sent.backward = out
                self.cut()
            self._exchange_tick(tick, sent, state)
            done = self._last_forward(tick)
            if done is not None and self.router is not None and not state.forward_only:
                self._sum_routing(done, state, self.router)
        assert not (state.saved or state.inbox_f or state.inbox_b), "schedule left work behind"
        self.exchange.meet()

    def _exchange_tick(self, tick, sent: Sent, state: _StepState) -> None:
        """The tick's exchange (skipped by every rank when no stage sends anything)."""
        p, me = self.schedule.stages, self.stage.stage
        if not any(
            self._sends_forward(x, s) or self._sends_backward(x, s) for s, x in enumerate(tick)
        ):
            return
        f_from = self._sends_forward(tick[(me - 1) % p], (me - 1) % p)
        b_from = self._sends_backward(tick[(me + 1) % p], (me + 1) % p)
        self.exchange.meet()
        got_f, got_b = self.exchange(sent, f_from is not None, b_from is not None)
        if f_from is not None:
            state.inbox_f[f_from] = got_f
        if b_from is not None:
            state.inbox_b[b_from] = got_b
        self.cut()

    def _last_forward(self, tick) -> int | None:
        """The micro-batch whose forward the last piece runs in ``tick``, or None."""
        task = tick[-1]
        if task is None or task.kind != "F":
            return None
        last = self.schedule.virtual_stage(self.schedule.stages - 1, task.chunk)
        return task.micro if last == self.schedule.last_virtual else None

    def _sum_routing(self, micro: int, state: _StepState, router: router_loss.RouterLoss) -> None:
        """Micro-batch ``micro``'s routing counts summed over the pp group, in a graph of its
        own every rank begins together; from them the weights of this stage's router terms,
        whose values join the step's loss (the gradients follow with each piece's backward)."""
        self.meet()
        total = comm.all_reduce(state.counts.pop(micro), self.stage.mesh.pp)
        w = router_loss.weights(router, total)
        state.weights[micro] = w
        for (m, _), routing in state.routing.items():
            if m == micro:
                state.loss = state.loss + (w * routing.probs.detach()).sum().reshape(1)
        self.cut()

    def _routed_forward(self, task: Task, state: _StepState, *args, **kw) -> torch.Tensor:
        """The piece's forward; under a router loss its routing sums kept for the step."""
        st = self.stage
        if self.router is None or state.forward_only:
            return st.forward(task.chunk, *args, **kw)
        with recorded_router_logits(st.model) as logits:
            out = st.forward(task.chunk, *args, **kw)
        routing = router_loss.piece_routing(self.router, logits, self.device)
        if logits:  # (a piece of dense layers only: zero counts, no term)
            key = (task.micro, self.schedule.virtual_stage(st.stage, task.chunk))
            state.routing[key] = routing
        before = state.counts.get(task.micro)
        state.counts[task.micro] = routing.counts if before is None else before + routing.counts
        return out

    def _backward(self, key: tuple[int, int], out: torch.Tensor, grad, state: _StepState):
        """Backward of a piece's output (the loss: ``grad`` None), with its router term."""
        routing = state.routing.pop(key, None)
        if routing is None or not routing.probs.requires_grad:  # (e.g. LoRA: routers frozen)
            out.backward(grad)
            return
        extra = router_loss.term(state.weights[key[0]], routing)
        grad = torch.ones_like(out) if grad is None else grad
        torch.autograd.backward([out, extra], [grad, torch.ones_like(extra)])

    def _sends_forward(self, task: Task | None, stage: int) -> tuple[int, int] | None:
        """(micro-batch, receiving virtual stage) when ``stage`` sends an activation now."""
        if task is None or task.kind != "F":
            return None
        j = self.schedule.virtual_stage(stage, task.chunk)
        return (task.micro, j + 1) if j < self.schedule.last_virtual else None

    def _sends_backward(self, task: Task | None, stage: int) -> tuple[int, int] | None:
        if task is None or task.kind != "B":
            return None
        j = self.schedule.virtual_stage(stage, task.chunk)
        return (task.micro, j - 1) if j > 0 else None

    def _inputs(self, batch: dict) -> dict:
        """The micro-batch on this device as this rank's stage takes it (packed rows:
        positions per sample, the block-diagonal mask, labels of sample starts and padding
        ignored), with ``targets`` (the token each position predicts, -100: none) instead
        of ``labels``; at cp > 1 this rank's part of every sequence (module doc)."""
        ring = self.ring.size > 1
        # blockwise / ring attention: segment ids, no 4D mask
        segments = takes_segments(getattr(self.stage.model, "config", None))
        inputs = model_inputs(batch, device=self.device, dtype=self.mask_dtype, segments=segments)
        inputs.setdefault("position_ids", self.positions)
        labels = inputs.pop("labels")
        inputs["targets"] = next_token_targets(labels)
        if ring:
            names = ("input_ids", "position_ids", "targets")
            inputs.update(split_rows(self.ring, **{n: inputs[n] for n in names}))
        return inputs

    def _run(self, task: Task, state: _StepState) -> torch.Tensor | None:
        """One task; returns what it sends (None: nothing)."""
        st = self.stage
        key = (task.micro, self.schedule.virtual_stage(st.stage, task.chunk))
        if task.kind == "F":
            inputs = self._inputs(state.micro_batches[task.micro])
            if st.is_first_piece(task.chunk):
                x = inputs["input_ids"]
            else:
                x = state.inbox_f.pop(key)
                if not state.forward_only:
                    x.requires_grad_(True)
            # packed rows under blockwise / ring attention: masked by segment (no 4D mask)
            packed = {"segment_ids": inputs["segment_ids"]} if "segment_ids" in inputs else {}
            mask = inputs.get("attention_mask")
            out = self._routed_forward(task, state, x, inputs["position_ids"], mask, **packed)
            if not st.is_last_piece(task.chunk):
                if not state.forward_only:
                    state.saved[key] = (x, out)
                return out.detach()
            if state.totals_fn is not None and state.forward_only:
                value = state.totals_fn(out, inputs["targets"], state.micro_batches[task.micro])
                state.loss = state.loss + value.float()
                return None
            if state.loss_fn is not None and not state.forward_only:
                loss, values = state.loss_fn(
                    out, inputs["targets"], state.micro_batches[task.micro]
                )
                loss = loss.float().reshape(1) * state.scale
                state.saved[key] = (x, loss)
                state.loss = state.loss + torch.cat([loss.detach(), values.detach().float()])
                return None
            loss = st.loss_sum(out, inputs["targets"]).float().reshape(1)
            if state.forward_only:
                count = (inputs["targets"] != IGNORE_INDEX).sum().float().reshape(1)
                state.loss = state.loss + torch.cat([loss, count])
                return None
            loss = loss * state.scale
            state.saved[key] = (x, loss)
            state.loss = state.loss + loss.detach()
            return None
        x, out = state.saved.pop(key)
        grad = None if st.is_last_piece(task.chunk) else state.inbox_b.pop(key)
        self._backward(key, out, grad, state)
        return None if st.is_first_piece(task.chunk) else x.grad


@dataclass
class _StepState:
    """What one walk's tasks share: the micro-batches, the loss scale and accumulator, the
    buffers received (by (micro-batch, virtual stage)) and the pieces kept for backward."""

    micro_batches: Sequence[dict]
    scale: torch.Tensor
    loss: torch.Tensor  # the step's loss; evaluation: [loss sum, label tokens]
    forward_only: bool = False
    inbox_f: dict = field(default_factory=dict)
    inbox_b: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)
    routing: dict = field(default_factory=dict)  # router loss: (micro, piece) -> PieceRouting
    counts: dict = field(default_factory=dict)  # micro -> this stage's counts so far
    weights: dict = field(default_factory=dict)  # micro -> the global weights of its terms
    loss_fn: LossFn | None = None
    totals_fn: TotalsFn | None = None
