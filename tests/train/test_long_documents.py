"""The pretraining data path reads long documents whole: the long-context recipe's documents
(examples/long-context/long_docs.jsonl, 4.7k to 8.5k tokens each) at --seq-len 4096 become rows
that are consecutive 4096-token slices of one stream (every document's ids, then EOS), nothing
truncated to a tokenizer's or a default length: checked against the tokenizers library's own
encoding of each document (a HF tokenizer whose model_max_length is 2048) and the byte-level
tokenizer, and through the data cache."""

from __future__ import annotations

import json
import os

import torch

from neuron_tp.job.data import ByteTokenizer
from neuron_tp.job.sft_data import load_data

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCS = os.path.join(REPO, "examples", "long-context", "long_docs.jsonl")
TOKENIZER = os.path.join(REPO, "examples", "sft", "tokenizer")
SEQ = 4096


def _documents() -> list[str]:
    with open(DOCS) as f:
        return [json.loads(line)["text"] for line in f if line.strip()]


def _expected_rows(ids_per_doc: list[list[int]], eos: int) -> torch.Tensor:
    stream = [i for ids in ids_per_doc for i in [*ids, eos]]
    n = len(stream) // SEQ
    return torch.tensor(stream[: n * SEQ]).view(n, SEQ)


def _check(data, want: torch.Tensor) -> None:
    rows = data.rows
    assert rows["input_ids"].shape == want.shape, (rows["input_ids"].shape, want.shape)
    assert torch.equal(rows["input_ids"], want)
    assert torch.equal(rows["labels"], want)  # the loss on every token
    assert set(rows) == {"input_ids", "labels"}  # no mask: rows a --cp ring can split


def test_long_documents_are_streamed_whole_at_seq_4096(tmp_path):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    docs = _documents()
    hf = AutoTokenizer.from_pretrained(TOKENIZER)
    hf.model_max_length = 2048  # a "2k" tokenizer: the data path must not truncate to it
    raw = Tokenizer.from_file(os.path.join(TOKENIZER, "tokenizer.json"))
    ids = [raw.encode(d).ids for d in docs]
    assert min(len(i) for i in ids) > SEQ, [len(i) for i in ids]  # each longer than a row
    want = _expected_rows(ids, hf.eos_token_id)
    assert len(want) >= 6
    _check(load_data(DOCS, hf, SEQ, 1), want)
    cache = str(tmp_path / "cache")
    for _ in range(2):  # written, then read back
        _check(load_data(DOCS, hf, SEQ, 1, cache=cache), want)

    byte_ids = [list(d.encode("utf-8")) for d in docs]
    _check(load_data(DOCS, ByteTokenizer(), SEQ, 2), _expected_rows(byte_ids, 256))
