"""``neuron-tp train|generate|serve|consolidate|plan``: the command-line entry point."""

from __future__ import annotations

import argparse
import sys


def _consolidate(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="neuron-tp consolidate",
        description="Merge a sharded checkpoint into one HF directory (a LoRA run: the base "
        "with its adapters merged in).",
    )
    p.add_argument("checkpoint", help="a checkpoint directory (or an output dir: the newest)")
    p.add_argument("out_dir", help="new (or empty) directory for config.json + model.safetensors")
    p.add_argument(
        "--adapter-only",
        action="store_true",
        help="a LoRA run (--lora-r): write its PEFT adapter directory instead of the merged model",
    )
    args = p.parse_args(argv)
    from .checkpoint import consolidate

    try:
        out = consolidate(args.checkpoint, args.out_dir, adapter_only=args.adapter_only)
    except ValueError as e:
        print(f"neuron-tp consolidate: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the sub-command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    commands = ("train", "generate", "serve", "consolidate", "plan")
    if not argv or argv[0] not in commands:
        print(
            f"usage: neuron-tp {{{','.join(commands)}}} [options]  (-h after a command for "
            "its options)",
            file=sys.stderr,
        )
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "consolidate":
        return _consolidate(rest)
    if cmd == "plan":
        from .plan.cli import plan_command

        return plan_command(rest)
    if cmd == "train":
        from .train.args import train_parser
        from .train.launch import train_command

        train_command(train_parser().parse_args(rest))
        return 0
    if cmd == "serve":
        from .train.args import serve_parser
        from .train.launch import serve_command

        serve_command(serve_parser().parse_args(rest))
        return 0
    from .train.args import generate_parser
    from .train.launch import generate_command

    generate_command(generate_parser().parse_args(rest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
