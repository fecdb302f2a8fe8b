"""``neuron-tp train|generate|serve|consolidate|plan|selftest``: the command-line entry point."""

from __future__ import annotations

import difflib
import os
import sys
import time
from dataclasses import dataclass

from ..errors import UserError, reporter
from ..job.options import build_parser, opt

COMMANDS = ("train", "generate", "serve", "consolidate", "plan", "selftest")


@dataclass(frozen=True)
class ConsolidateArgs:
    """``neuron-tp consolidate`` options."""

    checkpoint: str = opt(
        "checkpoint", None, "a checkpoint directory (or an output dir: the newest)"
    )
    out_dir: str = opt(
        "out_dir", None, "new (or empty) directory for config.json + model.safetensors"
    )
    adapter_only: bool = opt(
        "--adapter-only",
        False,
        "a LoRA run (--lora-r): write its PEFT adapter directory instead of the merged model",
        action="store_true",
    )
    quantize: str = opt(
        "--quantize",
        "none",
        "int8: write neuron_tp's int8 directory (int8 linears + float32 per-channel scales, "
        "as --quantize int8 computes them on load; the checkpoint may also be a float HF "
        "directory)",
        choices=("none", "int8"),
    )


def consolidate_parser():
    return build_parser(
        ConsolidateArgs,
        "neuron-tp consolidate",
        "Merge a sharded checkpoint into one HF directory (a LoRA run: the base "
        "with its adapters merged in; --quantize int8: neuron_tp's int8 directory).",
    )


def _consolidate(argv: list[str]) -> int:
    p = consolidate_parser()
    args = p.parse_args(argv)
    from ..checkpoint import consolidate, consolidate_int8

    if args.quantize == "int8":
        if args.adapter_only:
            raise UserError(
                "--adapter-only writes a LoRA adapter (float); --quantize int8 writes the "
                "whole merged model as int8: give one of them"
            )
        out = consolidate_int8(args.checkpoint, args.out_dir)
    else:
        out = consolidate(args.checkpoint, args.out_dir, adapter_only=args.adapter_only)
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the sub-command; returns the exit status. A :class:`UserError` becomes one
    line ``neuron-tp CMD: error: ...`` from one rank and status 2 (``NEURON_TP_DEBUG=1``:
    the traceback instead)."""
    argv = sys.argv[1:] if argv is None else argv
    usage = (
        f"usage: neuron-tp {{{','.join(COMMANDS)}}} [options]  (-h after a command for its options)"
    )
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-h", "--help"):
            print(usage)
            return 0
        if argv:
            near = difflib.get_close_matches(argv[0], COMMANDS, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            print(
                f"neuron-tp: error: unknown command {argv[0]!r}{hint} "
                f"(commands: {', '.join(COMMANDS)})",
                file=sys.stderr,
            )
        print(usage, file=sys.stderr)
        return 2
    try:
        return _dispatch(argv[0], argv[1:])
    except UserError as e:
        if os.environ.get("NEURON_TP_DEBUG", "") not in ("", "0"):
            raise
        return user_error_exit(argv[0], e)


def user_error_exit(cmd: str, error: UserError) -> int:
    """Print ``error`` as one line on the rank that reports it (see
    :func:`neuron_tp.errors.reporter`; rank 0 when none is recorded); return the status 2.

    Under torchrun the other ranks wait a moment before they exit, so that the launcher sees
    the reporting rank fail first, stops them and lists one failure instead of one per rank.
    A rank whose error no agreement attributed (it may be the only rank that failed) prints it
    after that wait, naming itself, if the launcher has not stopped it by then: an error is
    never lost."""
    rank = int(os.environ.get("RANK", "0"))
    if "neuron_tp.parallel.store" in sys.modules:
        from ..parallel.store import stop_heartbeat

        stop_heartbeat()
    who = reporter(error)
    if rank == (0 if who is None else who):
        print(f"neuron-tp {cmd}: error: {error}", file=sys.stderr, flush=True)
    elif os.environ.get("TORCHELASTIC_RUN_ID"):
        time.sleep(3)
        if who is None:
            print(f"neuron-tp {cmd}: error (rank {rank}): {error}", file=sys.stderr, flush=True)
    return 2


def _dispatch(cmd: str, rest: list[str]) -> int:
    if cmd == "consolidate":
        return _consolidate(rest)
    if cmd == "plan":
        from .plan import plan_command

        return plan_command(rest)
    if cmd == "selftest":
        from .selftest import selftest_command

        return selftest_command(rest)
    if cmd == "train":
        from .args import train_parser
        from .launch import train_command

        return train_command(train_parser().parse_args(rest))
    if cmd == "serve":
        from .args import serve_parser
        from .launch import serve_command

        serve_command(serve_parser().parse_args(rest))
        return 0
    from .args import generate_parser
    from .launch import generate_command

    generate_command(generate_parser().parse_args(rest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
