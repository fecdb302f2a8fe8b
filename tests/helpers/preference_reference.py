"""The reference of the preference tests: TRL's DPOTrainer / ORPOTrainer training the unsharded
tiny model (plain transformers, CPU, one process) on the same pairs with the same AdamW
settings, constant learning rate, clipping at 1.0 and one batch of every pair per step; and
the tiny pair set and BPE tokenizer both runs read."""

from __future__ import annotations

import copy
import json
import os

import torch

# The prompt ends on a token boundary ("\n"): TRL tokenizes prompt + completion as one text.
SUBJECTS = ["cats", "rain", "tea", "maps"]
EVAL_SUBJECTS = ["owls", "snow", "jazz", "bread"]  # the eval pairs (eval_pairs.jsonl)
LR, STEPS, SEED = 5e-3, 3, 0
ARGS = [
    "--steps",
    str(STEPS),
    "--lr",
    str(LR),
    "--min-lr",
    str(LR),
    "--warmup-steps",
    "0",
    "--weight-decay",
    "0",
    "--max-grad-norm",
    "1.0",
    "--seq-len",
    "48",
    "--log-every",
    "1",
    "--save-every",
    "0",
    "--seed",
    str(SEED),
]
KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def write_pairs(out: str, conversational: bool = False, evaluation: bool = False) -> str:
    """Four pairs (one global batch), strings or messages with an implicit prompt;
    ``evaluation``: four other string pairs (``eval_pairs.jsonl``)."""
    name = "chat_pairs.jsonl" if conversational else "pairs.jsonl"
    path = os.path.join(out, "eval_" + name if evaluation else name)
    with open(path, "w") as f:
        for i, s in enumerate(EVAL_SUBJECTS if evaluation else SUBJECTS):
            prompt, good, bad = f"Tell me about {s}.\n", f"{s} are nice {i}.", f"No {i}!"
            if conversational:
                user = {"role": "user", "content": prompt}
                row = {
                    "chosen": [user, {"role": "assistant", "content": good}],
                    "rejected": [user, {"role": "assistant", "content": bad}],
                }
            else:
                row = {"prompt": prompt, "chosen": good, "rejected": bad}
            f.write(json.dumps(row) + "\n")
    return path


def tiny_model(vocab: int, lora_r: int = 0):
    """The tiny-llama preset from SEED (and LoRA adapters as ``neuron-tp train --lora-r``)."""
    from neuron_tp.job.presets import build_model

    torch.manual_seed(SEED)
    model = build_model("tiny-llama", vocab, SEED, torch.float32)
    if lora_r:
        from neuron_tp.cli.args import train_parser
        from neuron_tp.job.config import TrainConfig
        from neuron_tp.train.peft_wrap import wrap

        args = train_parser().parse_args(["--lora-r", str(lora_r), "--lora-alpha", "8"])
        model = wrap(model, TrainConfig.from_args(args))
    return model


