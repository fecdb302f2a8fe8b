"""Parquet and Arrow data (neuron_tp.job.tables, through the `datasets` library): the same
samples written as jsonl, as a parquet file (``Dataset.to_parquet``) and as an arrow dataset
directory (``Dataset.save_to_disk``) give identical rows in every format, packed and padded;
null columns count as absent keys; bad rows are named ``file:row i``; without `datasets` the
error says what to install."""

from __future__ import annotations

import json
import sys

import datasets  # the `data` extra (requirements-dev.txt pins it)
import pytest
import torch

from neuron_tp.errors import UserError
from neuron_tp.job.data import ByteTokenizer
from neuron_tp.job.sft_data import build_rows
from tiny_tokenizer import CHAT_TEMPLATE, bpe_tokenizer_dir

# A template that renders a message's name when the message has one: a table holds a null
# `name` in every message without one; those render as the jsonl's messages without the key.
NAMED_TEMPLATE = CHAT_TEMPLATE.replace(
    r"{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}",
    r"{{ '<|' + m['role'] + '|>' }}{% if m.name is defined %}{{ '(' + m.name + ')' }}{% endif %}"
    r"{{ '\n' + m['content'] + '\n' }}",
)
CHATS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is two plus two?", "name": "ann"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six, of course."},
    ],
    [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}],
    [
        {"role": "user", "content": "Say hello to the river."},
        {"role": "assistant", "content": "Hello, river, how are you today?"},
    ],
]
FORMATS = {
    "messages": [{"messages": c} for c in CHATS * 3],
    "prompt-completion": [
        {"prompt": f"word {i}: {'ab' * i}", "completion": f" is {i}"} for i in range(9)
    ],
    "conversational": [{"prompt": c[:-1], "completion": c[-1:]} for c in CHATS * 3],
    "text": [{"text": f"line {i} of some plain text " * 3} for i in range(9)],
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    return AutoTokenizer.from_pretrained(bpe_tokenizer_dir(str(out), 300, NAMED_TEMPLATE))


def _write(tmp_path, name: str, rows: list[dict]) -> dict[str, str]:
    """``rows`` as a jsonl file, a parquet file and an arrow dataset directory."""
    jsonl = tmp_path / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / f"{name}.parquet"))
    table.save_to_disk(str(tmp_path / f"{name}-arrow"))
    return {
        "jsonl": str(jsonl),
        "parquet": str(tmp_path / f"{name}.parquet"),
        "arrow": str(tmp_path / f"{name}-arrow"),
    }


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_parquet_and_arrow_rows_equal_jsonl_rows(tmp_path, tok, fmt):
    files = _write(tmp_path, fmt, FORMATS[fmt])
    for packing in (True, False):
        want, want_notes = build_rows(files["jsonl"], tok, 48, "answers", packing, "truncate")
        assert len(want["input_ids"]) > 2
        for kind in ("parquet", "arrow"):
            rows, notes = build_rows(files[kind], tok, 48, "answers", packing, "truncate")
            assert notes == want_notes, kind
            assert rows.keys() == want.keys(), kind
            for k in want:
                assert torch.equal(rows[k], want[k]), f"{fmt} {kind} packing={packing}: {k}"


def test_bad_table_rows_named(tmp_path, tok):
    files = _write(tmp_path, "bad", [{"question": "?"}, {"question": "!"}])
    with pytest.raises(UserError, match=r"bad\.parquet:row 0: expected a JSON object"):
        build_rows(files["parquet"], tok, 48, "answers", True, "truncate")
    # one table, two formats: the null columns are absent keys, so row 1 is a chat
    mixed = [{"text": "a", "messages": None}, {"text": None, "messages": CHATS[1]}]
    files = _write(tmp_path, "mixed", mixed)
    for kind in ("parquet", "arrow"):
        with pytest.raises(UserError, match=r"row 1: a 'messages' row in a file of 'text' rows"):
            build_rows(files[kind], tok, 48, "answers", True, "truncate")
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(b"not a parquet file")
    with pytest.raises(UserError, match=r"broken\.parquet: cannot be read as a parquet table"):
        build_rows(str(broken), tok, 48, "answers", True, "truncate")


def test_without_datasets_the_error_says_what_to_install(tmp_path, monkeypatch):
    files = _write(tmp_path, "pc", FORMATS["prompt-completion"])
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: import fails
    with pytest.raises(UserError, match=r"pc\.parquet: .*pip install neuron_tp\[data\]"):
        build_rows(files["parquet"], ByteTokenizer(), 48, "answers", True, "truncate")
    # jsonl and text need nothing more
    build_rows(files["jsonl"], ByteTokenizer(), 48, "answers", True, "truncate")
