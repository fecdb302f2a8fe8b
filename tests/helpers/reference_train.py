"""An independent reference for the training loop: the plain (unsharded) transformers model
trained with stock torch pieces (AdamW, LambdaLR, torch.nn.utils.clip_grad_norm_) on one
process, on the same sequences. Returns the mean loss and gradient norm of every step."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return (min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * progress))) / lr


def reference_run(
    args, global_micro_batch: int, dtype: torch.dtype = torch.float32
) -> tuple[list[float], list[float]]:
    """``global_micro_batch`` = micro_batch x dp of the run being checked; ``dtype`` of the
    parameters (bf16: pure bf16 AdamW, no master weights)."""
    from neuron_tp.job.data import ByteTokenizer
    from neuron_tp.job.presets import build_model
    from neuron_tp.job.sft_data import load_data

    model = build_model(args.model, ByteTokenizer.vocab_size, args.seed, dtype)
    if getattr(args, "lora_r", 0):  # the unsharded peft model, adapters from the same RNG
        from neuron_tp.job.config import TrainConfig
        from neuron_tp.train.peft_wrap import wrap

        model = wrap(model, TrainConfig.from_args(args))
    model.train()
    data = load_data(
        args.data,
        ByteTokenizer(),
        args.seq_len,
        global_micro_batch,
        seed=args.seed,
        loss_on=args.loss_on,
        packing=args.packing,
        overlong=args.overlong,
    )
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if p.dim() >= 2]
    rest = [p for p in trained if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=args.lr,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, args.lr, args.min_lr, args.warmup_steps, args.steps)
    )
    losses, norms = [], []
    for _ in range(args.steps):
        total = 0.0
        batches = [data.next_batch() for _ in range(args.grad_accum)]
        # the step's loss: the mean over every token it takes the loss on (HF's shift)
        n = sum((b["labels"][:, 1:] != -100).sum() for b in batches)
        for batch in batches:
            ids, labels = batch["input_ids"], batch["labels"]
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=n).loss
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(trained, args.max_grad_norm)))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    reference_run.model = model  # the trained reference (e.g. to compare saved adapters)
    return losses, norms
