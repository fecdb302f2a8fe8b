"""A long prompt in the slot engine with the KV cache split by heads (kv heads replicated) and
by sequence (``--kv-split sequence``), side by side, on 2 gloo ranks (tp 2).

A tiny Llama (hidden 64, 2 layers, 4 query heads, ONE kv head: replicated on both ranks with
the by-heads layout) prefills a ``--prompt``-token prompt in chunks of ``--chunk`` and decodes
``--new`` tokens. Printed per layout: the KV bytes per rank (sum of the cache tensors), the
prefill seconds, the decode ms per token, and whether the tokens equal transformers' greedy
``generate`` on the unsharded model (``--no-reference`` skips that check).

Usage: ``python benchmarks/kv_split.py [--prompt 16384] [--chunk 1024] [--new 8]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.multiprocessing as mp


def kv1_llama(max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        vocab_size=257,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg).eval()


def run(gen, prompt: list[int], chunk: int, new: int) -> tuple[list[int], float, float]:
    slot, n = gen.acquire(), len(prompt)
    from neuron_tp.infer.sampling import Sampling

    t0 = time.perf_counter()
    for start in range(0, n, chunk):
        last = start + chunk >= n
        tok = gen.prefill(slot, prompt[start : start + chunk], start, Sampling() if last else None)
    t1 = time.perf_counter()
    out = [tok]
    while len(out) < new:
        out.append(gen.decode()[slot])
    t2 = time.perf_counter()
    gen.release(slot)
    return out, t1 - t0, (t2 - t1) / max(new - 1, 1)


def rank_main(rank: int, args, port: int, want) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.infer.slot_generator import SlotGenerator

    mesh = ntp.init_mesh(tp=2, backend="gloo")
    model = hf.parallelize(kv1_llama(args.prompt + args.new), mesh).eval()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 256, (args.prompt,), generator=g).tolist()
    max_len = args.prompt + args.new
    for mode in ("heads", "sequence"):
        gen = SlotGenerator(model, 1, max_len, chunk=args.chunk, kv_split=mode)
        with torch.no_grad():
            tokens, prefill, decode = run(gen, prompt, args.chunk, args.new)
        if rank == 0:
            same = "not checked" if want is None else tokens == want
            print(
                f"kv split {mode:8s}: KV {gen.kv_bytes / 2**20:7.2f} MiB per rank, prefill "
                f"{prefill:6.1f} s, decode {decode * 1e3:7.1f} ms/token, tokens == "
                f"transformers: {same}",
                flush=True,
            )
        del gen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--new", type=int, default=8)
    p.add_argument("--no-reference", action="store_true")
    args = p.parse_args()
    want = None
    if not args.no_reference:
        full = kv1_llama(args.prompt + args.new)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1, 256, (1, args.prompt), generator=g)
        with torch.no_grad():
            out = full.generate(ids, max_new_tokens=args.new, do_sample=False, pad_token_id=0)
        want = out[0, args.prompt :].tolist()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args, port, want), nprocs=2)


if __name__ == "__main__":
    main()
