"""Run a test body on N XLA CPU devices of one process: the executed XLA multi-rank harness.

``run(fn, *args, devices=n)`` starts ONE new process (forked from a zygote that has imported
torch-xla without starting its runtime: tests/helpers/xla_zygote.py) with the environment of
``neuron_tp.backend.xla.cpu_devices_env(n)`` (n CPU devices, a thread pool >= n, no buffer donation,
LLVM -O0 compiles); it calls ``xmp.spawn``, whose child runs ``fn(*args)`` once per device,
each in its own thread (the "ranks"), with channel-id collectives between them (see
``../shared/PLATFORM.md``, "torch-xla on the CPU"). Inside ``fn``, ``neuron_tp.init_mesh(tp=...)``
creates the ``xla`` process group (first thread) and takes world size and rank from the XLA
runtime. Threads share the process: build reference modules and draw from the global RNG inside
``with serial():`` (or use explicit generators), and import what ``fn`` needs at module level
(the module is imported once, before the threads start). Call ``torch_xla.sync()`` once per
step. A failure on any rank fails ``run`` with that rank's traceback; a hang fails after
``timeout`` seconds.

Each launch still costs seconds (runtime start, the job module's imports, compiles): a test
module with several cases at one device count runs them all in one launch with
``run_cases(job, names, *args, devices=n)`` and reads each case's per-rank results, or its own
failure, with ``Cases.get(name)``.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence

import xla_zygote
from neuron_tp.backend.xla import cpu_devices_env

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
_serial = threading.Lock()
_failed = threading.Event()


@contextlib.contextmanager
def serial():
    """One rank at a time (the global RNG, module construction, lazy imports are shared)."""
    with _serial:
        yield


def _write(path: str, obj) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(obj, f)
    os.replace(path + ".tmp", path)


def _exit_soon(grace: float) -> None:
    """After a rank failed: give the other ranks ``grace`` seconds to report their own
    failure, then end the process (ranks waiting in a collective would wait forever)."""
    time.sleep(grace)
    os._exit(3)


def _thread_main(index: int, fn, args: tuple, out_dir: str) -> None:
    """Body of each device thread (called by xmp.spawn with the device index)."""
    import torch_xla.runtime as xr

    import neuron_tp

    rank = xr.global_ordinal()
    try:
        result = fn(*args)
        _write(os.path.join(out_dir, f"result-{rank}.pkl"), result)
    except BaseException:  # noqa: BLE001 - every failure goes back to pytest, with its rank
        _write(os.path.join(out_dir, f"error-{rank}.pkl"), traceback.format_exc())
        if not _failed.is_set():
            _failed.set()
            threading.Thread(target=_exit_soon, args=(3.0,), daemon=True).start()
        raise
    finally:
        neuron_tp.set_default_mesh(None)


def run_job(job_path: str) -> None:
    """The body of a launch's process (forked by the zygote): ``xmp.spawn`` of the job's
    function on every device."""
    with open(job_path, "rb") as f:
        module, qualname, args, out_dir = pickle.load(f)
    import importlib

    import torch_xla.distributed.xla_multiprocessing as xmp

    from xla_dist import _thread_main  # by module name, not __main__: one copy in the child

    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    # fork: the device process starts with this one's imports (spawn would import them again)
    xmp.spawn(_thread_main, args=(fn, args, out_dir), start_method="fork")


def run(fn: Callable[..., object], *args: object, devices: int, timeout: float = 600) -> list:
    """Call ``fn(*args)`` on ``devices`` XLA CPU devices (one thread each, one process);
    return the per-rank results in rank order. Raises AssertionError naming every failed rank.

    ``fn`` must be a module-level function of an importable module (it is pickled by name);
    ``args`` and its return value must be picklable (return CPU values, not XLA tensors).
    Module-level functions among ``args`` are importable in the child too.
    """
    dirs = [
        os.path.dirname(os.path.abspath(sys.modules[f.__module__].__file__))
        for f in (fn, *args)
        if callable(f) and getattr(f, "__module__", None) in sys.modules
    ]
    paths = [REPO, HERE, *dict.fromkeys(dirs)]
    env = {k: v for k, v in os.environ.items() if k not in xla_zygote.DIST_VARS}
    env.update(
        cpu_devices_env(devices, env),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    with tempfile.TemporaryDirectory(prefix="xla_dist-") as tmp:
        job, log = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "log.txt")
        _write(job, (fn.__module__, fn.__qualname__, args, tmp))
        req = {"job": job, "env": env, "paths": paths, "log": log}
        status = xla_zygote.session().launch(req, timeout)
        with open(log, errors="replace") if os.path.exists(log) else io.StringIO() as f:
            log = f.read()
        errors, results = {}, {}
        for name in sorted(os.listdir(tmp)):
            kind, _, rest = name.partition("-")
            if name.endswith(".pkl") and kind in ("error", "result"):
                with open(os.path.join(tmp, name), "rb") as f:
                    (errors if kind == "error" else results)[int(rest[:-4])] = pickle.load(f)
    if errors:
        raise AssertionError(
            "\n".join(
                f"rank {r} of {devices} XLA devices failed:\n{tb}"
                for r, tb in sorted(errors.items())
            )
        )
    if len(results) != devices or status != "exit code 0":
        raise AssertionError(
            f"{status}; ranks that finished: {sorted(results)} of {devices}\n{log[-4000:]}"
        )
    return [results[r] for r in range(devices)]


_case_state: dict[str, object] = {}  # in the device process: the barrier, failed cases


def _case_barrier(devices: int) -> threading.Barrier:
    with _serial:
        return _case_state.setdefault("barrier", threading.Barrier(devices))


def _run_cases(job: Callable[..., object], names: tuple, args: tuple, out_dir: str) -> None:
    """Rank body of :func:`run_cases`: the cases in order; each outcome is written as soon as
    it is known (a later crash keeps it). After each case the ranks meet; once a case failed
    on any rank the next ones do not run (its collectives may have left the ranks out of step)."""
    import torch_xla.runtime as xr

    rank, world = xr.global_ordinal(), xr.world_size()
    barrier, done = _case_barrier(world), {}
    for name in names:
        try:
            done[name] = ("ok", job(name, *args))
        except Exception:  # noqa: BLE001 - reported under the case's own test
            done[name] = ("error", traceback.format_exc())
            _case_state[name] = rank
        _write(os.path.join(out_dir, f"cases-{rank}.pkl"), done)
        barrier.wait(timeout=300)
        if name in _case_state:
            return


class Cases:
    """The outcome of one :func:`run_cases` launch, per case."""

    def __init__(self, devices: int, names: Sequence[str], per_rank: dict, status: str):
        self.devices, self.names, self.per_rank, self.status = devices, names, per_rank, status

    def get(self, name: str) -> list:
        """The per-rank results (rank order) of case ``name``; AssertionError with its
        tracebacks if it failed on any rank, or with the launch's fate if it did not finish."""
        assert name in self.names, f"{name!r} is not one of the cases {list(self.names)}"
        got = {r: d[name] for r, d in self.per_rank.items() if name in d}
        errors = {r: v for r, (kind, v) in got.items() if kind == "error"}
        if errors:
            raise AssertionError(
                "\n".join(
                    f"case {name!r}, rank {r} of {self.devices} XLA devices failed:\n{tb}"
                    for r, tb in sorted(errors.items())
                )
            )
        if len(got) != self.devices:
            failed = [
                n
                for n in self.names[: self.names.index(name)]
                if any(d.get(n, ("ok",))[0] == "error" for d in self.per_rank.values())
            ]
            why = f"not run: case {failed[0]!r} failed before it" if failed else self.status
            missing = sorted(set(range(self.devices)) - set(got))
            raise AssertionError(f"case {name!r} did not finish on ranks {missing}: {why}")
        return [got[r][1] for r in range(self.devices)]


def run_cases(
    job: Callable[..., object],
    names: Sequence[str],
    *args: object,
    devices: int,
    timeout: float = 900,
) -> Cases:
    """Run ``job(name, *args)`` for every ``name`` in ``names``, in order, in ONE launch on
    ``devices`` XLA CPU devices; return the outcome of each (see :meth:`Cases.get`). A case
    failing on any rank stops the later ones (reported as not finished, with the reason).
    ``job`` must be a module-level function; its results must be picklable."""
    with tempfile.TemporaryDirectory(prefix="xla_cases-") as out:
        try:
            run(_run_cases, job, tuple(names), args, out, devices=devices, timeout=timeout)
            status = "launch finished"
        except AssertionError as e:
            status = f"the launch failed:\n{e}"
        per_rank = {}
        for r in range(devices):
            path = os.path.join(out, f"cases-{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    per_rank[r] = pickle.load(f)
    return Cases(devices, tuple(names), per_rank, status)


if __name__ == "__main__":
    run_job(sys.argv[1])
