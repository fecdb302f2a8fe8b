"""A long prompt served with the KV cache split by heads (kv heads replicated) and by sequence
(``--kv-split sequence``), side by side, on 2 gloo ranks (tp 2), through serve's engine.

A tiny Llama (hidden 64, 2 layers, 4 query heads, ONE kv head: replicated on both ranks with
the by-heads layout; rope theta 500k, positions for the whole prompt) takes one greedy request
of ``--prompt-tokens`` random tokens and ``--new`` new ones through the continuous-batching
:class:`~neuron_tp.infer.engine.Engine` (rank 0 schedules, rank 1 follows its leases; the
prompt is prefilled in chunks of ``--chunk``). Printed per layout: the KV bytes per rank (sum
of the cache tensors), the prefill seconds (submit -> first token), the decode ms per token,
and whether the tokens equal transformers' greedy ``generate`` on the unsharded model
(``--no-reference`` skips that check).

Usage: ``python benchmarks/kv_split.py [--prompt-tokens 16384] [--chunk 1024] [--new 16]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

import torch
import torch.multiprocessing as mp


def kv1_llama(max_positions: int):
    """The tiny one-kv-head Llama, its output head scaled by 15 (random logits are nearly
    uniform; scaled, greedy's argmax is not decided by rounding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=max_positions,
        rope_theta=500000.0,
        vocab_size=257,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(15.0)
    return model


def prompt_ids(n: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(1, 256, (n,), generator=g).tolist()


def serve_one(engine, prompt: list[int], new: int) -> tuple[list[int], float, float]:
    """Rank 0: one greedy request through the running engine; its tokens, the seconds to its
    first token and the seconds per later token."""
    from neuron_tp.infer.sampling import Sampling
    from neuron_tp.infer.schedule import Done, Failed

    done, end = threading.Event(), []

    def sink(ev) -> None:
        if isinstance(ev, (Done, Failed)):
            end.append(ev)
            done.set()

    t0 = time.perf_counter()
    req = engine.submit(prompt, new, Sampling(), [], sink=sink)
    while not req.tokens and not done.is_set():
        time.sleep(0.001)
    t1 = time.perf_counter()
    done.wait()
    t2 = time.perf_counter()
    if isinstance(end[0], Failed):
        raise RuntimeError(end[0].message)
    return list(req.tokens), t1 - t0, (t2 - t1) / max(new - 1, 1)


def _client(engine, prompt: list[int], new: int, result: list) -> None:
    """Rank 0's client thread: the request once the engine is ready, then its shutdown."""
    try:
        engine.wait_ready()
        result.append(serve_one(engine, prompt, new))
    except BaseException as e:  # noqa: BLE001 - re-raised on the rank's main thread
        result.append(e)
    finally:
        engine.shutdown()


def rank_main(rank: int, args, port: int, want) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ.update(WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import neuron_tp as ntp
    from neuron_tp import hf
    from neuron_tp.infer.engine import Engine
    from neuron_tp.infer.slot_generator import SlotGenerator
    from neuron_tp.job.data import ByteTokenizer

    mesh = ntp.init_mesh(tp=2, backend="gloo")
    max_len = args.prompt_tokens + args.new
    model = hf.parallelize(kv1_llama(max_len + 32), mesh).eval()
    prompt = prompt_ids(args.prompt_tokens)
    for mode in ("heads", "sequence"):
        gen = SlotGenerator(model, 1, max_len, chunk=args.chunk, kv_split=mode)
        engine = Engine(mesh.group("world"))
        engine.attach(gen, ByteTokenizer(), [], args.new)
        with torch.no_grad():
            engine.warmup()
            if rank != 0:
                engine.follow()
                continue
            result: list = []
            client = threading.Thread(target=_client, args=(engine, prompt, args.new, result))
            client.start()
            engine.start(thread=False)  # host rounds are counted per thread: keep the main one
            client.join()
        if isinstance(result[0], BaseException):
            raise result[0]
        tokens, prefill, decode = result[0]
        same = "not checked" if want is None else tokens == want
        print(
            f"kv split {mode:8s}: KV {gen.kv_bytes / 2**20:7.3f} MiB per rank, prefill "
            f"{prefill:7.1f} s, decode {decode * 1e3:7.1f} ms/token, tokens == "
            f"transformers: {same}",
            flush=True,
        )
        if want is not None and not same:
            print(f"  got  {tokens}\n  want {want}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=1024)
    p.add_argument("--new", type=int, default=16)
    p.add_argument("--no-reference", action="store_true")
    args = p.parse_args()
    want = None
    if not args.no_reference:
        full = kv1_llama(args.prompt_tokens + args.new + 32)
        ids = torch.tensor([prompt_ids(args.prompt_tokens)])
        t0 = time.perf_counter()
        with torch.no_grad():
            out = full.generate(ids, max_new_tokens=args.new, do_sample=False, pad_token_id=0)
        want = out[0, args.prompt_tokens :].tolist()
        print(f"transformers generate: {time.perf_counter() - t0:.1f} s", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(rank_main, args=(args, port, want), nprocs=2)


if __name__ == "__main__":
    main()
