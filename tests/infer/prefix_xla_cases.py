"""Run on XLA CPU devices by tests/infer/test_prefix_cache.py (see tests/helpers/xla_dist.py):
the engine with a prefix cache over a shared-prefix
trace, graphs replayed and all captured at ``--warmup all``; every request equal to
transformers alone, no graph compiled or traced while serving.

- ``tp1``: one device, a pool large enough for the trace;
- ``tp2_int8``: tp=2 with int8 weights, a model with one kv head whose slot cache and pool are
  split by sequence (each rank its half of every block's positions), a pool smaller than the
  working set (evictions); the reference is transformers on the dequantized-int8 weights
  (tests/helpers/int8_reference.py);
- ``tp2_draft``: tp=2, speculative decoding with a twin of the model as its draft (the draft's
  KV in the pool too), both caches split by sequence (one kv head), greedy requests, the same
  small pool.
"""

from __future__ import annotations

import copy
import threading

import engine_cases as ec
import prefix_cases as pc
import torch_xla
import transformers  # noqa: F401  (imported before the device threads start)

import neuron_tp as ntp
from int8_reference import reference_model
from neuron_tp import hf
from neuron_tp.backend.graphs import graph_counters
from neuron_tp.job.presets import build_model
from neuron_tp.parallel.sharding import move_to
from slot_trace import kv1_llama
from xla_dist import serial

BARRIER = threading.Barrier(2)


def job(case: str) -> dict:
    dev = torch_xla.device()
    tp = 1 if case == "tp1" else 2
    mesh = ntp.init_mesh(tp=tp)
    rank = mesh.rank
    with serial():
        split = case != "tp1"
        full = (kv1_llama() if split else build_model("tiny-llama", ec.VOCAB, ec.SEED)).eval()
        ref = reference_model(full).eval() if case == "tp2_int8" else full
    model = hf.parallelize(copy.deepcopy(full), mesh).eval()  # collective: not under serial
    if case == "tp2_int8":
        from neuron_tp.layers.quantized import quantize_int8

        quantize_int8(model, mesh)
    blocks, group = (40, None) if tp == 1 else (6, mesh.group("world"))
    move_to(model, dev)
    draft = None
    if case == "tp2_draft":  # a twin of the model drafts (the same weights, its own caches)
        draft = move_to(hf.parallelize(copy.deepcopy(full), mesh).eval(), dev)
    eng = pc.engine(
        model,
        group,
        blocks=blocks,
        rank0=rank == 0,
        lease_steps=3,
        draft=draft,
        kv_split="sequence" if split else "heads",
    )
    eng.warmup(every_shape=True)
    traces = eng.gen.traces
    sync = BARRIER.wait if group is not None else (lambda: None)
    sync()
    compiles = graph_counters()["compiles"]
    if rank != 0:
        eng.follow()
        sync()
        return {"traces": [traces, eng.gen.traces]}
    items, out = pc.make_trace(13, 24), {}
    if draft is not None:  # greedy: plain decoding's tokens
        items = [dict(it, sampling=None) for it in items[:16]]

    def driver() -> None:
        try:
            out["results"] = ec.drive(eng, items)
        finally:
            eng.shutdown()

    thread = threading.Thread(target=driver)
    thread.start()
    eng.start(thread=False)  # the device work on this rank's own thread
    thread.join()
    sync()
    after = graph_counters()["compiles"]
    with serial():
        refs = [ec.reference(ref, it) for it in items]
    ec.check(out["results"], items, refs)
    return {
        "traces": [traces, eng.gen.traces],
        "compiles": [compiles, after],
        "stats": eng.prefix_stats()._asdict(),
        "speculation": vars(eng.speculation()) if draft is not None else None,
    }
