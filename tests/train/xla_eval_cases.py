"""The eval runs of test_evaluate.py on N XLA CPU devices (tests/helpers/xla_dist.py): three
tp=2 training runs in one process, so the compile counter shows which graphs each adds:
neuron_parallel_compile's trial run (NEURON_EXTRACT_GRAPHS_ONLY) without, then with eval, then
the real run with eval (which must compile nothing the trial run did not)."""

from __future__ import annotations

import os

from xla_multi_train_cases import _barrier, run_train

from neuron_tp.backend.graphs import graph_counters

BASE = ["--model", "tiny-llama", "--micro-batch", "2", "--steps", "4", "--log-every", "4"]


def eval_options(eval_file: str) -> list[str]:
    return ["--eval-data", eval_file, "--eval-every", "2", "--eval-batches", "2"]


def run_all(out: str, eval_file: str) -> dict:
    """Each run's result (:func:`run_train`) and the process-wide compile count after it."""
    import torch_xla.runtime as xr

    barrier = _barrier(xr.world_size())
    results, compiles = {}, [graph_counters()["compiles"]]
    for name, extra, extract in (
        ("trial", BASE, True),
        ("trial_eval", BASE + eval_options(eval_file), True),
        ("train_eval", BASE + eval_options(eval_file), False),
    ):
        barrier.wait()
        if extract:
            os.environ["NEURON_EXTRACT_GRAPHS_ONLY"] = "1"
        barrier.wait()
        results[name] = run_train(2, os.path.join(out, name), extra)
        barrier.wait()
        os.environ.pop("NEURON_EXTRACT_GRAPHS_ONLY", None)
        compiles.append(graph_counters()["compiles"])
    return {"results": results, "compiles": compiles}
