"""Runs ``neuron-tp train`` (the real command: handlers, agreement, exit status) with an
``on_step`` hook that parks chosen ranks after a chosen step until their process has received
SIGTERM / SIGINT, so a signal sent by the test lands mid-run deterministically; used by
test_preempt.py, under torchrun (gloo ranks) or with ``--xla-cpu-devices`` (rank threads).

    python preempt_run.py RESULT_DIR PARK_STEP -- <neuron-tp train options>

Each rank writes ``RESULT_DIR/parked-<rank>`` when parked; the process writes
``RESULT_DIR/exit-<pid>.json`` (the exit status ``train_command`` returned)."""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time


def park(result_dir: str, park_step: int, run) -> None:
    """``on_step``: after ``park_step``, wait (up to 120 s) for this process's stop request."""
    rank = run.mesh.rank
    if run.step != park_step:
        return
    with open(os.path.join(result_dir, f"parked-{rank}"), "w") as fh:
        fh.write(str(os.getpid()))
    stop = getattr(signal.getsignal(signal.SIGTERM), "__self__", None)
    deadline = time.monotonic() + 120
    while not (stop is not None and stop.requested) and time.monotonic() < deadline:
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    from neuron_tp.cli.args import train_parser
    from neuron_tp.cli.launch import train_command

    result_dir, park_step, rest = argv[0], int(argv[1]), argv[3:]
    code = train_command(
        train_parser().parse_args(rest), on_step=functools.partial(park, result_dir, park_step)
    )
    _write(result_dir, f"exit-{os.getpid()}.json", code)
    return code


def _write(result_dir: str, name: str, obj) -> None:
    with open(os.path.join(result_dir, name), "w") as fh:
        json.dump(obj, fh)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
