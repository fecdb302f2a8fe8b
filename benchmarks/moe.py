"""MoE models on the CPU side by side (printed, nothing asserted): a Mixtral-style model (E=8,
k=2, softmax top-k renormalised) and a Qwen3-MoE-style one (E=64, k=8, ``norm_topk_prob``), built
from transformers' own configs with random weights (H=256, 2 layers), next to transformers'
eager MoE and to the DENSE model of the same active size (Llama / Qwen3, MLP intermediate
``k * I``, same hidden size, layers and heads).

1. FLOPs of one MoE layer's experts on ``--flop-tokens`` tokens (``torch.utils.flop_counter``,
   forward), ours per mode over transformers' eager experts (each token through its k experts:
   the ideal), next to the computed factor: dense ``E/k``, capacity ``E*C/(T*k)`` with ``C =
   ceil(cf*T*k/E)`` (about cf), gather 1.
2. gloo tp=2 (2 processes, 1 thread each): forward+backward of the whole model on ``--batch x
   --seq`` tokens (loss on the labels), median ms over ``--repeats``, and saved activation MiB
   per rank (``saved_tensors_hooks``, one count per storage, parameters excluded). Unsharded
   rows run on each rank at once (the same load as the sharded ones).
3. one XLA CPU device (tp=1): the same rows, compiled and warm (step = forward + backward +
   ``torch_xla.sync(wait=True)``), and the graphs compiled over all the row's 3 + repeats steps
   (transformers' MoE only for ``--xla-hf-moe``: its loop over the experts hit compiles new
   graphs as the routing changes); saved MiB counted per saved tensor (XLA tensors have no
   storage to deduplicate views by: an upper bound of what autograd holds; the compiled graph
   decides what is really kept).
4. decode ms/token on the XLA CPU device with graph replay (``neuron_tp.infer.static_generator``,
   ``benchmarks/generate_latency.py``'s measurement; MoE decode runs the ``gather`` mode).

    .venv/bin/python benchmarks/moe.py [--batch 2 --seq 128 --repeats 5 --cf 1.25 --new-tokens 32]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

COMMON = dict(
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=1024,
    max_position_embeddings=512,
)
# family -> (MoE config class, its MoE fields, dense config class, E, k, I)
FAMILIES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8), "LlamaConfig", 8, 2, 512),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(num_experts=64, norm_topk_prob=True, head_dim=32, mlp_only_layers=[]),
        "Qwen3Config",
        64,
        8,
        128,
    ),
}
MIB = 2**20


def build(family: str, dense: bool, experts: str | None = None, seed: int = 0):
    """The tiny model of ``family`` (``dense``: the same active size), random weights;
    ``experts``: transformers' experts implementation (``eager``: its loop over the experts
    hit; None: its default, ``grouped_mm`` where torch has it)."""
    import transformers as tf

    moe_cls, moe_kw, dense_cls, _, k, inter = FAMILIES[family]
    head = {"head_dim": 32} if "head_dim" in moe_kw else {}
    if dense:
        cfg = getattr(tf, dense_cls)(**COMMON, **head, intermediate_size=k * inter)
    else:
        inter_key = "intermediate_size" if family == "mixtral" else "moe_intermediate_size"
        cfg = getattr(tf, moe_cls)(**COMMON, **moe_kw, num_experts_per_tok=k, **{inter_key: inter})
        cfg._experts_implementation = experts
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg)


def rows(family: str, mesh, cf: float) -> dict:
    """row name -> a model ready to train (ours sharded over ``mesh``)."""
    import neuron_tp as ntp

    tp = mesh.tp_size
    out = {"hf MoE eager loop": build(family, False, "eager")}
    out["hf MoE grouped_mm (default)"] = build(family, False)
    for mode in ("dense", "capacity"):
        m = ntp.parallelize(build(family, False), mesh, parallel_loss=True)
        ntp.set_moe_mode(m, mode, capacity_factor=cf if mode == "capacity" else None)
        out[f"ours tp={tp} {mode}" + (f" cf={cf}" if mode == "capacity" else "")] = m
    out["hf dense same-active"] = build(family, True)
    out[f"ours tp={tp} dense same-active"] = ntp.parallelize(
        build(family, True), mesh, parallel_loss=True
    )
    return {name: m.train() for name, m in out.items()}


def saved_bytes(model, ids) -> int:
    """Activation bytes autograd saves in one forward (then runs its backward); parameters
    and views of them are left out."""
    params = {id(p) for p in model.parameters()}
    storages = {
        p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type == "cpu"
    }
    seen: dict[object, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) in params:
            return t
        if t.device.type == "cpu":
            s = t.untyped_storage()
            if s.data_ptr() not in storages:
                seen[s.data_ptr()] = s.nbytes()
        else:  # XLA: no storage; one count per saved tensor (or the tensor it views)
            seen[id(base)] = base.numel() * base.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(ids, labels=ids).loss
    loss.backward()
    return sum(seen.values())


def measure(model, ids, repeats: int, before=lambda: None, after=lambda: None) -> tuple:
    """(median forward+backward ms, saved bytes) after two warm-up steps."""

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        after()

    step(), step()
    model.zero_grad(set_to_none=True)
    saved = saved_bytes(model, ids)
    after()
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, saved


def _count(fn, *args) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        fn(*args)
    return fc.get_total_flops()


def _flop_rows(family: str, t: int, cf: float) -> list[tuple[str, int, float]]:
    """``(mode, counted FLOPs, computed factor)``, transformers' eager experts first."""
    import neuron_tp as ntp
    from neuron_tp.moe import ParallelMoEBlock

    *_, e, k, _inter = FAMILIES[family]
    hf_model = build(family, False, "eager").eval()
    ours = ntp.parallelize(copy.deepcopy(hf_model), ntp.Mesh(1, 0))
    hf_block = next(m for m in hf_model.modules() if type(m).__name__.endswith("MoeBlock"))
    block = next(m for m in ours.modules() if isinstance(m, ParallelMoEBlock))
    x = torch.randn(t, COMMON["hidden_size"])
    with torch.no_grad():
        _, w, idx = hf_block.gate(x)
    out = [("hf eager", _count(hf_block.experts, x, idx, w), 1.0)]
    cap = math.ceil(cf * t * k / e)
    for mode, factor in (("dense", e / k), ("capacity", e * cap / (t * k)), ("gather", 1.0)):
        ntp.set_moe_mode(ours, mode, capacity_factor=cf)
        out.append((mode, _count(block.experts, x, idx, w), factor))
    return out


