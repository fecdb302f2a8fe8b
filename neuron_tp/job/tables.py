"""Rows of local Parquet and Arrow files (``.parquet``, ``.arrow`` as ``datasets`` writes them,
e.g. ``Dataset.to_parquet`` or ``save_to_disk``), read through the ``datasets`` library (the
optional ``data`` extra: ``pip install neuron_tp[data]``), streamed in file order without
copying the file into ``datasets``' cache. Each row is a dict of the formats of
:mod:`.samples`; a null column value counts as an absent key (a table has one schema for all its
rows: a row without ``name`` in its messages holds ``name: None`` there)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from ..errors import UserError

TABLE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}  # suffix: datasets' builder


def is_table(f: str) -> bool:
    """Whether ``f`` is read by :func:`table_rows`."""
    return f.endswith(tuple(TABLE_SUFFIXES))


def without_nulls(value: object) -> object:
    """``value`` with the null-valued keys of its dicts (and of the dicts in its lists)
    left out, recursively."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def table_rows(f: str) -> Iterator[tuple[str, Any]]:
    """``(where, row)`` of every row of table file ``f``, ``where`` = ``f:row i`` (``i`` from 0,
    as ``dataset[i]``); UserError when ``datasets`` is missing or ``f`` cannot be read."""
    kind = next(k for suffix, k in TABLE_SUFFIXES.items() if f.endswith(suffix))
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"{f}: .parquet / .arrow data is read through the `datasets` library, which is "
            "not installed: pip install neuron_tp[data] (or pip install datasets), or convert "
            "the file to .jsonl"
        ) from None
    try:
        rows = datasets.load_dataset(
            kind, data_files=os.path.abspath(f), split="train", streaming=True
        )
        for i, row in enumerate(rows):
            yield f"{f}:row {i}", without_nulls(row)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any reader failure names the file
        raise UserError(
            f"{f}: cannot be read as a {kind} table by datasets ({type(e).__name__}: {e})"
        ) from None
