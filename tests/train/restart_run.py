"""Runs ``neuron-tp train`` (the real command) under torchrun and SIGKILLs this worker at a
chosen point of a chosen attempt, as a dying process or node would; used by test_restart.py.

    python restart_run.py RESULT_DIR -- <neuron-tp train options>

``NTP_TEST_KILLS``: comma-separated ``attempt:rank:where[:step]`` (attempt =
``TORCHELASTIC_RESTART_COUNT``, rank = global rank); ``where`` is

- ``startup``: at the start of the checkpoint restore (process group up, output dir claimed);
- ``step``: right after optimizer step ``step`` (the other ranks run on into the next step);
- ``save``: while checkpoint ``step`` is being written (this rank's first file written,
  the rest not: a partial temporary directory is left);
- ``eval``: at the start of this attempt's first evaluation;
- ``end``: after ``neuron-tp train`` returned (the job complete: its last checkpoint saved).

Each worker appends ``{"attempt", "rank", "event", "t"}`` lines to ``RESULT_DIR/events.jsonl``
(``start``, ``first-step`` with the step, ``kill``, ``exit``) so the test can tell what ran and
how long a restart took. Nothing of neuron_tp is replaced: the kills wrap the functions it
calls.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


def _plan() -> dict[str, int | None]:
    """{where: step} for this worker in this attempt."""
    out: dict[str, int | None] = {}
    for item in filter(None, os.environ.get("NTP_TEST_KILLS", "").split(",")):
        attempt, rank, where, *step = item.split(":")
        if int(attempt) == ATTEMPT and int(rank) == RANK:
            out[where] = int(step[0]) if step else None
    return out


PLAN = _plan()


def event(result_dir: str, name: str, **extra) -> None:
    line = {"attempt": ATTEMPT, "rank": RANK, "event": name, "t": time.time(), **extra}
    with open(os.path.join(result_dir, "events.jsonl"), "a") as fh:
        fh.write(json.dumps(line) + "\n")


def die(result_dir: str, where: str) -> None:
    event(result_dir, "kill", where=where)
    os.kill(os.getpid(), signal.SIGKILL)


def _install(result_dir: str) -> None:
    from neuron_tp.checkpoint import writer
    from neuron_tp.train import evaluate, loop

    if "startup" in PLAN:
        restore = loop.restore

        def restore_then_die(run, say):
            die(result_dir, "startup")
            return restore(run, say)

        loop.restore = restore_then_die
    if "save" in PLAN:
        write = writer.write_tensors

        def write_then_die(path, tensors, meta):
            write(path, tensors, meta)
            if meta.get("step") == PLAN["save"]:
                die(result_dir, "save")

        writer.write_tensors = write_then_die
    if "eval" in PLAN:
        run_eval = evaluate.Evaluator.evaluate

        def eval_then_die(self, *args, **kwargs):
            die(result_dir, "eval")
            return run_eval(self, *args, **kwargs)

        evaluate.Evaluator.evaluate = eval_then_die


self_step: dict[str, int] = {}


def on_step(result_dir: str, run) -> None:
    if not self_step:
        event(result_dir, "first-step", step=run.step)
    self_step["step"] = run.step
    if PLAN.get("step", -1) == run.step:
        die(result_dir, "step")


def main(argv: list[str]) -> int:
    from neuron_tp.cli.args import train_parser
    from neuron_tp.cli.launch import train_command

    result_dir, rest = argv[0], argv[2:]
    event(result_dir, "start")
    _install(result_dir)
    code = train_command(
        train_parser().parse_args(rest), on_step=functools.partial(on_step, result_dir)
    )
    if "end" in PLAN:
        die(result_dir, "end")
    event(result_dir, "exit", code=code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
