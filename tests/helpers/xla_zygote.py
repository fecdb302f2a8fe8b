"""The process that XLA test processes are forked from: started once per test session, it
imports torch, torch-xla, transformers' Llama and neuron_tp (~10 CPU-seconds, the bulk of a
fresh interpreter's start on a 2-core runner) WITHOUT starting the XLA runtime, then forks one
child per request. The child starts a new session (a timeout kills its whole tree), takes the
request's environment (device count, thread pool, XLA flags...: read by torch-xla when its
runtime starts, after the fork), working directory and ``sys.path``, and runs either an
``xla_dist`` launch (``xla_dist.run_job``) or a Python command line (:func:`python`, for
tests that trace or compile in a fresh process): what a new interpreter would do, minus the
imports. (A test about what gets imported needs a real interpreter: ``subprocess``.)

Protocol on the zygote's stdin/stdout, one JSON line each: ``{"ready"}`` once imported; then
per request (with an ``id``) ``{"pid", "id"}`` when forked and ``{"exit", "id"}`` (the child's
exit code) when it ended.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import queue
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from neuron_tp.backend.xla import cpu_devices_env

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DIST_VARS = (  # a torchrun parent's variables: never passed on to a test process
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)
_ENV_AT_IMPORT = {k: v for k, v in os.environ.items() if k not in DIST_VARS}

PRELOAD = [
    "torch",
    "torch_xla",
    "torch_xla.runtime",
    "torch_xla.distributed.xla_multiprocessing",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "neuron_tp",
]


class Zygote:
    """The parent's handle on a zygote process (started with ``env``)."""

    def __init__(self, env: dict[str, str]):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        self.ready, self.count = False, 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))
        self.lines.put({"dead": "the zygote process ended (its stderr is the test's)"})

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _next(self, want: str, rid: int | None, timeout: float) -> dict:
        """The zygote's next line with key ``want`` (for request ``rid``); lines of earlier,
        abandoned requests are skipped. Raises queue.Empty after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if "dead" in line:
                self.lines.put(line)
                return line
            if want in line and line.get("id") == rid:
                return line

    def launch(self, req: dict, timeout: float) -> str:
        """Fork a child for ``req``; wait for it; return ``"exit code N"`` or a timeout
        message (after killing the child's session)."""
        if not self.ready:  # its imports, once (slow on a loaded machine)
            ready = self._next("ready", None, 900)
            if "dead" in ready:
                return ready["dead"]
            self.ready = True
        self.count += 1
        rid = self.count
        self.proc.stdin.write(json.dumps({**req, "id": rid}) + "\n")
        self.proc.stdin.flush()
        first = self._next("pid", rid, 120)
        if "dead" in first:
            return first["dead"]
        pid = first["pid"]
        try:
            done = self._next("exit", rid, timeout)
            return done.get("dead") or f"exit code {done['exit']}"
        except queue.Empty:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            return f"timeout after {timeout:.0f}s (a hang?)"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # leftovers of the tree, if any


_zygotes: list[Zygote] = []  # the session's one zygote, once started


def session() -> Zygote:
    """The session's zygote (started on first use, restarted if it died), with the
    environment of the session's start (not of the test that happens to ask first)."""
    if not _zygotes or not _zygotes[0].alive():
        env = {**_ENV_AT_IMPORT, **cpu_devices_env(1, _ENV_AT_IMPORT), "OMP_NUM_THREADS": "1"}
        env["ZYGOTE_PATHS"] = os.pathsep.join([REPO, HERE])
        env["PYTHONPATH"] = os.pathsep.join([REPO, HERE, env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        _zygotes[:] = [Zygote(env)]
    return _zygotes[0]


def python(
    args: list[str],
    env: dict | None = None,
    timeout: float = 300,
    cwd: str | None = None,
    input: str | None = None,  # noqa: A002 - subprocess.run's name
) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`` for
    ``-c CODE ...``, ``-m MODULE ...`` or ``SCRIPT ...``, forked from the zygote (``input``:
    the child's stdin, else empty). On a timeout the return code is -9 and stderr ends with
    the reason."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if k not in DIST_VARS}
    with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
        out, err = os.path.join(tmp, "out"), os.path.join(tmp, "err")
        req = {"argv": list(args), "env": env, "cwd": cwd or os.getcwd(), "out": out, "err": err}
        if input is not None:
            req["in"] = os.path.join(tmp, "in")
            with open(req["in"], "w") as f:
                f.write(input)
        status = session().launch(req, timeout)
        texts = []
        for path in (out, err):
            with open(path, errors="replace") if os.path.exists(path) else open(os.devnull) as f:
                texts.append(f.read())
    if status.startswith("exit code"):
        code = int(status.split()[-1])
    else:
        code, texts[1] = -9, f"{texts[1]}\n[zygote] {status}"
    return subprocess.CompletedProcess([sys.executable, *args], code, texts[0], texts[1])


def _redirect(fd: int, path: str) -> None:
    new = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(new, fd)
    os.close(new)


def _run_python(req: dict) -> None:
    """A Python command line in this (forked) process: ``sys.argv``, ``sys.path`` and
    ``__main__`` as a new interpreter would set them."""
    argv, env = req["argv"], req["env"]
    own = set(os.environ.get("ZYGOTE_PATHS", "").split(os.pathsep))
    base = [p for p in sys.path[1:] if p not in own]  # the interpreter's own entries
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(req["cwd"])
    if argv[0] == "-c":
        sys.argv, sys.path[:] = ["-c", *argv[2:]], ["", *extra, *base]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    elif argv[0] == "-m":
        sys.argv, sys.path[:] = [argv[1], *argv[2:]], [req["cwd"], *extra, *base]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = os.path.abspath(argv[0])
        sys.argv, sys.path[:] = [argv[0], *argv[1:]], [os.path.dirname(script), *extra, *base]
        runpy.run_path(script, run_name="__main__")


def _child(req: dict) -> None:
    """In the forked child: become the request's own process, run it, never return."""
    code = 1
    try:
        os.setsid()
        _redirect(1, req.get("out") or req["log"])
        _redirect(2, req.get("err") or req["log"])
        stdin = os.open(req.get("in") or os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - not the zygote's buffered requests
        if "argv" in req:
            _run_python(req)
        else:
            os.environ.clear()
            os.environ.update(req["env"])
            sys.path[:0] = req["paths"]
            import xla_dist

            xla_dist.run_job(req["job"])
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - into the request's stderr, read by the parent
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve() -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _child(req)
        print(json.dumps({"pid": pid, "id": req["id"]}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status), "id": req["id"]}), flush=True)


if __name__ == "__main__":
    _serve()
