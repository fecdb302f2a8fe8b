"""The options every command shares (:class:`CommonConfig`: model, tp, device, tokenizer,
seed, --xla-cpu-devices) and the record machinery's entry points; the commands' records are in
:mod:`.train_config` and :mod:`.inference_config`, all named by :mod:`.config`."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import ClassVar, TypeVar, cast

from .options import from_namespace, non_negative, opt, option_values
from .options import positive as pos

_Config = TypeVar("_Config", bound="CommonConfig")

REPO_DATA = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data"
)


@dataclass(frozen=True)
class CommonConfig:
    """Options shared by ``neuron-tp train``, ``generate`` and ``serve``."""

    PROG: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""

    model: str = opt(  # a preset name or a local directory
        "--model",
        "tiny-llama",
        "local HF model directory or a built-in preset (tiny-llama, tiny-gpt2, tiny-qwen3)",
    )
    tp: int = opt("--tp", 1, "tensor-parallel degree", type=pos(int))
    device: str = opt(
        "--device",
        "xla",
        "xla: NeuronCore when present, else the XLA CPU device; cpu: eager torch",
        choices=("xla", "cpu"),
    )
    tokenizer: str | None = opt(  # None: see job.tokenizer.resolve_tokenizer
        "--tokenizer",
        None,
        "local HF tokenizer directory, or 'bytes' (byte-level); default: the --model "
        "directory's tokenizer, a checkpoint's recorded one, byte-level for a preset",
    )
    seed: int = opt("--seed", 0, type=int)
    xla_cpu_devices: int = opt(  # 0: this process is one rank
        "--xla-cpu-devices",
        0,
        "run N ranks as XLA CPU devices of this one process (no torchrun): "
        "the graphs and collectives of an N-NeuronCore job, on a laptop",
        type=non_negative(int),
        metavar="N",
    )

    @classmethod
    def from_args(cls: type[_Config], args: argparse.Namespace | _Config) -> _Config:
        """The config of parsed options (returned unchanged when already one). A TypeError
        names any option the record lacks or misses, so the two cannot drift apart."""
        if isinstance(args, cls):
            return args
        return from_namespace(cls, cast(argparse.Namespace, args))

    def option_values(self) -> dict[str, object]:
        """Every option by its command-line name, sorted (``{"--seq-len": 128, ...}``): what
        the ranks of a job must agree on."""
        return option_values(self)
