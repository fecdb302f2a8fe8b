"""Options declared once: a dataclass field made by :func:`opt` carries its command-line flag,
parser (``type``), default, help and valid range; :func:`build_parser` generates the argparse
parser of a record, :func:`from_namespace` builds the (possibly nested) record from the parsed
options, :func:`option_values` lists them again by flag. A field holding another record (a
group, e.g. ``TrainConfig.lora``) adds that record's options in place (under a help heading when
the group's class sets ``TITLE``). Imports nothing beyond the standard library."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import field, fields
from typing import Any, TypeVar

_Record = TypeVar("_Record")


def positive(kind: type) -> Callable[[str], int | float]:
    """An argparse ``type``: ``kind(text)``, refused unless > 0."""

    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def non_negative(kind: type) -> Callable[[str], int | float]:
    """An argparse ``type``: ``kind(text)``, refused unless >= 0."""

    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value

    return parse


def buckets(text: str) -> list[int]:
    """An argparse ``type``: comma-separated positive integers, sorted, without repeats."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"buckets must be comma-separated integers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"buckets must be positive integers, got {text!r}")
    return sorted(set(values))


def names(text: str) -> list[str]:
    """An argparse ``type``: comma-separated names (empty items dropped)."""
    return [m for m in text.split(",") if m.strip()]


def opt(flag: str, default: Any = None, help: str | None = None, **argparse_kwargs) -> Any:
    """A record field that is the option ``flag`` (``"--seq-len"``, or a positional name):
    ``default`` (a list is copied per record and per parser), ``help`` and the rest of
    ``add_argument``'s keywords (``type``, ``choices``, ``action``, ``metavar``, ``dest``,
    ``required``). The parsed value lands in ``dest`` (by default the flag's name with
    underscores), the name :func:`option_values` lists it under."""
    dest = argparse_kwargs.pop("dest", None) or flag.lstrip("-").replace("-", "_")
    meta = {"flag": flag, "dest": dest, "help": help, "kwargs": argparse_kwargs}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={**meta, "default": default})
    return field(default=default, metadata={**meta, "default": default})


def group(record: type) -> Any:
    """A record field holding the record of a group of options (its defaults)."""
    return field(default_factory=record, metadata={"group": record})


def _option_fields(record: type):
    """(field, group record or None) of ``record``'s fields, in declaration order."""
    for f in fields(record):
        if "group" in f.metadata:
            yield f, f.metadata["group"]
        elif "flag" in f.metadata:
            yield f, None


def add_options(parser, record: type) -> None:
    """``parser.add_argument`` for each option of ``record`` (groups: recursively)."""
    for f, sub in _option_fields(record):
        if sub is not None:
            title = getattr(sub, "TITLE", None)
            add_options(parser.add_argument_group(title) if title else parser, sub)
            continue
        meta = f.metadata
        kwargs = dict(meta["kwargs"])
        default = meta["default"]
        if isinstance(default, list):
            default = list(default)
        if meta["help"] is not None:
            kwargs["help"] = meta["help"]
        if meta["flag"].startswith("-"):  # a positional's name is its dest, it has no default
            kwargs["dest"] = meta["dest"]
            if not kwargs.get("required"):
                kwargs["default"] = default
        parser.add_argument(meta["flag"], **kwargs)


def build_parser(record: type, prog: str, description: str, **kwargs) -> argparse.ArgumentParser:
    """The argparse parser of ``record``'s options (``allow_abbrev`` etc. in ``kwargs``)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, **kwargs)
    add_options(parser, record)
    return parser


def _build(record: type, values: dict, missing: list[str]):
    kwargs = {}
    for f, sub in _option_fields(record):
        if sub is not None:
            kwargs[f.name] = _build(sub, values, missing)
        elif f.metadata["dest"] in values:
            kwargs[f.name] = values.pop(f.metadata["dest"])
        else:
            missing.append(f.metadata["dest"])
    return record(**kwargs)


def from_namespace(record: type[_Record], args: argparse.Namespace) -> _Record:
    """The record of parsed options. A TypeError names any option the namespace has and the
    record does not, or lacks."""
    values, missing = dict(vars(args)), list[str]()
    built = _build(record, values, missing)
    if values or missing:
        raise TypeError(
            f"{record.__name__}: unknown options {sorted(values)}, missing options {missing}"
        )
    return built


def flat_values(config) -> dict[str, object]:
    """Every option's value by its parser destination (``{"seq_len": 128, "lora_r": 0, ...}``):
    the parsed namespace again."""
    out = {}
    for f, sub in _option_fields(type(config)):
        value = getattr(config, f.name)
        if sub is not None:
            out.update(flat_values(value))
        else:
            out[f.metadata["dest"]] = value
    return out


def option_values(config) -> dict[str, object]:
    """Every option by its command-line name, sorted (``{"--seq-len": 128, ...}``; an option
    stored under another name, e.g. ``--no-packing``, by that name: ``--packing``)."""
    values = flat_values(config)
    return {"--" + dest.replace("_", "-"): values[dest] for dest in sorted(values)}


def option_flags(record: type) -> dict[str, str]:
    """Each option's parser destination -> its flag (groups included)."""
    out = {}
    for f, sub in _option_fields(record):
        if sub is not None:
            out.update(option_flags(sub))
        else:
            out[f.metadata["dest"]] = f.metadata["flag"]
    return out


def with_values(config, values: dict[str, object]):
    """``config`` with the options ``values`` (by parser destination, as
    :func:`flat_values` lists them) replaced, groups included; KeyError for an unknown one."""
    from dataclasses import replace

    values = dict(values)
    changes = {}
    for f, sub in _option_fields(type(config)):
        if sub is not None:
            inner = {k: values.pop(k) for k in list(values) if k in option_flags(sub)}
            if inner:
                changes[f.name] = with_values(getattr(config, f.name), inner)
        elif f.metadata["dest"] in values:
            changes[f.name] = values.pop(f.metadata["dest"])
    if values:
        raise KeyError(f"{type(config).__name__} has no options {sorted(values)}")
    return replace(config, **changes)