def flop_table(args) -> None:
    """Section 1: counted expert FLOPs, ours per mode over transformers' eager experts."""
    t = args.flop_tokens
    print(f"\n1. FLOPs of one MoE layer's experts, forward, T={t} tokens, capacity cf={args.cf}")
    print(f"{'family':<10} {'mode':<10} {'GFLOP':>8} {'counted x':>10} {'computed x':>11}")
    for family in FAMILIES:
        rows_ = _flop_rows(family, t, args.cf)
        ideal = rows_[0][1]
        for mode, n, factor in rows_:
            print(f"{family:<10} {mode:<10} {n / 1e9:>8.3f} {n / ideal:>10.2f} {factor:>11.2f}")


def _print_rows(title: str, results: dict) -> None:
    print(f"\n{title}")
    print(f"{'family':<10} {'row':<36} {'fwd+bwd ms':>10} {'saved MiB/rank':>15}")
    for family, res in results.items():
        for name, r in res.items():
            if isinstance(r, str):
                print(f"{family:<10} {name:<36} {'fails: ' + r}")
            else:
                print(f"{family:<10} {name:<36} {r[0]:>10.1f} {r[1] / MIB:>15.2f}")


def _gloo_rank(rank: int, world: int, port: int, args, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import neuron_tp as ntp

    mesh = ntp.init_mesh(tp=world)
    ids = torch.randint(1, COMMON["vocab_size"], (args.batch, args.seq))
    results = {}
    for family in FAMILIES:
        res = results[family] = {}
        for name, model in rows(family, mesh, args.cf).items():
            res[name] = measure(model, ids, args.repeats, before=dist.barrier)
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def gloo_table(args) -> None:
    """Section 2: tp=2 on gloo ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, 2, port, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = out.get()
    for p in procs:
        p.join()
    _print_rows(f"2. gloo tp=2, {args.batch}x{args.seq} tokens, rank 0", results)


def xla_table(args) -> None:
    """Section 3: one XLA CPU device, tp=1; rows printed as measured. transformers' MoE rows
    only for ``--xla-hf-moe`` families (its eager loop recompiles as routing changes)."""
    import torch_xla

    import neuron_tp as ntp
    from neuron_tp.backend.graphs import graph_counters

    dev = ntp.xla_device()
    ids = torch.randint(1, COMMON["vocab_size"], (args.batch, args.seq)).to(dev)
    print(f"\n3. one XLA CPU device, tp=1, {args.batch}x{args.seq} tokens")
    print(f"{'family':<10} {'row':<36} {'fwd+bwd ms':>10} {'saved MiB':>10} {'compiles':>9}")
    for family in FAMILIES:
        for name, model in rows(family, ntp.Mesh(1, 0), args.cf).items():
            if name.startswith("hf MoE") and family not in args.xla_hf_moe:
                continue
            model = ntp.move_to(model, dev)
            c0 = graph_counters()["compiles"]
            try:
                ms, saved = measure(
                    model, ids, args.repeats, after=lambda: torch_xla.sync(wait=True)
                )
                cells = f"{ms:>10.1f} {saved / MIB:>10.2f}"
            except Exception as e:  # noqa: BLE001 - transformers' MoE on XLA: report why
                torch_xla.sync()
                cells = f"fails: {type(e).__name__}: {str(e).splitlines()[0][:60]}"
            n = graph_counters()["compiles"] - c0
            print(f"{family:<10} {name:<36} {cells} {n:>9}", flush=True)


def decode_table(args) -> None:
    """Section 4: decode ms/token with replay, MoE vs dense of the same active size."""
    from generate_latency import measure_xla

    import neuron_tp as ntp

    dev = ntp.xla_device()
    print(f"\n4. decode on one XLA CPU device, graph replay, batch 1, {args.new_tokens} tokens")
    print(
        f"{'family':<10} {'model':<20} {'wall ms/tok':>11} {'exec ms/tok':>11} {'graphs/step':>11}"
    )
    prompt = [[(7 * j) % 250 + 1 for j in range(6)]]
    for family in FAMILIES:
        for label, dense in (("MoE", False), ("dense same-active", True)):
            model = ntp.parallelize(build(family, dense), ntp.Mesh(1, 0)).eval().to(dev)
            r = measure_xla(model, prompt, args.new_tokens, True)
            print(
                f"{family:<10} {label:<20} {r['wall_ms']:>12.3f} {r['execute_ms']:>12.3f} "
                f"{r['graphs_per_step']:>12.2f}"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cf", type=float, default=1.25)
    ap.add_argument("--flop-tokens", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--xla-hf-moe", nargs="*", default=["mixtral"], choices=list(FAMILIES))
    ap.add_argument("--skip", nargs="*", default=[], choices=["flops", "gloo", "xla", "decode"])
    args = ap.parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    print(f"H={COMMON['hidden_size']}, {COMMON['num_hidden_layers']} layers, fp32; ", end="")
    print(", ".join(f"{f}: E={e} k={k} I={i}" for f, (*_, e, k, i) in FAMILIES.items()))
    print(f"load average at start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    for name, fn in (
        ("flops", flop_table),
        ("gloo", gloo_table),
        ("xla", xla_table),
        ("decode", decode_table),
    ):
        if name not in args.skip:
            fn(args)
            sys.stdout.flush()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
