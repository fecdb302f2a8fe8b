"""Training-entry-point runs executed on N XLA CPU devices (tests/helpers/xla_dist.py), used by
test_train_xla_multi.py: each rank runs ``neuron_tp.train.loop.train`` exactly as a Neuron job
would; rank 0 also records the process-wide compile / host-transfer counters after every step,
counted from the start of the run (all ranks meet at a barrier first, so a step's counts are
complete). The runs of test_train_xla_multi.py are the cases of two launches (``on_two``,
``on_four``: ``xla_dist.run_cases``), so they share one process per device count."""

from __future__ import annotations

import os
import shutil
import threading

import neuron_tp as ntp
from neuron_tp.backend.graphs import graph_counters
from neuron_tp.cli.args import train_parser
from neuron_tp.parallel.sharding import named_parameter_meta
from neuron_tp.train.loop import train
from train_cpu import SCHEDULE

COMMON = ["--device", "xla", *SCHEDULE]
_barriers: dict[int, threading.Barrier] = {}
_barrier_lock = threading.Lock()


def _barrier(n: int) -> threading.Barrier:
    with _barrier_lock:
        return _barriers.setdefault(n, threading.Barrier(n))


def args_for(out: str, *extra: str):
    return train_parser().parse_args([*COMMON, "--output-dir", out, *extra])


def run_train(
    tp: int,
    out: str,
    extra: list[str],
    stop_at: int | None = None,
    cp: int = 1,
    pp: int = 1,
    *,
    ep: int = 1,
) -> dict:
    """One rank of a training run; returns the log (every rank), per-step counters (rank 0),
    and every replicated parameter (to compare across ranks)."""
    import torch_xla.runtime as xr

    world = xr.world_size()
    mesh = ntp.init_mesh(tp=tp, cp=cp, pp=pp, ep=ep)
    per_step, barrier, holder = [], _barrier(world), {}
    barrier.wait()
    start = graph_counters()  # earlier runs of this process are not this run's
    barrier.wait()

    def on_step(run):
        holder["run"] = run
        barrier.wait()
        if mesh.rank == 0:
            now = graph_counters()
            per_step.append({"step": run.step, **{k: now[k] - start[k] for k in now}})
        barrier.wait()

    s = train(
        args_for(out, "--tp", str(tp), *extra),
        mesh,
        stop_at=stop_at,
        printer=lambda *a, **k: None,
        on_step=on_step,
    )
    replicated = {}
    if "run" in holder:
        replicated = {
            n: p.detach().cpu()
            for n, p, m in named_parameter_meta(holder["run"].model)
            if m.sharding is None
        }
    return {
        "rank": mesh.rank,
        "log": s["log"],
        "per_step": per_step,
        "checkpoints": s["checkpoints"],
        "replicated": replicated,
    }


def run_train_rank1_differs(out: str) -> str:
    """Rank 1's model multiplies its logits by a constant (a rank-dependent Python branch, as
    a per-node option would make): ranks trace different step graphs. Returns the error."""
    from neuron_tp import hf
    from neuron_tp.train.graph_guard import GraphMismatchError

    original = hf.parallelize

    def parallelize(model, mesh=None, **kw):
        model = original(model, mesh, **kw)
        if mesh.rank == 1:
            head = model.get_output_embeddings()
            head.register_forward_hook(lambda _m, _a, y: y * 1.0001)
        return model

    hf.parallelize = parallelize  # module-wide, but only rank 1 changes its model
    try:
        run_train(2, out, ["--steps", "2", "--micro-batch", "2"])
    except GraphMismatchError as e:
        return str(e)
    finally:
        hf.parallelize = original
    return "no error"


GEN_PROMPTS = [[72, 101, 108], [84, 104, 101, 32, 111, 108, 100], list(range(97, 108))]
GEN_EOS = [131, 215]  # seed-4 tiny Llama: ends row 0 after 3 tokens, row 1 after 6, not row 2


def run_generate(tp: int) -> dict:
    """Generation on a tp-sharded tiny Llama (every rank the same calls) through one
    Generator: greedy, a longer greedy call, sampling, a batch bucket with a filler row and
    per-sequence EOS; with the number of model traces and process-wide compiles after each
    call (replay: the model's Python runs once per graph shape, never per token)."""
    import copy

    from neuron_tp import hf
    from neuron_tp.infer.sampling import Sampling
    from neuron_tp.infer.static_generator import Generator
    from neuron_tp.job.presets import build_model
    from xla_dist import serial

    mesh = ntp.init_mesh(tp=tp)
    with serial():  # the global RNG; parallelize's host agreement must run outside the lock
        full = build_model("tiny-llama", 257, 4).eval()
    model = hf.parallelize(copy.deepcopy(full), mesh)
    model = ntp.move_to(model.eval(), ntp.xla_device())
    gen = Generator(model, [16], 20, batch_buckets=[1, 4])
    sample = Sampling(do_sample=True, temperature=0.8, top_k=20, seed=9)
    res, counts = {}, []
    for name, prompts, n, kw in (
        ("greedy", GEN_PROMPTS, 10, {}),
        ("greedy_long", GEN_PROMPTS, 20, {}),
        ("sample", GEN_PROMPTS, 10, {"sampling": sample}),
        ("eos", GEN_PROMPTS, 20, {"eos_ids": GEN_EOS}),
        ("single", GEN_PROMPTS[1:2], 20, {}),
    ):
        res[name] = gen.generate(prompts, n, **kw)
        _barrier(mesh.world_size).wait()  # every rank's graphs are counted before reading
        counts.append((gen.traces, graph_counters()["compiles"]))
        _barrier(mesh.world_size).wait()
    res["counts"] = counts
    return res


