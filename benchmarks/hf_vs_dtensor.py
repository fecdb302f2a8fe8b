"""neuron_tp vs PyTorch DTensor tensor parallelism on a HF Llama, 2 gloo CPU ranks.

The same tiny random Llama (default hidden 512, 4 layers, seq 256) is stepped (forward +
backward of the causal-LM loss) three ways, one thread per rank:

* unsharded, on rank 0 alone;
* neuron_tp TP=2: ``neuron_tp.hf.parallelize`` (training mode ``parallel_loss=True``: the
  vocab-sharded head feeds the parallel cross-entropy; full-logits mode and sequence
  parallelism also timed);
* DTensor TP=2: ``torch.distributed.tensor.parallel.parallelize_module`` with the standard
  Colwise/Rowwise plan (q/k/v/gate/up colwise, o/down rowwise, embedding rowwise, LM head
  colwise with replicated output, loss on the full logits).

Prints the median step time of each, the parallel efficiency (unsharded / (2 x TP=2)), the
ratio neuron_tp / DTensor, and the max abs difference of each model's logits vs unsharded.

    .venv/bin/python benchmarks/hf_vs_dtensor.py [--hidden 512 --layers 4 --seq 256 --steps 5]
"""

from __future__ import annotations

import argparse
import copy
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _model(args):
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 8 // 3 // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
    )
    cfg._attn_implementation = "sdpa"
    return tf.AutoModelForCausalLM.from_config(cfg)


def _interleaved(steps: dict, rounds: int, rank: int, warmup: int = 2) -> dict[str, float]:
    """Median step time of each variant, measured round-robin (one step of each per round) so
    that other load on the machine hits all variants alike. ``unsharded`` runs on rank 0 only
    while rank 1 waits."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for i in range(warmup + rounds):
        for name, step in steps.items():
            dist.barrier()
            if name == "unsharded" and rank != 0:
                continue
            t0 = time.perf_counter()
            step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) if v else float("nan") for k, v in times.items()}


def _stepper(model, ids, after=None):
    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        if after:
            after(model)

    return step


def _dtensor(model, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
        )
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Replicate()
            ),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    del Shard
    return model


def _worker(rank: int, port: int, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.device_mesh import init_device_mesh

    import neuron_tp as ntp
    from neuron_tp.hf import parallelize

    ids = torch.randint(
        0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0)
    )
    base = _model(args)
    with torch.no_grad():
        ref_logits = base(ids).logits
    mesh = ntp.init_mesh(tp=2)
    ntp_model = parallelize(copy.deepcopy(base), mesh, parallel_loss=True)
    full = parallelize(copy.deepcopy(base), mesh)
    sp = parallelize(copy.deepcopy(base), mesh, sequence_parallel=True, parallel_loss=True)
    dt = _dtensor(copy.deepcopy(base), init_device_mesh("cpu", (2,)))
    steps = {
        "unsharded": _stepper(copy.deepcopy(base), ids),
        "neuron_tp": _stepper(ntp_model, ids, ntp.sync_sequence_parallel_grads),
        "neuron_tp_full_logits": _stepper(full, ids),
        "neuron_tp_sp": _stepper(sp, ids, ntp.sync_sequence_parallel_grads),
        "dtensor": _stepper(dt, ids),
    }
    res = _interleaved(steps, args.steps, rank)
    with torch.no_grad():
        res["neuron_tp_diff"] = (full(ids).logits - ref_logits).abs().max().item()
        out = dt(ids).logits
        out = out.full_tensor() if hasattr(out, "full_tensor") else out
        res["dtensor_diff"] = (out - ref_logits).abs().max().item()
    if rank == 0:
        queue.put(res)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    r = queue.get()
    print(
        f"Llama hidden={args.hidden} layers={args.layers} seq={args.seq} batch={args.batch} "
        f"vocab={args.vocab}, 2 gloo ranks x 1 thread, median of {args.steps} interleaved steps"
    )
    print(f"  unsharded (1 rank)          {r['unsharded']:.3f} s/step")
    print(
        f"  neuron_tp TP=2 (par. loss)  {r['neuron_tp']:.3f} s/step  efficiency "
        f"{r['unsharded'] / (2 * r['neuron_tp']):.0%}"
    )
    print(
        f"  neuron_tp TP=2 (full logits){r['neuron_tp_full_logits']:.3f} s/step  efficiency "
        f"{r['unsharded'] / (2 * r['neuron_tp_full_logits']):.0%}"
    )
    print(
        f"  neuron_tp TP=2 + SP         {r['neuron_tp_sp']:.3f} s/step  efficiency "
        f"{r['unsharded'] / (2 * r['neuron_tp_sp']):.0%}"
    )
    print(
        f"  DTensor   TP=2              {r['dtensor']:.3f} s/step  efficiency "
        f"{r['unsharded'] / (2 * r['dtensor']):.0%}"
    )
    print(f"  neuron_tp / DTensor         {r['neuron_tp'] / r['dtensor']:.2f}x")
    print(
        f"  max |logits - unsharded|    neuron_tp {r['neuron_tp_diff']:.2e}   "
        f"DTensor {r['dtensor_diff']:.2e}"
    )


if __name__ == "__main__":
    main()
