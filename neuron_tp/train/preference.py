"""Preference optimisation (``--objective dpo|orpo``) on the pairs of :mod:`neuron_tp.job.pairs`.

A micro-batch of ``k`` pairs is one forward of ``2k`` rows (chosen rows, then rejected). A
row's log-probability is the sum over its completion tokens of ``log p(token)``, taken from the
vocab-sharded logits by the vocab-parallel cross-entropy (one all-gather of ``[2k, s, 2 tp]``,
the full vocabulary never gathered). With ``c``/``r`` the policy's chosen/rejected
log-probabilities and ``c0``/``r0`` the reference's, ``z = (c - c0) - (r - r0)``:

* DPO sigmoid: ``-(1-ε) logσ(βz) - ε logσ(-βz)`` (``ε``: ``--label-smoothing``);
* IPO: ``(z̄ - 1/(2β))²``, ``z̄`` of the mean (not summed) token log-probabilities;
* hinge: ``relu(1 - βz)``;
* ORPO (no reference): the NLL of the chosen completions' tokens (their mean) ``- β logσ(log
  odds)``, the log odds ``(c̄ - r̄) - (log(1 - e^c̄) - log(1 - e^r̄))`` of the mean token
  log-probabilities (``logps/*`` and ``rewards/*`` of those means, as TRL's). The NLL is on
  the completion only, as in the paper (TRL's ORPOTrainer takes it over prompt + completion).

The reference (``--reference``, :func:`reference_kind`): ``adapters``, the same model with its
LoRA adapters disabled; ``copy``, a frozen sharded copy of the initial model
(:func:`neuron_tp.train.build.reference_copy`), both forwarded at each step under no grad on
the same ``2k`` rows (:func:`reference_logps`); ``precompute``, the initial model's
log-probabilities of every pair, computed before the first step (:func:`reference_pass`) and
stored in ``--output-dir`` (``reference_logps.pt``) so a resumed run reads them. Metrics
(TRL's names) are means over the step's pairs; ``--eval-data`` pairs give the same as
``eval_*`` (:func:`eval_totals`).

Layouts (the ones refused: :mod:`neuron_tp.job.layout_rules`): under ``--cp`` each rank of
the ring sums its own completion tokens and the per-row sums are summed over the ring before
the loss (:func:`sequence_logps`); under ``--pp`` a micro-batch of pairs crosses the stages as
``2k`` rows and the last stage computes the sums, the loss and the metrics
(:func:`pipeline_step`), the reference always computed ahead through the stages; under
``--tp-mode 2d|3d`` each rank sums the rows of its block of the logits (the grid's
cross-entropy, reduction none) and the sums are gathered over the grid (:func:`grid_rows`);
under ``--ep`` (MoE) each rank's pairs are its own, as at dp.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..hf.context_parallel import split_rows
from ..hf.packing import IGNORE_INDEX, next_token_targets
from ..hf.parallelize_nd import logits_layout
from ..job.pairs import rows_checksum
from ..layers import parallel_cross_entropy
from ..layers.activation_layout import split_input
from ..layers.vocab_nd import cross_entropy_nd
from ..parallel import comm, regions
from ..parallel.mesh import Mesh
from ..pipeline.runner import PipelineRunner
from ..pipeline.stages import PipelineStage, sum_tied_grads
from .metrics import DPO_KEYS, ORPO_KEYS

REFERENCE_FILE = "reference_logps.pt"
EVAL_REFERENCE_FILE = "reference_logps_eval.pt"  # of the --eval-data pairs


def metric_names(objective: str) -> tuple[str, ...]:
    return ORPO_KEYS if objective == "orpo" else DPO_KEYS


def reference_kind(config) -> str:
    """Where DPO's reference log-probabilities come from: ``adapters``, ``copy`` or
    ``precompute`` (``--reference``; auto: adapters under ``--lora-r`` without ``--pp``, else
    precompute), ``none`` for the other objectives."""
    p = config.preference
    if p.objective != "dpo":
        return "none"
    if p.reference != "auto":
        return p.reference
    return "adapters" if config.lora.r and config.pipeline.pp == 1 else "precompute"


def needs_reference_pass(config) -> bool:
    return reference_kind(config) == "precompute"


def check_options(config) -> None:
    """Refuse what the preference objectives do not support (before any collective)."""
    p = config.preference
    if p.objective == "lm":
        return
    flag = f"--objective {p.objective}"
    if not 0.0 <= p.label_smoothing < 0.5:
        raise UserError(f"--label-smoothing must be in [0, 0.5), got {p.label_smoothing}")
    if p.label_smoothing and (p.objective != "dpo" or p.dpo_loss != "sigmoid"):
        raise UserError("--label-smoothing applies to --objective dpo --dpo-loss sigmoid only")
    if p.reference != "auto" and p.objective != "dpo":
        raise UserError(f"--reference applies to --objective dpo ({flag} has no reference)")
    if p.reference == "adapters" and not config.lora.r:
        raise UserError(
            "--reference adapters needs --lora-r (the base model is the policy with its "
            "adapters disabled); without LoRA use --reference copy or precompute"
        )


def token_logps(mesh: Mesh, vocab: int, logits, targets):
    """``log p(target)`` per position (0 where the target is -100) of logits ``[b, s, v]``
    (vocab-sharded at tp > 1) and ``targets`` ``[b, s]``: the token each position predicts.
    ``--tp-mode 2d|3d``: ``logits`` is this rank's block (batch chunk, vocab chunk) and the
    result that batch chunk's rows (:func:`grid_rows` gathers them)."""
    if mesh.tp_mode != "1d":
        layout = logits_layout(mesh)
        targets = split_input(targets.to(logits.device), layout, mesh, feature_dim=False)
        nll = cross_entropy_nd(logits, targets, layout, mesh, reduction="none", vocab_size=vocab)
    elif mesh.tp_size > 1:
        nll = parallel_cross_entropy(logits, targets, mesh=mesh, vocab_size=vocab, reduction="none")
    else:
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="none",
        ).view(targets.shape)
    valid = (targets != IGNORE_INDEX).to(nll.dtype)
    return -(nll.float() * valid), valid.float()