def trl_run(pairs: str, tokenizer_dir: str, out: str, objective: str = "dpo", lora_r: int = 0,
            beta: float = 0.1, loss_type: str = "sigmoid", eval_pairs: str | None = None,
            model_dir: str | None = None) -> list[dict]:  # fmt: skip
    """TRL's per-step loss (as its compute_loss returns it) and metrics; ``eval_pairs``: an
    evaluation after every step, its ``eval_*`` values in the step's entry; ``model_dir``: a
    saved transformers model to train (default: the tiny-llama preset)."""
    import datasets
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.pad_token = tok.pad_token or tok.eos_token
    if model_dir is None:
        model = tiny_model(len(tok), lora_r)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    data = datasets.Dataset.from_list([json.loads(line) for line in open(pairs)])
    common = dict(
        output_dir=out,
        per_device_train_batch_size=len(SUBJECTS),
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=SEED,
        beta=beta,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,
        bf16=False,
    )
    if eval_pairs is not None:
        common.update(eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
        evaluation = datasets.Dataset.from_list([json.loads(line) for line in open(eval_pairs)])
    losses: list[float] = []
    if objective == "dpo":
        from trl import DPOConfig, DPOTrainer

        class Recording(DPOTrainer):
            def compute_loss(self, *a, **k):
                loss = super().compute_loss(*a, **k)
                if self.model.training:
                    losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
                return loss

        # an MoE model: no router load-balancing loss (TRL adds it by default, neuron-tp not)
        aux = {} if model_dir is None else {"router_aux_loss_coef": 0.0}
        cfg = DPOConfig(**common, loss_type=[loss_type], max_length=48, **aux)
        ref = None if lora_r else copy.deepcopy(model)  # LoRA: the base, adapters disabled
        trainer = Recording(
            model=model,
            ref_model=ref,
            args=cfg,
            train_dataset=data,
            eval_dataset=None if eval_pairs is None else evaluation,
            processing_class=tok,
        )
    else:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        class Recording(ORPOTrainer):  # type: ignore[no-redef]
            def compute_loss(self, *a, **k):
                loss = super().compute_loss(*a, **k)
                losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
                return loss

        cfg = ORPOConfig(**common, max_length=48, max_completion_length=48)
        trainer = Recording(model=model, args=cfg, train_dataset=data, processing_class=tok)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "rewards/chosen" in e]
    evals = {e["step"]: e for e in trainer.state.log_history if "eval_loss" in e}
    return [
        {**evals.get(e["step"], {}), **e, "loss": loss}
        for e, loss in zip(logs, losses, strict=True)
    ]


def orpo_written(pairs: str, tokenizer_dir: str, beta: float = 0.1) -> list[dict]:
    """ORPO from the paper's definition, NLL on the chosen completion's tokens only (TRL's
    ORPOTrainer takes it over prompt + completion): plain transformers and torch AdamW, the
    settings of ``trl_run``, every pair in each step's batch."""
    import torch.nn.functional as F
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = tiny_model(len(tok))
    model.train()
    rows = [json.loads(line) for line in open(pairs)]
    seqs = []
    for key in ("chosen", "rejected"):  # batch: every chosen, then every rejected
        for r in rows:
            prompt = tok(r["prompt"], add_special_tokens=False)["input_ids"]
            whole = tok(r["prompt"] + r[key] + tok.eos_token, add_special_tokens=False)
            seqs.append((whole["input_ids"], len(prompt)))
    width = max(len(ids) for ids, _ in seqs)
    ids = torch.full((len(seqs), width), tok.eos_token_id)
    attn = torch.zeros_like(ids)
    completion = torch.zeros_like(ids, dtype=torch.bool)
    for i, (s, start) in enumerate(seqs):
        ids[i, : len(s)], attn[i, : len(s)] = torch.tensor(s), 1
        completion[i, start : len(s)] = True
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    k, out = len(rows), []
    for _ in range(STEPS):
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        token_logps = logits.log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
        mask = completion[:, 1:].float()
        mean = (token_logps * mask).sum(-1) / mask.sum(-1)
        mc, mr = mean[:k], mean[k:]
        log_odds = (mc - mr) - (torch.log1p(-torch.exp(mc)) - torch.log1p(-torch.exp(mr)))
        ratio = F.logsigmoid(log_odds)
        nll = -(token_logps[:k] * mask[:k]).sum() / mask[:k].sum()
        loss = nll - beta * ratio.mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rc, rr = beta * mc.detach(), beta * mr.detach()
        out.append(
            {
                "loss": float(loss),
                "rewards/chosen": float(rc.mean()),
                "rewards/rejected": float(rr.mean()),
                "rewards/accuracies": float((rc > rr).float().mean()),
                "rewards/margins": float((rc - rr).mean()),
                "logps/chosen": float(mc.mean()),
                "logps/rejected": float(mr.mean()),
                "nll_loss": float(nll),
                "log_odds_ratio": float(ratio.mean()),
                "log_odds_chosen": float(log_odds.mean()),
            }
        )
    return out
