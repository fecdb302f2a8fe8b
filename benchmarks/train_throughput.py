"""Training throughput of the tiny preset, and graph counts.

1. CPU, gloo: neuron_tp TP=2 on 2 ranks (torchrun) vs the plain transformers model trained
   unsharded on 1 rank (same data, AdamW, schedule, clipping).
2. XLA CPU device, one rank: neuron_tp at tp=1 (``neuron_tp.hf.parallelize`` + parallel loss,
   the training loop of ``neuron-tp train``) vs the plain transformers model in a minimal loop
   (same optimizer settings, one ``mark_step`` per step); overhead = plain / neuron_tp - 1.
3. Graph counts: the training run and generating 64 tokens on the XLA CPU device.

Each measurement runs in a fresh process; tokens/s are steady state (steps WARMUP..end, device
drained at both marks, final checkpoint not timed), median of ``--repeat`` alternating runs.
Usage: ``python benchmarks/train_throughput.py [--steps 30]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 5
TRAIN = [
    "--seq-len",
    "128",
    "--micro-batch",
    "8",
    "--log-every",
    "1000",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "3",
    "--resume",
    "none",
    "--save-every",
    "0",
]


def _drain(device) -> None:
    if device.type == "xla":
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()


def worker_ntp(opts) -> dict:
    from neuron_tp.backend.graphs import graph_counters
    from neuron_tp.cli.args import train_parser
    from neuron_tp.train.loop import train

    args = train_parser().parse_args(
        [
            *TRAIN,
            "--device",
            opts.device,
            "--tp",
            str(opts.tp),
            "--steps",
            str(opts.steps),
            "--output-dir",
            opts.out,
        ]
    )
    marks = {}

    def on_step(run):
        if run.step in (WARMUP, opts.steps):  # the final checkpoint save is not timed
            _drain(run.device)
            marks[run.step] = time.perf_counter()

    train(args, on_step=on_step, printer=lambda *a, **k: None)
    tokens = (
        (opts.steps - WARMUP)
        * args.seq_len
        * args.micro_batch
        * (int(os.environ.get("WORLD_SIZE", "1")) // opts.tp)
    )
    return {"tokens_per_s": tokens / (marks[opts.steps] - marks[WARMUP]), **graph_counters()}


def worker_plain(opts) -> dict:
    import torch

    from neuron_tp.backend.graphs import graph_counters, step_boundary
    from neuron_tp.cli.args import REPO_DATA
    from neuron_tp.job.data import ByteTokenizer, PackedData
    from neuron_tp.job.presets import build_model
    from neuron_tp.optim.adamw import WarmupCosine, make_optimizer

    device = torch.device("cpu")
    if opts.device == "xla":
        import neuron_tp

        device = neuron_tp.xla_device()
    model = build_model("tiny-llama", ByteTokenizer.vocab_size, 0).to(device).train()
    data = PackedData(REPO_DATA, ByteTokenizer(), 128, 8, dp_size=1, dp_rank=0, seed=0)
    opt = make_optimizer(model, 3e-3, 0.01, device)  # the same AdamW settings
    sched = WarmupCosine(opt, 3e-3, 1e-4, 3, opts.steps)
    t0 = None
    for step in range(1, opts.steps + 1):
        opt.zero_grad(set_to_none=True)
        sched.apply()
        ids = data.next_batch().to(device)
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step_boundary(device)
        if step == WARMUP:
            _drain(device)
            t0 = time.perf_counter()
    _drain(device)
    return {
        "tokens_per_s": (opts.steps - WARMUP) * 128 * 8 / (time.perf_counter() - t0),
        **graph_counters(),
    }


def worker_generate(opts) -> dict:
    import neuron_tp as ntp

    dev = ntp.xla_device()
    from neuron_tp import hf
    from neuron_tp.backend.graphs import graph_counters
    from neuron_tp.infer.static_generator import generate
    from neuron_tp.job.presets import build_model

    model = hf.parallelize(build_model("tiny-llama", 257, 0), ntp.Mesh(1, 0)).eval().to(dev)
    t0 = time.perf_counter()
    generate(model, [list(b"The old miller"), list(b"A")], 64, [32, 128])
    return {"graphs": graph_counters()["compiles"], "seconds": time.perf_counter() - t0}


def _run(cmd: list[str], env_extra: dict, scratch: str | None = None) -> dict:
    if scratch:  # each run starts from an empty output directory (no resume, no refusal)
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    env = {
        **os.environ,
        "PYTHONPATH": REPO,
        "OMP_NUM_THREADS": "1",
        "PJRT_DEVICE": "CPU",
        **env_extra,
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("JSON"))[4:])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", choices=("ntp", "plain", "generate"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", default="/tmp/ntp-bench")
    p.add_argument("--repeat", type=int, default=3, help="runs per case (median reported)")
    opts = p.parse_args()
    if opts.worker:
        fn = {"ntp": worker_ntp, "plain": worker_plain, "generate": worker_generate}
        result = fn[opts.worker](opts)
        if int(os.environ.get("RANK", "0")) == 0:
            print("JSON" + json.dumps(result))
        return
    me = [sys.executable, os.path.abspath(__file__), "--steps", str(opts.steps)]
    torchrun = [os.path.join(os.path.dirname(sys.executable), "torchrun"), "--standalone"]

    def paired(a, b):
        """Alternate the two cases ``repeat`` times (machine load drifts); medians."""
        runs = [(_run(a, {}, opts.out), _run(b, {}, opts.out)) for _ in range(opts.repeat)]

        def med(rs):
            return sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2]

        return med([r[0] for r in runs]), med([r[1] for r in runs])

    res = {}
    res["cpu_tp2_2ranks"], res["cpu_plain_1rank"] = paired(
        [
            *torchrun,
            "--nproc_per_node=2",
            *me[1:],
            "--worker",
            "ntp",
            "--device",
            "cpu",
            "--tp",
            "2",
            "--out",
            opts.out + "/a",
        ],
        [*me, "--worker", "plain", "--device", "cpu"],
    )
    res["xla_ntp_tp1"], res["xla_plain"] = paired(
        [*me, "--worker", "ntp", "--device", "xla", "--out", opts.out + "/b"],
        [*me, "--worker", "plain", "--device", "xla"],
    )
    res["xla_generate_64"] = _run([*me, "--worker", "generate"], {})
    res["cpu_tp2_vs_unsharded"] = (
        res["cpu_tp2_2ranks"]["tokens_per_s"] / res["cpu_plain_1rank"]["tokens_per_s"]
    )
    res["xla_overhead_vs_plain"] = (
        res["xla_plain"]["tokens_per_s"] / res["xla_ntp_tp1"]["tokens_per_s"] - 1
    )
    print(json.dumps(res, indent=1))
    print(
        f"CPU gloo: TP=2 on 2 ranks {res['cpu_tp2_2ranks']['tokens_per_s']:,.0f} tok/s vs "
        f"unsharded 1 rank {res['cpu_plain_1rank']['tokens_per_s']:,.0f} tok/s "
        f"(ratio {res['cpu_tp2_vs_unsharded']:.2f})"
    )
    print(
        f"XLA CPU: neuron_tp tp=1 {res['xla_ntp_tp1']['tokens_per_s']:,.0f} tok/s vs plain "
        f"transformers {res['xla_plain']['tokens_per_s']:,.0f} tok/s: overhead "
        f"{100 * res['xla_overhead_vs_plain']:+.1f}% (target <= 5%)"
    )
    print(
        f"graphs: training {res['xla_ntp_tp1']['compiles']} (plain loop "
        f"{res['xla_plain']['compiles']}), generating 64 tokens {res['xla_generate_64']['graphs']}"
    )


if __name__ == "__main__":
    main()
