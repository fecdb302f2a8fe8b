"""Executed-XLA side of test_plan_comm.py: the real ``neuron-tp train`` entry point runs one
step on N XLA CPU devices (tests/helpers/xla_dist.py) while the HLO of that step is recorded at two
points of :func:`neuron_tp.train.loop.train_step`:

* ``micro``: the pending graph of the micro-batch loss (taken by a forward hook on the model)
  and the gradients when ``reduce_gradients`` is entered (forward + backward, exactly what the
  planner calls the micro part);
* ``total``: the tensors the step hands to the graph guard just before its step boundary
  (parameters, optimizer state, dp-mean loss, grad norm): the whole step graph.

Both hooks wrap the real functions and call them unchanged; the step then executes (mark_step)
on every device and its loss is read by the log. Returned per rank: the collectives of both
HLO texts (kind, dtype, buffer bytes, group size) and the logged loss / grad norm."""

from __future__ import annotations

import threading

import neuron_tp as ntp
import neuron_tp.train.loop as loop
from neuron_tp.backend.hlo import parse_collectives, trace_hlo
from neuron_tp.cli.args import train_parser

COMMON = ["--device", "xla", "--seq-len", "32", "--log-every", "1", "--steps", "2"]
COMMON += ["--warmup-steps", "1", "--lr", "1e-3", "--max-grad-norm", "1.0"]

_patch_lock = threading.Lock()
_tls = threading.local()  # one rank = one thread: each records its own HLO


def _install_hooks() -> None:
    """Wrap loop.reduce_gradients, loop.check_same_graph and loop.apply_activation_checkpointing
    (to hook the model's forward for its loss), once per process (the ranks' threads share it)."""
    with _patch_lock:
        if getattr(loop, "_plan_test_hooks", False):
            return
        reduce_gradients, check_same_graph = loop.reduce_gradients, loop.check_same_graph
        apply_recompute = loop.apply_activation_checkpointing

        def setup_hook(model, *args, **kwargs):  # called once by setup on the sharded model
            model.register_forward_hook(lambda _m, _a, out: setattr(_tls, "loss", out.loss))
            return apply_recompute(model, *args, **kwargs)

        def reduce_hook(model, optimizer, mesh, *args, **kwargs):
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            _tls.micro = trace_hlo([_tls.loss, *grads])
            return reduce_gradients(model, optimizer, mesh, *args, **kwargs)

        def guard_hook(tensors, group, *args, **kwargs):
            _tls.total = trace_hlo(list(tensors))
            return check_same_graph(tensors, group, *args, **kwargs)

        loop.reduce_gradients, loop.check_same_graph = reduce_hook, guard_hook
        loop.apply_activation_checkpointing = setup_hook
        loop._plan_test_hooks = True


def _collectives(hlo: str, world: int) -> list[tuple[str, str, int, int]]:
    """(kind, dtype, buffer bytes, group size) of every collective (empty groups = world)."""
    return [
        (c.kind, c.dtype, c.buffer_bytes, c.group_size if c.replica_groups else world)
        for c in parse_collectives(hlo)
    ]


def run_layouts(out: str, layouts: list[tuple[str, int, str, list[str]]]) -> list[dict]:
    """One rank: for each (name, tp, tp_mode, extra options), one real training step of
    tiny-llama through ``neuron_tp.train.loop.train`` (stopped after step 1, no checkpoint)."""
    import torch_xla.runtime as xr

    _install_hooks()
    world = xr.world_size()
    results = []
    for name, tp, mode, extra in layouts:
        _tls.micro = _tls.total = _tls.loss = None
        mesh = ntp.init_mesh(tp=tp, tp_mode=mode)
        args = train_parser().parse_args(
            [*COMMON, "--output-dir", f"{out}/{name}", "--tp", str(tp), "--tp-mode", mode, *extra]
        )
        s = loop.train(args, mesh, stop_at=1, printer=lambda *a, **k: None)
        assert _tls.micro is not None and _tls.total is not None, "hooks not reached"
        results.append(
            {
                "name": name,
                "rank": mesh.rank,
                "world": world,
                "micro": _collectives(_tls.micro, world),
                "total": _collectives(_tls.total, world),
                "total_hlo_has_channel_ids": "channel_id=" in _tls.total,
                "log": s["log"],
            }
        )
        ntp.set_default_mesh(None)
    return results
