"""LoRA vs full fine-tuning under tensor parallelism: per-rank trainable parameters, optimizer
state bytes and step time of ``neuron-tp train``, gloo CPU ranks, tp=2, in the same run.

The model is a Llama (hidden 512, 4 layers, 8 heads / 4 kv heads, saved to a temporary HF
directory and read slice by slice); LoRA adapts every attention and MLP projection. Rank 0
reports the median wall time of the steps after ``--warmup``.

    .venv/bin/python benchmarks/lora_train.py [--steps 10 --seq-len 128 --lora-r 16]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _worker(rank: int, world: int, port: int, lora: bool, args, model: str, out: str, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    os.environ["WORLD_SIZE"] = str(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import neuron_tp as ntp
    from neuron_tp.cli.args import train_parser
    from neuron_tp.train.loop import train

    mesh = ntp.init_mesh(tp=world)
    argv = ["--device", "cpu", "--model", model, "--tokenizer", "bytes", "--tp", str(world)]
    argv += ["--resume", "none"]
    argv += ["--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch)]
    argv += ["--steps", str(args.steps), "--log-every", "1000", "--output-dir", out]
    argv += ["--save-every", "0"]
    if lora:
        argv += ["--lora-r", str(args.lora_r), "--lora-alpha", str(2 * args.lora_r)]
        argv += ["--lora-target-modules", TARGETS]
    marks: list[float] = []
    runs = []

    def on_step(run):
        marks.append(time.perf_counter())
        runs[:] = [run]

    train(train_parser().parse_args(argv), mesh, printer=lambda *a, **k: None, on_step=on_step)
    run = runs[0]
    params = list({id(p): p for p in run.model.parameters()}.values())
    state = [t for st in run.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
    steps = [b - a for a, b in zip(marks, marks[1:])][args.warmup :]
    if rank == 0:
        queue.put(
            {
                "trainable": sum(p.numel() for p in params if p.requires_grad),
                "total": sum(p.numel() for p in params),
                "optimizer_mb": sum(t.numel() * t.element_size() for t in state) / 2**20,
                "ms_step": 1e3 * statistics.median(steps),
            }
        )
    dist.destroy_process_group()


def _run(lora: bool, args, model: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as out:
        procs = [
            ctx.Process(target=_worker, args=(r, args.tp, port, lora, args, model, out, queue))
            for r in range(args.tp)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(1800)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"lora={lora}: ranks exited with {[p.exitcode for p in procs]}")
    return queue.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lora-r", type=int, default=16)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=257,
        max_position_embeddings=1024,
    )
    with tempfile.TemporaryDirectory() as model:
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(model)
        rows = {"full": _run(False, args, model), f"LoRA r={args.lora_r}": _run(True, args, model)}
    print(
        f"Llama hidden 512 x 4 layers, tp={args.tp} gloo CPU, seq {args.seq_len} x micro-batch "
        f"{args.micro_batch}; per rank (rank 0), median ms/step after {args.warmup} steps"
    )
    print("| fine-tuning | trainable params | of all params | AdamW state MiB | ms/step |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['trainable']:,} | {r['trainable'] / r['total']:.2%} | "
            f"{r['optimizer_mb']:.2f} | {r['ms_step']:.1f} |"
        )


if __name__ == "__main__":
    main()
