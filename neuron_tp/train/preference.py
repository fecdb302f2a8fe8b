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

The reference: with ``--lora-r`` the same model with its adapters disabled (no grad), else
the initial model's log-probabilities of every pair, computed before the first step
(:func:`reference_pass`) and stored in ``--output-dir`` (``reference_logps.pt``) so a resumed
run reads them. Metrics (TRL's names) are means over the step's pairs.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F

from ..errors import UserError
from ..job.pairs import rows_checksum
from ..layers import parallel_cross_entropy
from ..parallel.mesh import Mesh
from .metrics import DPO_KEYS, ORPO_KEYS

REFERENCE_FILE = "reference_logps.pt"


def metric_names(objective: str) -> tuple[str, ...]:
    return ORPO_KEYS if objective == "orpo" else DPO_KEYS


def uses_adapter_reference(config) -> bool:
    """DPO with LoRA: the reference is the base model, adapters off (unless precomputed)."""
    p = config.preference
    return p.objective == "dpo" and bool(config.lora.r) and not p.precompute_reference


def needs_reference_pass(config) -> bool:
    p = config.preference
    return p.objective == "dpo" and not uses_adapter_reference(config)


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
    unsupported = {
        "--pp > 1": config.pipeline.pp > 1,
        "--cp > 1": config.context.cp > 1,
        f"--tp-mode {config.tp_mode}": config.tp_mode != "1d",
        "--sequence-parallel": config.sequence_parallel,
        "--ep > 1": config.ep > 1,
        "--eval-data": config.eval.data is not None,
        "--data-cache": config.data_cache is not None,
        "--attention blockwise": config.attention == "blockwise",
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise UserError(
            f"{flag} does not support {', '.join(bad)}: preference training runs with --tp "
            "(1d), data parallelism, --zero1, --bf16, --lora-r and --grad-accum"
        )


def sequence_logps(model, mesh: Mesh, vocab: int, ids, labels, mask):
    """``(sum, count)`` per row: the summed log-probability of the completion tokens (labels
    other than -100, shifted as HF does) and how many there are."""
    out = model(input_ids=ids, attention_mask=mask)
    logits = out.logits[:, :-1]
    target = labels[:, 1:]
    if mesh.tp_size > 1:
        nll = parallel_cross_entropy(logits, target, mesh=mesh, vocab_size=vocab, reduction="none")
    else:
        nll = F.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            target.reshape(-1),
            ignore_index=-100,
            reduction="none",
        ).view(target.shape)
    valid = (target != -100).to(nll.dtype)
    return -(nll.float() * valid).sum(-1), valid.sum(-1).float()


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


def micro_step(run, batch: dict, scale: torch.Tensor, reference: torch.Tensor | None):
    """Forward and loss of one micro-batch: ``(loss / scale, summed metrics [m])``; the
    caller backpropagates the loss. ``reference``: the stored ``[pairs, 2]`` log-probs."""
    config, model, mesh = run.config, run.model, run.mesh
    vocab = model.config.vocab_size
    policy = pair_logps(model, mesh, vocab, batch)
    ref = None
    chosen_nll = None
    if config.preference.objective == "orpo":
        chosen_nll = -policy[0].sum() / policy[2].sum()
    elif reference is not None:
        picked = reference.index_select(0, batch["pair_index"])
        ref = (picked[:, 0], picked[:, 1])
    else:
        with torch.no_grad(), adapters_off(model):
            c0, r0, _, _ = pair_logps(model, mesh, vocab, batch)
        ref = (c0.detach(), r0.detach())
    losses, metrics = preference_loss(config, policy, ref, chosen_nll)
    return losses.sum() / scale, metrics.sum(0)


@contextlib.contextmanager
def adapters_off(model):
    """The peft model without its adapters (the base: DPO's reference under LoRA)."""
    with model.disable_adapter():
        yield


def reference_pass(run, say) -> torch.Tensor:
    """``[pairs, 2]`` reference log-probabilities (chosen, rejected) of every pair on
    ``run.device``: read from ``--output-dir`` when stored for these pairs, else computed by
    the current (initial) model, micro-batch by micro-batch in data order (every rank all
    pairs), and stored there by rank 0. A resumed run without them is refused: the model
    has trained since and is no longer the reference."""
    from ..backend.graphs import step_boundary

    config, data, model, mesh, dev = run.config, run.data, run.model, run.mesh, run.device
    path = os.path.join(config.checkpoint.output_dir, REFERENCE_FILE)
    digest = rows_checksum({k: v for k, v in data.rows.items() if k != "pair_index"})
    if os.path.exists(path):
        stored = torch.load(path, map_location="cpu", weights_only=True)
        if stored.get("pairs") != digest:
            raise UserError(
                f"{path} holds the reference log-probabilities of other pairs (another --data, "
                "--tokenizer or --seq-len); remove it or use another --output-dir"
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
