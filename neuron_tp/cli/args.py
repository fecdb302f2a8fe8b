"""Command-line parsers of ``scripts/train.py`` / ``neuron-tp train``, of
``scripts/generate.py`` / ``neuron-tp generate`` and of ``neuron-tp serve`` (names are a
contract with the deployment templates), generated from the options records of
:mod:`neuron_tp.job.config` (each option's flag, default, help and range declared there once)."""

from __future__ import annotations

import argparse

from ..job.config import REPO_DATA, GenerateConfig, ServeConfig, TrainConfig
from ..job.options import build_parser, positive

__all__ = ["REPO_DATA", "generate_parser", "parser_of", "positive", "serve_parser", "train_parser"]


def parser_of(
    record: type[TrainConfig] | type[GenerateConfig] | type[ServeConfig],
) -> argparse.ArgumentParser:
    """The parser of a config record (its ``PROG``, ``DESCRIPTION`` and options)."""
    return build_parser(record, record.PROG, record.DESCRIPTION, allow_abbrev=False)


def train_parser() -> argparse.ArgumentParser:
    """Parser of the training script (dp = world size / tp)."""
    return parser_of(TrainConfig)


def generate_parser() -> argparse.ArgumentParser:
    """Parser of the generation script (tp ranks launched by torchrun)."""
    return parser_of(GenerateConfig)


def serve_parser() -> argparse.ArgumentParser:
    """Parser of ``neuron-tp serve`` (tp ranks launched by torchrun; rank 0 serves HTTP)."""
    return parser_of(ServeConfig)
