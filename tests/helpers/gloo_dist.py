"""Run a test body on several CPU processes joined by gloo (the multi-rank test harness):
``gloo_dist.run(fn, *args, world_size=4)``.

Starting the ranks costs seconds, so a test module that checks many cases at one world size
runs them all in one launch and reports each under its own test ID with
``gloo_dist.run_case(check, case, *args, cases=ALL, world_size=4)``: a failing case does not
hide the others.

Ranks are forked from a ``forkserver`` that has imported torch, transformers' model code (which
pulls in accelerate and torch_xla: ~5 CPU-seconds per rank, the bulk of a launch on a 2-core
runner) and neuron_tp, and nothing else: each rank is still a new process with pristine module
state, exactly as a spawned one, minus the imports. Each rank takes the parent's environment,
working directory and ``sys.path`` at launch time (as ``spawn`` would), and its stdout/stderr
are copied into the calling test's output after the launch.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server (a clean interpreter: pytest's state never reaches a rank).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "neuron_tp",
]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(_PRELOAD)
    return _ctx


def _worker(
    rank: int, world: int, port: int, fn, args, errors, exit_barrier, parent: tuple
) -> None:
    environ, cwd, log = parent  # what a spawned child would inherit from the parent now
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        fn(*args)
        dist.barrier()  # every rank is done with every collective before any group goes away
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        errors.put((rank, traceback.format_exc()))
        _exit(1)  # the parent stops the other ranks (they may wait in a collective)
    import neuron_tp

    # Drop every mesh (and its process groups) before the default group is destroyed.
    shared_mesh.cache_clear()
    neuron_tp.set_default_mesh(None)
    gc.collect()
    dist.destroy_process_group()
    # Rank 0 hosts the c10d store: nobody leaves before every rank has finished destroying.
    try:
        exit_barrier.wait(timeout=60)
    except threading.BrokenBarrierError:
        pass
    _exit(0)


def _exit(code: int) -> None:
    """End a rank process without the interpreter's teardown: a gloo thread of a destroyed
    subgroup can abort it ("terminate called without an active exception", exit -6)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(fn: Callable[..., object], *args: object, world_size: int, timeout: float = 300) -> None:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks (one process each); re-raise the first
    rank's failure.

    ``fn`` must be a module-level function (it is pickled into spawned processes); inside it
    ``neuron_tp.init_mesh`` finds the process group already initialised. When a rank fails the
    others get a few seconds to report too, then are stopped (they may wait in a collective).
    """
    ctx = _context()
    errors = ctx.SimpleQueue()
    exit_barrier = ctx.Barrier(world_size)
    port = _free_port()
    log_fd, log = tempfile.mkstemp(prefix="gloo_dist-", suffix=".log")
    os.close(log_fd)
    parent = (dict(os.environ), os.getcwd(), log)
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, errors, exit_barrier, parent),
            daemon=True,
        )
        for r in range(world_size)
    ]
    try:
        for p in procs:
            p.start()
        _wait(procs, timeout)
    finally:
        with open(log, errors="replace") as f:
            sys.stdout.write(f.read())  # the ranks' output, captured with the calling test's
        os.unlink(log)
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    bad = [p.exitcode for p in procs if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with codes {bad} (timeout {timeout}s?)")


def _wait(procs: list, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    stop_at = deadline
    while (alive := [p for p in procs if p.is_alive()]) and time.monotonic() < stop_at:
        if any(p.exitcode not in (None, 0) for p in procs):
            stop_at = min(stop_at, time.monotonic() + 5)  # a rank failed: grace for the others
        wait([p.sentinel for p in alive], timeout=0.5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _run_cases(check: Callable[..., None], cases: Sequence[str], args: tuple, out_dir: str) -> None:
    """Rank body of :func:`run_case`: every case in turn, each failure recorded, none fatal."""
    failures = {}
    for case in cases:
        try:
            check(case, *args)
        except Exception:  # noqa: BLE001 - reported under the case's own test ID
            failures[case] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank-{dist.get_rank()}.json"), "w") as f:
        json.dump(failures, f)


@functools.cache
def shared_mesh(tp: int, cp: int = 1, pp: int = 1, *, tp_mode: str = "1d", ep: int = 1):
    """This rank's ``neuron_tp.init_mesh(tp=tp, cp=cp, pp=pp, tp_mode=tp_mode, ep=ep)``, made
    on first use: the cases of one :func:`run_case` launch share it (each new mesh would
    create new process groups)."""
    import neuron_tp

    return neuron_tp.init_mesh(tp=tp, cp=cp, pp=pp, tp_mode=tp_mode, ep=ep)


_launches: dict[tuple, dict[str, str] | str] = {}  # one launch per (check, cases, args, world)


def run_case(
    check: Callable[..., None],
    case: str,
    *args: object,
    cases: Sequence[str],
    world_size: int,
    timeout: float = 300,
) -> None:
    """Fail (AssertionError with every failing rank's traceback) unless ``check(case, *args)``
    passed on all ``world_size`` gloo ranks.

    The first call for a given ``check``, ``cases``, ``args`` and ``world_size`` runs
    ``check(c, *args)`` for every ``c`` in ``cases`` in ONE launch (in order, a failing case
    does not stop the next) and keeps the outcome for the later calls; a launch that fails as
    a whole (a crash, a hang) fails every one of its cases with the same error.
    ``check`` must be a module-level function; it may cache per-process setup (a mesh).
    """
    assert case in cases, f"{case!r} is not one of the cases {list(cases)}"
    key = (check.__module__, check.__qualname__, tuple(cases), repr(args), world_size)
    if key not in _launches:
        with tempfile.TemporaryDirectory(prefix="gloo_dist-") as out:
            try:
                run(
                    _run_cases,
                    check,
                    tuple(cases),
                    args,
                    out,
                    world_size=world_size,
                    timeout=timeout,
                )
                outcome: dict[str, str] | str = {}
                for rank in range(world_size):
                    with open(os.path.join(out, f"rank-{rank}.json")) as f:
                        for name, tb in json.load(f).items():
                            outcome[name] = outcome.get(name, "") + f"rank {rank}:\n{tb}"
            except AssertionError as e:
                outcome = f"the launch of all {len(cases)} cases failed: {e}"
        _launches[key] = outcome
    outcome = _launches[key]
    if isinstance(outcome, str):
        raise AssertionError(outcome)
    if case in outcome:
        raise AssertionError(f"case {case!r} failed on {world_size} ranks:\n{outcome[case]}")
