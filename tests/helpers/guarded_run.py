"""One ``train()`` call of the training guard tests (two gloo ranks, tp=2 by default) with its
outcome recorded instead of raised, optionally with NaN gradients injected on rank 1 only."""

from __future__ import annotations

import argparse
import os
import time

from neuron_tp.checkpoint.outdir import LOCK_NAME
from neuron_tp.cli.args import train_parser

# the schedule of every guard run (tiny, warm-up 2, cosine to 1e-4, clipping at 1.0)
SCHEDULE = [
    "--seq-len",
    "32",
    "--micro-batch",
    "2",
    "--log-every",
    "1",
    "--warmup-steps",
    "2",
    "--lr",
    "3e-3",
    "--min-lr",
    "1e-4",
    "--max-grad-norm",
    "1.0",
]
COMMON = ["--device", "cpu", "--tp", "2", *SCHEDULE]
POISONED = "model.layers.0.mlp.down_proj.weight"  # NaN gradient on rank 1 at one step


def guard_args(out, *extra: str) -> argparse.Namespace:
    """``neuron-tp train`` options of the guard tests (tp=2 on the CPU), ``--output-dir out``
    and ``extra``."""
    return train_parser().parse_args([*COMMON, "--output-dir", str(out), *extra])


def run_guarded(mesh, out, *extra: str, poison_at: int | None = None, printer=None) -> dict:
    """One train() call; what it returned or raised, the steps it trained, whether its lock
    is left, its checkpoint listing. ``poison_at``: NaN gradients of ``POISONED`` on rank 1
    at that step."""
    from neuron_tp.train.loop import train

    steps, hooks = [], []

    def on_step(run):
        steps.append(run.step)
        for h in hooks:
            h.remove()
        hooks.clear()
        if poison_at is not None and run.step == poison_at - 1 and mesh.rank == 1:
            p = run.model.get_parameter(POISONED)
            hooks.append(p.register_hook(lambda g: g * float("nan")))

    t0 = time.perf_counter()
    try:
        quiet = printer or (lambda *a, **k: None)
        s = train(guard_args(out, *extra), mesh, printer=quiet, on_step=on_step)
        res = {
            "raised": None,
            "ckpts": [os.path.basename(c) for c in s["checkpoints"]],
            "log": s["log"],
        }
    except Exception as e:  # noqa: BLE001 - recorded for the parent
        res = {"raised": type(e).__name__, "msg": str(e)}
    res.update(
        steps=steps,
        seconds=time.perf_counter() - t0,
        lock_left=os.path.exists(os.path.join(str(out), LOCK_NAME)),
    )
    ck = os.path.join(str(out), "checkpoints")
    res["listing"] = sorted(os.listdir(ck)) if os.path.isdir(ck) else None
    return res
