"""int8 weights vs bf16: quality on held-out text, for a small model trained here.

No network: a Llama (hidden 256, 4 layers, 8 heads / 4 kv heads, byte-level vocabulary) is
trained from random init by ``neuron-tp train`` on the first 90 % of data/corpus.txt, then
consolidated into a HF directory. Held out: the last 10 % of the corpus. Side by side, same
weights, compute in bf16 (fp32 as the baseline of the baseline):

- perplexity (teacher-forced, windows of ``--seq-len`` bytes);
- top-1 agreement: positions where the int8 model's argmax equals bf16's (teacher-forced);
- greedy agreement: ``--prompts`` held-out prompts of 32 bytes, ``--new-tokens`` greedy
  tokens each: the fraction equal position by position, and how many sequences are identical;
- the int8 model two ways, which must print the same numbers: quantized on load
  (``ntp.quantize``, what ``--quantize int8`` does) and loaded from the int8 checkpoint that
  ``ntp.save_pretrained`` wrote (no re-quantization).

Usage: ``python benchmarks/int8_quality.py [--workdir /tmp/int8_quality] [--steps 120]``
(training is skipped when ``--workdir`` already holds the trained model).
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(REPO, "data", "corpus.txt")


def train(work: str, steps: int, seq_len: int) -> str:
    """The trained model's HF directory (trained and consolidated once per ``work``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_dir = os.path.join(work, "trained")
    if os.path.exists(os.path.join(hf_dir, "model.safetensors")):
        return hf_dir
    text = open(CORPUS, encoding="utf-8").read()
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "train.txt"), "w", encoding="utf-8") as f:
        f.write(text[: int(len(text) * 0.9)])
    cfg = LlamaConfig(
        vocab_size=257,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(os.path.join(work, "init"))
    cli = [sys.executable, "-m", "neuron_tp.cli"]
    run = [*cli, "train", "--model", os.path.join(work, "init"), "--tokenizer", "bytes"]
    run += ["--data", os.path.join(work, "train.txt"), "--device", "cpu", "--tp", "1"]
    run += ["--steps", str(steps), "--seq-len", str(seq_len), "--micro-batch", "8"]
    run += ["--lr", "3e-3", "--warmup-steps", "20", "--log-every", "50"]
    run += ["--save-every", str(steps), "--output-dir", os.path.join(work, "run")]
    env = {**os.environ, "PYTHONPATH": REPO}
    subprocess.run(run, check=True, env=env)
    subprocess.run([*cli, "consolidate", os.path.join(work, "run"), hf_dir], check=True, env=env)
    return hf_dir


def held_out(seq_len: int) -> torch.Tensor:
    """The last 10 % of the corpus as byte ids, in rows of ``seq_len``."""
    data = open(CORPUS, "rb").read()
    ids = torch.tensor(list(data[int(len(data) * 0.9) :]), dtype=torch.long)
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len)


@torch.no_grad()
def score(model, rows: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(perplexity, argmax per position) over ``rows``, 8 rows per forward."""
    nll, count, top = 0.0, 0, []
    for batch in rows.split(8):
        logits = model(batch).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1)
        nll -= lp.gather(-1, batch[:, 1:, None]).sum().item()
        count += batch[:, 1:].numel()
        top.append(logits.argmax(-1))
    return math.exp(nll / count), torch.cat(top)


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from neuron_tp.infer.static_generator import generate

    return generate(model, prompts, new_tokens, [32])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", default="/tmp/int8_quality")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    a = p.parse_args()
    sys.path.insert(0, REPO)
    import neuron_tp as ntp

    hf_dir = train(a.workdir, a.steps, a.seq_len)
    mesh = ntp.init_mesh(tp=1)
    rows = held_out(a.seq_len)
    prompts = [r[:32].tolist() for r in rows[:: max(1, len(rows) // a.prompts)][: a.prompts]]
    models = {
        "fp32": ntp.from_pretrained(hf_dir, mesh),
        "bf16": ntp.from_pretrained(hf_dir, mesh, torch_dtype=torch.bfloat16),
    }
    models["int8 (quantized on load)"] = ntp.quantize(
        ntp.from_pretrained(hf_dir, mesh, torch_dtype=torch.bfloat16), mesh
    )
    int8_dir = os.path.join(a.workdir, "int8")
    ntp.save_pretrained(models["int8 (quantized on load)"], int8_dir)
    t0 = time.perf_counter()
    models["int8 (int8 checkpoint)"] = ntp.from_pretrained(
        int8_dir, mesh, torch_dtype=torch.bfloat16
    )
    load_s = time.perf_counter() - t0
    size = {d: os.path.getsize(os.path.join(d, "model.safetensors")) for d in (hf_dir, int8_dir)}
    print(f"held-out: {rows.numel()} bytes ({len(rows)} x {a.seq_len}); {len(prompts)} prompts")
    print(f"files: fp32 {size[hf_dir] / 1e6:.2f} MB, int8 {size[int8_dir] / 1e6:.2f} MB")
    print(f"int8 checkpoint loaded in {load_s:.2f} s (no re-quantization)")
    _, top_bf16 = score(models["bf16"], rows)
    out_bf16 = greedy(models["bf16"], prompts, a.new_tokens)
    head = f"{'model':<26}{'ppl':>8}{'top-1 = bf16':>14}{'greedy = bf16':>15}{'same seqs':>11}"
    print(head)
    for name, model in models.items():
        ppl, top = score(model, rows)
        out = greedy(model, prompts, a.new_tokens)
        same = sum(x == y for o, r in zip(out, out_bf16) for x, y in zip(o, r))
        total = sum(len(r) for r in out_bf16)
        seqs = sum(o == r for o, r in zip(out, out_bf16))
        agree = (top == top_bf16).float().mean().item()
        print(f"{name:<26}{ppl:>8.3f}{agree:>14.4f}{same / total:>15.4f}{seqs:>8}/{len(prompts)}")


if __name__ == "__main__":
    main()