# The runs of test_train_xla_multi.py: the options of each (the test runs the reference with
# the same ones), and the cases of the 2- and 4-device launches, in order.
QWEN3 = ["--model", "tiny-qwen3", "--micro-batch", "2", "--steps", "8", "--log-every", "2"]
QWEN3 += ["--save-every", "4"]
DP2_SP = ["--micro-batch", "2", "--grad-accum", "2", "--steps", "6", "--sequence-parallel"]
DP2_SP += ["--save-every", "0"]
RECOMPUTE_BASE = ["--micro-batch", "2", "--steps", "4", "--save-every", "0"]
# full (with SP) on the XLA devices, selective on gloo ranks (the XLA checkpoint wrapper is
# the same for both: neuron_tp.hf.recompute.checkpoint)
RECOMPUTE = {"recompute-full-sp": ["--activation-checkpointing", "full", "--sequence-parallel"]}
# pp 2 x tp 2 (dp 1) on the rows of DP2_SP (its dp 2 x micro-batch 2 is one micro-batch of 4),
# its first 3 steps (the same learning rates: warm-up)
PP2_SP = ["--micro-batch", "4", "--grad-accum", "2", "--steps", "3", "--sequence-parallel"]
PP2_SP += ["--save-every", "0", "--pp", "2"]
ZERO1 = ["--zero1", "--micro-batch", "1", "--steps", "8", "--log-every", "2", "--save-every", "4"]
LORA = ["--micro-batch", "2", "--steps", "6", "--save-every", "0", "--sequence-parallel"]
LORA += ["--lora-r", "4", "--lora-alpha", "12"]
LORA += ["--lora-target-modules", "q_proj,v_proj,o_proj,down_proj"]
ON_TWO = ("qwen3", *RECOMPUTE, "zero1", "lora", "generate", "rank1-differs")
ON_FOUR = ("tp2-dp2-sp", "pp2-tp2-sp", "qwen3-tp4")


def _copy_checkpoint(ckpt: str, out: str) -> None:
    """Rank 0 copies ``ckpt`` into ``out``/checkpoints; every rank waits for it."""
    import torch_xla.runtime as xr

    barrier = _barrier(xr.world_size())
    barrier.wait()
    if xr.global_ordinal() == 0:
        os.makedirs(os.path.join(out, "checkpoints"))
        shutil.copytree(ckpt, os.path.join(out, "checkpoints", os.path.basename(ckpt)))
    barrier.wait()


def on_two(case: str, base: str) -> object:
    """One case of the 2-device launch; outputs under ``base``/``case``."""
    out = os.path.join(base, case)
    if case == "qwen3":  # then resume its step-4 checkpoint in a new run
        first = run_train(2, f"{out}/xla", QWEN3)
        _copy_checkpoint(f"{out}/xla/checkpoints/step-00000004", f"{out}/resumed")
        return {"first": first, "again": run_train(2, f"{out}/resumed", QWEN3)}
    if case in RECOMPUTE:
        return run_train(2, f"{out}/xla", RECOMPUTE_BASE + RECOMPUTE[case])
    if case == "zero1":  # tp=1 x dp=2, then resume its step-4 checkpoint
        first = run_train(1, f"{out}/xla", ZERO1)
        _copy_checkpoint(f"{out}/xla/checkpoints/step-00000004", f"{out}/resumed")
        return {"first": first, "again": run_train(1, f"{out}/resumed", ZERO1)}
    if case == "lora":
        return run_train(2, f"{out}/xla", LORA)
    if case == "generate":
        return run_generate(2)
    if case == "rank1-differs":
        return run_train_rank1_differs(f"{out}/run")
    raise ValueError(f"unknown case {case!r}; valid: {ON_TWO}")


def on_four(case: str, base: str) -> object:
    """One case of the 4-device launch (``qwen3-tp4`` resumes the 2-device ``qwen3`` run's
    step-4 checkpoint at tp=4)."""
    out = os.path.join(base, case)
    if case == "tp2-dp2-sp":
        return run_train(2, f"{out}/xla", DP2_SP)
    if case == "pp2-tp2-sp":
        return run_train(2, f"{out}/xla", PP2_SP, pp=2)
    if case == "qwen3-tp4":
        _copy_checkpoint(f"{base}/qwen3/xla/checkpoints/step-00000004", out)
        return run_train(4, out, QWEN3)
    raise ValueError(f"unknown case {case!r}; valid: {ON_FOUR}")
