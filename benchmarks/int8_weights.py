"""int8 weights vs bf16: weight bytes per rank and decode ms per token on the XLA CPU device
(a tiny Llama, tp 1), and the decode bound on Inf2 (HBM bandwidth) for Llama-3-8B.

Measured (this machine): the same random model in bf16, then with ``neuron_tp.quantize`` (int8
weights for every linear but the LM head); bytes of the parameters and buffers that hold
weights, and wall ms per decode token of the replayed decode graph (one warm-up call first: no
compile is timed). The XLA CPU device is compute-bound and dequantizes on the CPU: its ms/token
says nothing of Inf2, the bytes do.

Computed (Inf2: 820 GiB/s of HBM per chip, 2 NeuronCores per chip, one tp rank per core): a
decode step at batch 1 reads every weight once (the LM head included, one embedding row only;
KV cache not counted), so ms/token >= weight bytes read per step / (chips x 820 GiB/s).
Llama-3-8B: hidden 4096, 32 layers, 32 q / 8 kv heads of 128, MLP 14336, vocab 128256. At a tp
that does not divide the heads or the MLP, each rank holds ceil(count / tp) (padded heads,
kv heads replicated), as NxD Inference pads.

Usage: ``PJRT_DEVICE=CPU python benchmarks/int8_weights.py [--hidden 256] [--layers 4]
[--new-tokens 32]``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time

import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")

GIB = 1024**3
INF2_CHIP_BPS = 820 * GIB


def tiny_llama(hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=257,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def weight_bytes(model) -> int:
    """Bytes of the parameters and persistent buffers (int8 weights, scales) of ``model``."""
    seen, total = set(), 0
    for t in [*model.parameters(), *(b for n, b in model.named_buffers() if "weight" in n)]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def decode_ms(model, prompts, new: int) -> float:
    from neuron_tp.infer.static_generator import Generator

    gen = Generator(model, [32], new)
    for _ in gen.stream(prompts, new):  # warm-up: captures / compiles every graph
        pass
    it = gen.stream(prompts, new)
    next(it)
    t0 = time.perf_counter()
    steps = sum(1 for _ in it)
    return (time.perf_counter() - t0) * 1e3 / steps


def llama3_8b_bytes_per_token(tp: int, int8: bool) -> float:
    """Weight bytes one decode step reads, summed over the tp ranks (see the module doc)."""
    h, layers, head, q, kv, ffn, vocab = 4096, 32, 128, 32, 8, 14336, 128256
    q_r, kv_r, ffn_r = math.ceil(q / tp), math.ceil(kv / tp), math.ceil(ffn / tp)
    rows = {  # (output rows, input columns) per rank, per layer
        "q": (q_r * head, h),
        "k": (kv_r * head, h),
        "v": (kv_r * head, h),
        "o": (h, q_r * head),
        "gate": (ffn_r, h),
        "up": (ffn_r, h),
        "down": (h, ffn_r),
    }
    linear = sum(o * i for o, i in rows.values())
    scales = sum(o for o, _ in rows.values())  # one bf16 scale per output row
    per_layer = linear * (1 if int8 else 2) + (scales * 2 if int8 else 0) + 2 * h * 2  # + norms
    lm_head = math.ceil(vocab / tp) * h * 2  # bf16: not converted
    embedding_row = h * 2  # one row per token (on one rank)
    return tp * (layers * per_layer + lm_head + h * 2) + embedding_row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()

    import neuron_tp as ntp
    from neuron_tp import hf

    dev = ntp.xla_device()
    mesh = ntp.Mesh(1, 0)
    base = tiny_llama(args.hidden, args.layers).to(torch.bfloat16)
    prompts = [[5, 6, 7, 8, 9]]
    rows = []
    for name in ("bf16", "int8"):
        model = hf.parallelize(copy.deepcopy(base), mesh).eval()
        if name == "int8":
            ntp.quantize(model, mesh)
        nbytes = weight_bytes(model)
        ntp.move_to(model, dev)
        rows.append((name, nbytes, decode_ms(model, prompts, args.new_tokens)))
    print(
        f"tiny Llama hidden {args.hidden}, {args.layers} layers, vocab 257, tp 1, XLA CPU "
        f"device, batch 1, {args.new_tokens} new tokens"
    )
    print(f"{'':6} {'weight bytes/rank':>18} {'decode ms/token':>16}")
    for name, nbytes, ms in rows:
        print(f"{name:6} {nbytes:>18,} {ms:>16.3f}")
    print(f"int8/bf16 bytes: {rows[1][1] / rows[0][1]:.3f}\n")
    print("Llama-3-8B on Inf2, batch 1 decode, HBM bound (820 GiB/s per chip, 2 cores/chip)")
    print(
        f"{'tp':>4} {'chips':>6} {'bf16 GiB/tok':>13} {'bf16 ms/tok':>12} "
        f"{'int8 GiB/tok':>13} {'int8 ms/tok':>12} {'ratio':>6}"
    )
    for tp in (2, 8, 24):
        chips = tp / 2
        b16, b8 = (llama3_8b_bytes_per_token(tp, q) for q in (False, True))
        ms16, ms8 = (b / (chips * INF2_CHIP_BPS) * 1e3 for b in (b16, b8))
        print(
            f"{tp:>4} {chips:>6g} {b16 / GIB:>13.3f} {ms16:>12.3f} {b8 / GIB:>13.3f} "
            f"{ms8:>12.3f} {b8 / b16:>6.3f}"
        )


if __name__ == "__main__":
    main()
