"""Training records of the data files, their format detected per file: ``text`` (a ``.txt``
file, or jsonl ``{"text": ...}``: language modelling), ``messages`` (jsonl ``{"messages":
[{"role", "content"}, ...]}``: a chat rendered with the tokenizer's chat template) and
``prompt-completion`` (jsonl ``{"prompt", "completion"}``, both strings or both lists of
messages, the conversational form). ``.parquet`` / ``.arrow`` tables hold the same records, a
row each (:mod:`.tables`). One file holds one format; every mistake is a
:class:`~neuron_tp.errors.UserError` naming ``file:line`` (a table: ``file:row i``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import UserError
from .data import data_files, read_text
from .tables import is_table, table_rows

TEXT, MESSAGES, PROMPT_COMPLETION = "text", "messages", "prompt-completion"
ROLES = ("system", "user", "assistant", "tool")
SHAPES = (
    "{'text': str}, {'messages': [{'role': ..., 'content': str}, ...]} or "
    "{'prompt': ..., 'completion': ...} (two strings, or two lists of messages)"
)


@dataclass(frozen=True)
class Record:
    """One training sample as read: its format, its JSON value (a ``.txt`` file: the text)
    and where it came from (``where`` = ``file:line``)."""

    format: str
    value: Any  # str, or a JSON object (dict) of the record's format
    where: str


def check_messages(messages: object, where: str, field: str = "messages") -> list[dict]:
    """``messages`` when it is a non-empty list of ``{"role": one of ROLES, "content": str}``;
    UserError naming ``where`` otherwise."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: {field!r} must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(
                f"{where}: {field}[{i}] must be an object with 'role' and 'content', got {m!r}"
            )
        if m["role"] not in ROLES:
            raise UserError(
                f"{where}: {field}[{i}] has role {m['role']!r}; valid roles: {', '.join(ROLES)}"
            )
        if not isinstance(m["content"], str):
            raise UserError(f"{where}: {field}[{i}]['content'] must be a string")
    return messages


def line_format(obj: object, where: str) -> str:
    """The format of one parsed jsonl line (UserError naming ``where`` for another shape)."""
    if isinstance(obj, dict):
        if set(obj) >= {"prompt", "completion"}:
            p, c = obj["prompt"], obj["completion"]
            if isinstance(p, str) and isinstance(c, str):
                return PROMPT_COMPLETION
            if isinstance(p, list) and isinstance(c, list):
                check_messages(p, where, "prompt")
                check_messages(c, where, "completion")
                return PROMPT_COMPLETION
            raise UserError(
                f"{where}: 'prompt' and 'completion' must be two strings or two lists of "
                f"messages, got {type(p).__name__} and {type(c).__name__}"
            )
        if "messages" in obj:
            check_messages(obj["messages"], where)
            return MESSAGES
        if isinstance(obj.get("text"), str):
            return TEXT
    keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
    raise UserError(f"{where}: expected a JSON object {SHAPES}; got {keys}")


def jsonl_rows(f: str) -> Iterator[tuple[str, Any]]:
    """``(where, value)`` of every non-empty line of jsonl file ``f`` (``where`` =
    ``f:line``); UserError for a line that is not JSON."""
    for n, line in enumerate(read_text(f).split("\n"), 1):
        if not line.strip():
            continue
        try:
            yield f"{f}:{n}", json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{f}:{n}: not valid JSON ({e.msg}); expected {SHAPES}") from None


def file_records(f: str) -> tuple[str, list[Record]]:
    """The format of file ``f`` and its records (a ``.txt`` file: one text record; a
    ``.parquet`` / ``.arrow`` table: a record per row, :mod:`.tables`)."""
    if f.endswith(".txt"):
        return TEXT, [Record(TEXT, read_text(f), f"{f}:1")]
    fmt, first, records = None, "", []
    unit = "row" if is_table(f) else "line"
    for where, obj in table_rows(f) if is_table(f) else jsonl_rows(f):
        this = line_format(obj, where)
        if fmt is None:
            fmt, first = this, where
        elif this != fmt:
            raise UserError(
                f"{where}: a {this!r} {unit} in a file of {fmt!r} {unit}s ({first} is "
                f"{fmt!r}); one file holds one format: split it into one file per format"
            )
        records.append(Record(this, obj["text"] if this == TEXT else obj, where))
    if fmt is None:
        raise UserError(f"{f}: no records (an empty file); remove it or fill it")
    return fmt, records


def read_records(path: str) -> tuple[dict[str, str], list[Record]]:
    """Every record at ``path`` (a file or a directory), and each file's format."""
    formats, records = {}, []
    for f in data_files(path):
        formats[f], recs = file_records(f)
        records.extend(recs)
    return formats, records