def grid_rows(mesh: Mesh, s: torch.Tensor, n: torch.Tensor):
    """``--tp-mode 2d|3d``: the per-row ``(sums, counts)`` of every row of the micro-batch
    from this rank's batch chunk of them (all-gathered over the logits' batch group; backward:
    this chunk's gradient, the loss being replicated over the grid); 1d: as given."""
    if mesh.tp_mode == "1d":
        return s, n
    group = mesh.group(logits_layout(mesh).batch_group)
    return regions.all_gather_fwd_split_bwd(s, group, dim=0), comm.all_gather(n, group, 0)


def sequence_logps(model, mesh: Mesh, vocab: int, ids, labels, mask):
    """``(sum, count)`` per row: the summed log-probability of the completion tokens (labels
    other than -100, shifted as HF does) and how many there are. At cp > 1 the model runs on
    this rank's part of every row (no attention mask: the padding is at the end and the ring
    is causal), its sums are this part's, summed over the
    ring (backward: identity, so each rank's gradient is that of its own tokens, summed over
    the replicas by the optimizer). Under ``--tp-mode 2d|3d`` each rank sums its batch
    chunk's rows, gathered over the grid (:func:`grid_rows`)."""
    targets = next_token_targets(labels)
    if mesh.cp_size > 1:
        logits = model(input_ids=ids).logits
        targets = split_rows(mesh.cp, targets=targets)["targets"]
    else:
        logits = model(input_ids=ids, attention_mask=mask).logits
    logps, valid = token_logps(mesh, vocab, logits, targets)
    s, n = grid_rows(mesh, logps.sum(-1), valid.sum(-1))
    if mesh.cp_size > 1:
        s = regions.all_reduce_fwd_identity_bwd(s, mesh.cp)
        n = regions.all_reduce_fwd_identity_bwd(n, mesh.cp)
    return s, n


