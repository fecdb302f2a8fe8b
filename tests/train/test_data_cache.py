"""--data-cache (neuron_tp.job.data_cache): ranks racing for one entry (threads: flock holds
between them as between processes) tokenize it once; the mapped rows equal the uncached ones;
another file content, option or tokenizer is another entry."""

from __future__ import annotations

import json
import threading

import torch

from neuron_tp.job.data import ByteTokenizer
from neuron_tp.job.sft_data import load_data


def _pc(path, n=30, tail="") -> str:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"say {i}{tail}:", "completion": f" {i * 7}"}) + "\n"
            for i in range(n)
        )
    )
    return str(path)


def _mapped_file(t: torch.Tensor) -> str:
    """The file whose mapping holds ``t``'s data ("" when none does)."""
    ptr = t.data_ptr()
    with open("/proc/self/maps") as fh:
        for line in fh:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi and len(parts) > 5:
                return parts[5]
    return ""


def test_one_writer_and_same_rows(tmp_path):
    path, cache = _pc(tmp_path / "pc.jsonl"), str(tmp_path / "cache")
    tok = ByteTokenizer()
    plain = load_data(path, tok, 32, 2)
    got, barrier = [None] * 6, threading.Barrier(6)

    def rank(r):
        barrier.wait()
        got[r] = load_data(path, tok, 32, 2, cache=cache)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    written = [d.notes[-1].endswith("(written)") for d in got]
    assert sum(written) == 1, [d.notes[-1] for d in got]
    for d in got:
        assert d.notes[:-1] == plain.notes
        assert set(d.rows) == set(plain.rows)
        for name, t in plain.rows.items():
            assert torch.equal(d.rows[name], t), name
    reader = got[written.index(False)]
    assert _mapped_file(reader.rows["input_ids"]).endswith("input_ids.npy")  # not a copy
    assert torch.equal(reader.next_batch()["labels"], plain.next_batch()["labels"])

    def entry(d):
        return d.notes[-1].split()[2]

    first = entry(got[0])
    assert entry(load_data(path, tok, 32, 2, packing=False, cache=cache)) != first
    assert entry(load_data(path, tok, 32, 2, loss_on="all", cache=cache)) != first
    again = load_data(_pc(tmp_path / "pc.jsonl", tail="!"), tok, 32, 2, cache=cache)
    assert entry(again) != first and again.notes[-1].endswith("(written)")


def test_text_rows_cached(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some plain text " * 40)
    tok = ByteTokenizer()
    plain = load_data(str(text), tok, 16, 2)
    for _ in range(2):
        cached = load_data(str(text), tok, 16, 2, cache=str(tmp_path / "c"))
        assert torch.equal(cached.rows["input_ids"], plain.rows["input_ids"])
        assert cached.rows["labels"] is cached.rows["input_ids"]  # stored once
    assert cached.notes[-1].endswith("(read)")
