"""Run the selftest on this rank: the checks in order, each under the watchdog; after each, the
ranks exchange their results on the host and rank 0 prints the merged line."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

import torch

from ..backend import xla as _xla
from ..parallel import host
from ..parallel.mesh import init_mesh, set_default_mesh
from ..plan.hardware import Instance, get_instance
from .context import Context, Options, default_tp, ranks_per_node
from .report import FAIL, Check, check_lines, report_json, verdict
from .watchdog import Watchdog

CHECK_NAMES = ("environment", "collectives", "bandwidth", "layers", "model", "compile", "compute")


class SelftestFailed(Exception):
    """Raised by every rank of an ``--xla-cpu-devices`` run whose selftest failed (the
    launching process turns it into exit status 1)."""


class Shared:
    """What the ranks of one process share: the options and one watchdog (created lazily in
    the process that runs the ranks; pickled without it)."""

    def __init__(self, options: Options):
        self.options = options
        self._lock = threading.Lock()
        self._watchdog: Watchdog | None = None
        self.ranks_lock = threading.Lock()  # for Context.lock

    def watchdog(self) -> Watchdog:
        with self._lock:
            if self._watchdog is None:
                self._watchdog = Watchdog(self.options.timeout)
            return self._watchdog

    def __getstate__(self) -> dict:
        return {"options": self.options}

    def __setstate__(self, state: dict) -> None:
        Shared.__init__(self, state["options"])


def _checks(instance: Instance | None) -> dict[str, Callable[[Context], Check]]:
    from .bandwidth import check_bandwidth
    from .collectives import check_collectives
    from .compile import check_compile
    from .compute import check_compute
    from .env import check_env
    from .layers import check_layers
    from .model import check_model

    return {
        "environment": check_env,
        "collectives": check_collectives,
        "bandwidth": lambda ctx: check_bandwidth(ctx, instance),
        "layers": check_layers,
        "model": check_model,
        "compile": check_compile,
        "compute": lambda ctx: check_compute(ctx, instance),
    }


def _world(options: Options) -> int:
    if options.device == "xla":
        _xla.device()  # the runtime (torchrun on Neuron: one core per process)
        rw = _xla.runtime_world()
        if rw is not None:
            return rw[0]
    return int(os.environ.get("WORLD_SIZE", "1"))


def make_context(shared: Shared) -> Context:
    """This rank's mesh and device."""
    options = shared.options
    world = _world(options)
    per_node = ranks_per_node(world, options.xla_cpu_devices)
    tp = options.tp or default_tp(world, per_node)
    mesh = init_mesh(tp=tp, backend="gloo" if options.device == "cpu" else None)
    device = _xla.device() if options.device == "xla" else torch.device("cpu")
    return Context(options, mesh, device, shared.watchdog(), per_node, shared.ranks_lock)


def run_one(ctx: Context, name: str, fn: Callable[[Context], Check]) -> Check:
    """One check on this rank, under the watchdog; an exception is a FAIL line."""
    start = time.monotonic()
    with ctx.watchdog.check(name, ctx.rank):
        try:
            c = fn(ctx)
        except Exception as e:  # noqa: BLE001 - every failure becomes a line of the report
            if os.environ.get("NEURON_TP_DEBUG", "") not in ("", "0"):
                traceback.print_exc()
            c = Check(name, FAIL, summary="raised an error")
            c.failures.append(f"rank {ctx.rank}: {type(e).__name__}: {str(e)[:400]}")
            c.hint = "rerun with NEURON_TP_DEBUG=1 for the traceback, and report it with --json"
    c.seconds = time.monotonic() - start
    return c


def merge(rows: list[Check]) -> Check:
    """One check from every rank's: rank 0's numbers, every rank's failures."""
    out = rows[0]
    for other in rows[1:]:
        for f in other.failures:
            if f not in out.failures:
                out.fail(f)
        if not other.ok and out.hint == "":
            out.hint = other.hint
        out.seconds = max(out.seconds, other.seconds)
    if not out.ok and not out.hint:
        out.hint = next((r.hint for r in rows if r.hint), "")
    return out


def exchange(ctx: Context, c: Check) -> Check:
    """Every rank's result of one check (through the host store), merged."""
    payload = json.dumps(c.to_dict(), default=str).encode()
    rows = host.all_gather("selftest", payload, ctx.mesh.group("world"))
    return merge([Check.from_dict(json.loads(p)) for p in rows])


def run_selftest(shared: Shared) -> int:
    """This rank's selftest; returns the exit status (0: every check passed)."""
    options = shared.options
    instance = get_instance(options.instance) if options.instance else None
    start = time.monotonic()
    ctx = make_context(shared)
    talk = ctx.rank == 0
    results = []
    try:
        for name, fn in _checks(instance).items():
            if options.checks and name not in options.checks and name != "environment":
                continue
            c = exchange(ctx, run_one(ctx, name, fn))
            results.append(c)
            if talk and not options.json:
                print("\n".join(check_lines(c)), flush=True)
            if name == "environment" and not c.ok:
                break  # ranks that differ cannot be compared further
    finally:
        set_default_mesh(None)
    seconds = time.monotonic() - start
    ok = all(c.ok for c in results)
    if talk:
        if options.json:
            print(report_json(results, ctx.facts, seconds), flush=True)
        else:
            print(verdict(results, seconds), flush=True)
        if options.calibrate:
            from .calibrate import write_calibration

            path = write_calibration(options.calibrate, results, ctx)
            print(f"calibration written to {path}", file=sys.stderr if options.json else sys.stdout)
    return 0 if ok else 1


def run_rank(shared: Shared) -> None:
    """The body of one ``--xla-cpu-devices`` rank: raises :class:`SelftestFailed` on failure."""
    if run_selftest(shared):
        raise SelftestFailed("selftest failed")