def pair_inputs(batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``2k`` rows of a micro-batch of ``k`` pairs: chosen, then rejected."""

    def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], dim=0)

    return (
        cat(batch["input_ids"], batch["rejected_input_ids"]),
        cat(batch["labels"], batch["rejected_labels"]),
        cat(batch["attention_mask"], batch["rejected_attention_mask"]),
    )


def pair_logps(model, mesh: Mesh, vocab: int, batch: dict):
    """``(chosen sums, rejected sums, chosen counts, rejected counts)`` of a micro-batch."""
    ids, labels, mask = pair_inputs(batch)
    k = batch["input_ids"].shape[0]
    s, n = sequence_logps(model, mesh, vocab, ids, labels, mask)
    return s[:k], s[k:], n[:k], n[k:]


def preference_loss(config, policy, reference=None, chosen_nll=None):
    """``(per-pair losses [k], metrics [k, len(metric_names)])``; ``policy`` / ``reference``:
    ``(chosen sums, rejected sums, chosen counts, rejected counts)`` / ``(chosen sums,
    rejected sums)``; ``chosen_nll``: ORPO's NLL (a scalar, in the metrics as given)."""
    p = config.preference
    beta = p.beta
    pc, pr, nc, nr = policy
    if p.objective == "orpo":
        mc, mr = pc / nc, pr / nr
        log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
        ratio = F.logsigmoid(log_odds)
        losses = chosen_nll - beta * ratio
        rc, rr = beta * mc.detach(), beta * mr.detach()
        pc, pr = mc, mr  # ORPO's logps/*: per-token means
        extra = [
            chosen_nll.detach().expand_as(rc),
            ratio.detach(),
            log_odds.detach(),
        ]
    else:
        c0, r0 = reference
        rc, rr = beta * (pc - c0).detach(), beta * (pr - r0).detach()
        if p.dpo_loss == "ipo":  # on mean token log-probabilities
            z = (pc - c0) / nc - (pr - r0) / nr
        else:
            z = (pc - c0) - (pr - r0)
        if p.dpo_loss == "sigmoid":
            ls = p.label_smoothing
            losses = -(1 - ls) * F.logsigmoid(beta * z) - ls * F.logsigmoid(-beta * z)
        elif p.dpo_loss == "ipo":
            losses = (z - 1 / (2 * beta)) ** 2
        else:
            losses = torch.relu(1 - beta * z)
        extra = []
    metrics = [rc, rr, (rc > rr).float(), rc - rr, pc.detach(), pr.detach(), *extra]
    return losses, torch.stack(metrics, dim=-1)


def _pair_loss(config, policy, batch: dict, reference, base=None):
    """Per-pair losses and metrics of ``policy`` (:func:`pair_logps`): the reference picked
    from the stored ``[pairs, 2]`` by ``pair_index``, else ``base()`` (adapters off); ORPO's
    NLL of the chosen completions from the policy."""
    ref = chosen_nll = None
    if config.preference.objective == "orpo":
        chosen_nll = -policy[0].sum() / policy[2].sum()
    elif reference is not None:
        picked = reference.index_select(0, batch["pair_index"].to(reference.device))
        ref = (picked[:, 0], picked[:, 1])
    elif base is not None:
        c0, r0, _, _ = base()
        ref = (c0.detach(), r0.detach())
    else:  # only traced (neuron_parallel_compile: no reference pass): the graph's shape
        ref = (policy[0].detach(), policy[1].detach())
    return preference_loss(config, policy, ref, chosen_nll)


def reference_logps(run, batch: dict):
    """:func:`pair_logps` of the reference computed at each step (no grad): the frozen copy
    (``--reference copy``) or the policy with its adapters disabled (``adapters``)."""
    model, mesh = run.model, run.mesh
    vocab = model.config.vocab_size
    with torch.no_grad():
        if run.reference_model is not None:
            return pair_logps(run.reference_model, mesh, vocab, batch)
        with adapters_off(model):
            return pair_logps(model, mesh, vocab, batch)


def _step_reference(run, batch: dict):
    """``base()`` of :func:`_pair_loss` when the reference is a forward at each step."""
    if reference_kind(run.config) not in ("adapters", "copy"):
        return None
    return lambda: reference_logps(run, batch)


def micro_step(run, batch: dict, scale: torch.Tensor, reference: torch.Tensor | None):
    """Forward and loss of one micro-batch: ``(loss / scale, summed metrics [m])``; the
    caller backpropagates the loss. ``reference``: the stored ``[pairs, 2]`` log-probs."""
    model, mesh = run.model, run.mesh
    policy = pair_logps(model, mesh, model.config.vocab_size, batch)
    losses, metrics = _pair_loss(run.config, policy, batch, reference, _step_reference(run, batch))
    return losses.sum() / scale, metrics.sum(0)


@contextlib.contextmanager
def adapters_off(model):
    """The peft model without its adapters (the base: DPO's reference under LoRA)."""
    with model.disable_adapter():
        yield


def _stage_pair_logps(stage: PipelineStage, logits, targets):
    """:func:`pair_logps` of the last stage's logits of ``2k`` rows (chosen, then rejected)."""
    valid = (targets != IGNORE_INDEX).float()
    s = -(stage.token_losses(logits, targets).float() * valid).sum(-1)
    n = valid.sum(-1)
    k = s.shape[0] // 2
    return s[:k], s[k:], n[:k], n[k:]


def _stage_batch(batch: dict) -> dict:
    """A micro-batch of pairs as the pipeline runs it: ``2k`` rows (chosen, then rejected;
    right padding: no mask needed under causal attention) and what the loss reads."""
    ids, labels, _ = pair_inputs(batch)
    return {"input_ids": ids, "labels": labels, "pair_index": batch["pair_index"]}


def pipeline_step(run, scale: torch.Tensor, reference: torch.Tensor | None):
    """``--pp``: the step's ``--grad-accum`` micro-batches of pairs through the stages (a
    pair's rows always in one micro-batch); the last stage computes the per-row sums and the
    loss. Returns ``(loss, summed metrics)``, summed over pp (every rank holds them)."""
    runner, config = run.pipeline, run.config
    stage = runner.stage

    def loss_fn(logits, targets, batch):
        policy = _stage_pair_logps(stage, logits, targets)
        losses, metrics = _pair_loss(config, policy, batch, reference)
        return losses.sum(), metrics.sum(0)

    batches = [_stage_batch(run.data.next_batch()) for _ in range(runner.schedule.micro_batches)]
    m = len(metric_names(config.preference.objective))
    out = runner.step(batches, 1.0 / scale, loss_fn, extra=m)
    sum_tied_grads(stage)
    runner.cut()
    return out[:1], out[1:]


def _pipeline_reference(runner: PipelineRunner, data, dev) -> torch.Tensor:
    """``[pairs, 2]`` log-probabilities of every pair through the stages (forward only, in
    data order), on every rank."""
    n, k = len(data.rows["input_ids"]), data.micro_batch
    batches = []
    for start in range(0, n, k):
        idx = torch.arange(start, start + k) % n  # a full last micro-batch
        batch = _stage_batch({name: t[idx] for name, t in data.rows.items()})
        batch["weight"] = (torch.arange(start, start + k) < n).float()  # wrapped: not again
        batches.append(batch)

    def totals_fn(logits, targets, batch):
        c, r, _, _ = _stage_pair_logps(runner.stage, logits, targets)
        w = batch["weight"].to(logits.device)[:, None]
        put = torch.zeros(n, 2, device=logits.device)
        rows = batch["pair_index"].to(logits.device)
        return put.index_add(0, rows, torch.stack([c, r], -1) * w).reshape(-1)

    return runner.evaluate(batches, totals_fn, size=2 * n).view(n, 2)


def reference_pass(run, say, data=None, name: str = REFERENCE_FILE) -> torch.Tensor:
    """``[pairs, 2]`` reference log-probabilities (chosen, rejected) of every pair of ``data``
    (default: the training pairs) on ``run.device``: read from ``--output-dir`` (file
    ``name``) when stored for these pairs, else computed by the current (initial) model,
    micro-batch by micro-batch in data order (every rank all pairs; ``--pp``: through the
    stages), and stored there by rank 0. A resumed run without them is refused: the model
    has trained since and is no longer the reference."""
    from ..backend.graphs import step_boundary

    config, model, mesh, dev = run.config, run.model, run.mesh, run.device
    data = run.data if data is None else data
    path = os.path.join(config.checkpoint.output_dir, name)
    digest = rows_checksum({k: v for k, v in data.rows.items() if k != "pair_index"})
    if os.path.exists(path):
        stored = torch.load(path, map_location="cpu", weights_only=True)
        if stored.get("pairs") != digest:
            raise UserError(
                f"{path} holds the reference log-probabilities of other pairs (another --data, "
                "--eval-data, --tokenizer or --seq-len); remove it or use another --output-dir"
            )
        say(f"reference log-probabilities: read from {path}")
        return stored["logps"].to(dev)
    if run.step > 0:
        raise UserError(
            f"resuming at step {run.step} needs the reference log-probabilities of the "
            f"initial model, stored as {path}, and it is missing; start over in a new "
            "--output-dir"
        )
    n, k = len(data.rows["input_ids"]), data.micro_batch
    if run.pipeline is not None:
        logps = _pipeline_reference(run.pipeline, data, dev).cpu()
    else:
        out = []
        was_training = model.training
        model.eval()
        vocab = model.config.vocab_size
        with torch.no_grad():
            for start in range(0, n, k):
                idx = torch.arange(start, start + k) % n  # a full last micro-batch: one graph
                batch = {name: t[idx].to(dev) for name, t in data.rows.items()}
                c, r, _, _ = pair_logps(model, mesh, vocab, batch)
                out.append(torch.stack([c, r], dim=-1)[: min(k, n - start)])
                step_boundary(dev)
        model.train(was_training)
        logps = torch.cat([t.cpu() for t in out])
    if mesh.rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = path + ".tmp"
        torch.save({"pairs": digest, "logps": logps}, tmp)
        os.replace(tmp, path)
    say(f"reference log-probabilities: {n} pairs computed, stored in {path}")
    return logps.to(dev)


def eval_totals(run, reference: torch.Tensor | None):
    """``totals(data, batches)`` of ``--eval-data`` pairs: ``[loss sum, metric sums...,
    pairs]`` of the next ``batches`` batches (no grad, eval mode, one graph per batch),
    summed over dp; ``reference``: the eval pairs' stored reference (None: computed at each
    batch, :func:`reference_logps`)."""
    from ..backend.graphs import step_boundary

    config, model, mesh, dev = run.config, run.model, run.mesh, run.device
    m = len(metric_names(config.preference.objective))

    def totals_of(losses, metrics):
        k = torch.ones_like(losses).sum().reshape(1)
        return torch.cat([losses.sum().reshape(1), metrics.sum(0), k]).float()

    def totals_fn(logits, targets, batch):
        policy = _stage_pair_logps(run.pipeline.stage, logits, targets)
        return totals_of(*_pair_loss(config, policy, batch, reference))

    def totals(data, batches: int) -> torch.Tensor:
        if run.pipeline is not None:
            got = [_stage_batch(data.next_batch()) for _ in range(batches)]
            return comm.all_reduce(run.pipeline.evaluate(got, totals_fn, size=m + 2), mesh.dp)
        vocab = model.config.vocab_size
        out = torch.zeros(m + 2).to(dev)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                for _ in range(batches):
                    batch = {k: t.to(dev) for k, t in data.next_batch().items()}
                    base = _step_reference(run, batch)
                    policy = pair_logps(model, mesh, vocab, batch)
                    part = totals_of(*_pair_loss(config, policy, batch, reference, base))
                    out = out + comm.all_reduce(part, mesh.dp)
                    step_boundary(dev)
        finally:
            model.train(was_training)
        return out

    return totals
