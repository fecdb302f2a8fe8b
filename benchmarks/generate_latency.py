"""Decode latency on the XLA CPU device: replayed graphs vs torch-xla's lazy re-tracing vs
transformers' eager ``generate``, for a tiny Llama (hidden 64) of L layers.

Per configuration (L, batch): wall ms per decode token, device-execute ms per decode token
(torch-xla's ``ExecuteTime`` metric over the same steps), the host's share, TTFT (prefill +
first token) and decode tokens/s; all paths run in this one process on the same weights, after
a warm-up call (no compile is timed). The goal of the replay path: wall <= 2 x execute + 1 ms.

Usage: ``PJRT_DEVICE=CPU python benchmarks/generate_latency.py [--layers 8,32] [--batch 1,8]
[--new-tokens 64]``.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")


def tiny_llama(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=257,
        max_position_embeddings=1024,
    )
    return LlamaForCausalLM(cfg).eval()


def _execute_ms() -> tuple[int, float]:
    import torch_xla.debug.metrics as met

    data = met.metric_data("ExecuteTime")
    return (int(data[0]), data[1] / 1e6) if data else (0, 0.0)


def measure_xla(model, prompts, new: int, replay: bool) -> dict:
    """One warm-up call, then a timed one: TTFT, wall and execute ms per decode step."""
    from neuron_tp.infer.static_generator import Generator

    gen = Generator(model, [32], new, replay=replay)
    for _ in gen.stream(prompts, new):  # warm-up: captures / compiles every graph
        pass
    t0 = time.perf_counter()
    it = gen.stream(prompts, new)
    next(it)
    first = time.perf_counter()
    n0, e0 = _execute_ms()
    steps = sum(1 for _ in it)
    end = time.perf_counter()
    n1, e1 = _execute_ms()
    wall = (end - first) * 1e3 / steps
    execute = (e1 - e0) / steps
    return {
        "ttft_ms": (first - t0) * 1e3,
        "wall_ms": wall,
        "execute_ms": execute,
        "graphs_per_step": (n1 - n0) / steps,
        "tok_s": len(prompts) * steps / (end - first),
    }


def measure_eager(model, prompts, new: int) -> dict:
    """transformers' own greedy ``generate`` on eager CPU torch (left-padded batch)."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    kw = dict(attention_mask=mask, do_sample=False, pad_token_id=0)
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)  # warm-up
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
    total = time.perf_counter() - t0
    wall = (total - ttft) * 1e3 / (new - 1)
    return {"ttft_ms": ttft * 1e3, "wall_ms": wall, "tok_s": len(prompts) * 1e3 / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", default="8,32")
    p.add_argument("--batch", default="1,8")
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    import neuron_tp as ntp
    from neuron_tp import hf

    dev = ntp.xla_device()
    print(
        f"{'L':>3} {'batch':>5} {'path':<22} {'TTFT ms':>8} {'wall ms/tok':>11} "
        f"{'exec ms/tok':>11} {'host share':>10} {'tokens/s':>9} {'goal':>5}"
    )
    for layers in map(int, args.layers.split(",")):
        full = tiny_llama(layers)
        model = hf.parallelize(copy.deepcopy(full), ntp.Mesh(1, 0)).eval().to(dev)
        for batch in map(int, args.batch.split(",")):
            prompts = [[(7 * i + j) % 250 + 1 for j in range(5 + i % 4)] for i in range(batch)]
            rows = {
                "neuron_tp replay": measure_xla(model, prompts, args.new_tokens, True),
                "neuron_tp lazy": measure_xla(model, prompts, args.new_tokens, False),
                "transformers eager": measure_eager(full, prompts, args.new_tokens),
            }
            for name, r in rows.items():
                ex = r.get("execute_ms")
                share = f"{1 - ex / r['wall_ms']:.0%}" if ex else "-"
                goal = "-" if ex is None else ("yes" if r["wall_ms"] <= 2 * ex + 1 else "no")
                exs = f"{ex:.3f}" if ex is not None else "-"
                print(
                    f"{layers:>3} {batch:>5} {name:<22} {r['ttft_ms']:>8.2f} "
                    f"{r['wall_ms']:>11.3f} {exs:>11} {share:>10} {r['tok_s']:>9.0f} {goal:>5}"
                )


if __name__ == "__main__":
    main()
