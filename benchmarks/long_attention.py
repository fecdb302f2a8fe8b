"""sdpa vs blockwise attention at long sequences: peak memory and time of one forward+backward
of a 1-layer toy Llama (hidden 256, 4 heads of 64, batch 1), on the XLA CPU device and on
eager CPU, side by side.

Each (device, attention, seq) runs in its own fresh process, so its peak RSS (``ru_maxrss``)
is its own: the number includes the interpreter, torch (and torch-xla's runtime and compiler)
and, on XLA, the compile. ``base`` is the same process's RSS after building the model, before
the first step; ``peak - base`` is what the step added. Time: the mean of 2 steps after a
warm-up step (which compiles on XLA).

    python benchmarks/long_attention.py                       # 2048 4096 8192, xla and cpu
    python benchmarks/long_attention.py --seqs 1024 --devices cpu
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def one(device: str, attention: str, seq: int, block: int) -> dict:
    """Run in a fresh process: the measurements of one configuration."""
    import torch
    import transformers as tf

    from neuron_tp.hf.attention import use_blockwise_attention

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=seq,
    )
    cfg._attn_implementation = "sdpa"
    model = tf.AutoModelForCausalLM.from_config(cfg).train()
    if attention == "blockwise":
        use_blockwise_attention(model, block)
    ids = torch.randint(0, 256, (1, seq))
    if device == "xla":
        import torch_xla

        import neuron_tp as ntp

        dev = ntp.xla_device()
        model, ids = model.to(dev), ids.to(dev)
    base = _rss_mib()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if device == "xla":
            torch_xla.sync()
        _ = loss.item()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"base_mib": base, "peak_mib": peak, "step_s": sum(times[1:]) / 2, "first_s": times[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--devices", nargs="+", default=["xla", "cpu"], choices=["xla", "cpu"])
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], args.one[1], int(args.one[2]), args.block)))
        return
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    print(f"1-layer Llama, hidden 256, 4 heads x 64, batch 1, blockwise block {args.block}")
    print(
        f"{'device':6} {'seq':>6} | {'sdpa peak':>10} {'(+step)':>9} {'time':>8} | "
        f"{'blockwise peak':>14} {'(+step)':>9} {'time':>8}"
    )
    for device in args.devices:
        for seq in args.seqs:
            row = {}
            for attention in ("sdpa", "blockwise"):
                cmd = [sys.executable, __file__, "--block", str(args.block), "--one"]
                proc = subprocess.run(
                    [*cmd, device, attention, str(seq)], env=env, capture_output=True, text=True
                )
                if proc.returncode:
                    row[attention] = None
                    print(proc.stderr[-1500:], file=sys.stderr)
                else:
                    row[attention] = json.loads(proc.stdout.strip().splitlines()[-1])
            cells = []
            for attention in ("sdpa", "blockwise"):
                r = row[attention]
                w = 10 if attention == "sdpa" else 14
                if r is None:
                    cells.append(f"{'failed':>{w}} {'':>9} {'':>8}")
                else:
                    peak, added = r["peak_mib"], r["peak_mib"] - r["base_mib"]
                    cells.append(
                        f"{peak / 1024:>{w - 4}.2f} GiB {added:>5.0f} MiB {r['step_s']:>7.2f}s"
                    )
            print(f"{device:6} {seq:>6} | {cells[0]} | {cells[1]}", flush=True)


if __name__ == "__main__":
    main()
