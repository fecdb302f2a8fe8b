"""Instruction data (neuron_tp.job.samples / chat / rows / sft_data): formats detected per
file, loss masks against what the tokenizer itself says (the template's generation marks, the
decoded answer text), packed rows from which every sample is recovered with nothing crossing a
boundary, the packed loss equal to per-sample transformers losses, and bad input named by
file:line."""

from __future__ import annotations

import json

import pytest
import torch

from neuron_tp.job.chat import encode_record
from neuron_tp.job.data import ByteTokenizer
from neuron_tp.job.rows import IGNORE_INDEX as IGNORE
from neuron_tp.job.rows import assign_rows, fit, pack, pad
from neuron_tp.job.samples import read_records
from neuron_tp.job.sft_data import load_data
from tiny_tokenizer import CHAT_TEMPLATE, PLAIN_CHAT_TEMPLATE, bpe_tokenizer_dir

CHATS = [
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "Four."},
        {"role": "user", "content": "And three plus three?"},
        {"role": "assistant", "content": "Six, of course."},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
    ],
    [
        {"role": "user", "content": "Say hello to the river."},
        {"role": "assistant", "content": "Hello, river, how are you today?"},
    ],
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    return AutoTokenizer.from_pretrained(bpe_tokenizer_dir(str(out), 300, CHAT_TEMPLATE))


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _encode(path, tok, loss_on="answers"):
    _, records = read_records(path)
    return [encode_record(r, tok, loss_on) for r in records]


def _answers(tok, ids, mask) -> str:
    return tok.decode([i for i, m in zip(ids, mask) if m])


def test_chat_masks_are_the_assistant_turns(tmp_path, tok):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS])
    marked = _encode(path, tok)
    for chat, (ids, mask) in zip(CHATS, marked):
        # the ids are the template's rendering, the mask its answers (content + EOS)
        assert ids == tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
        want = "".join(m["content"] + "</s>" for m in chat if m["role"] == "assistant")
        assert _answers(tok, ids, mask) == want
    # the fallback (no {% generation %} in the template): the same masks
    tok.chat_template = PLAIN_CHAT_TEMPLATE
    try:
        assert _encode(path, tok) == marked
    finally:
        tok.chat_template = CHAT_TEMPLATE
    everything = _encode(path, tok, "all")
    assert [ids for ids, _ in everything] == [ids for ids, _ in marked]
    assert all(all(mask) for _, mask in everything)


def test_prompt_completion_masks(tmp_path, tok):
    plain = _jsonl(
        tmp_path / "pc.jsonl",
        [{"prompt": "Q: the sky? A:", "completion": " blue"}, {"prompt": "x", "completion": "y"}],
    )
    for (ids, mask), c in zip(_encode(plain, tok), [" blue", "y"]):
        assert _answers(tok, ids, mask) == c + "</s>"
        assert mask == sorted(mask)  # prompt first, then the completion
    conv = _jsonl(
        tmp_path / "conv.jsonl",
        [{"prompt": CHATS[0][:4], "completion": CHATS[0][4:]}],
    )
    (ids, mask) = _encode(conv, tok)[0]
    assert ids == tok.apply_chat_template(CHATS[0], tokenize=True, return_dict=True)["input_ids"]
    assert _answers(tok, ids, mask) == "Six, of course.</s>"  # not the prompt's "Four."


def _samples(n: int, seed: int = 0) -> list[tuple[list[int], list[bool]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(2, 20, (1,), generator=g))
        ids = torch.randint(0, 250, (length,), generator=g).tolist()
        mask = (torch.rand(length, generator=g) < 0.6).tolist()
        mask[-1] = True
        out.append((ids, mask))
    return out


def test_packed_rows_hold_every_sample_and_nothing_crosses(tmp_path):
    seq_len = 24
    samples = _samples(60)
    rows = pack(samples, seq_len, pad_id=0)
    assert set(rows) == {"input_ids", "labels", "position_ids", "segment_ids"}
    assert all(t.shape == rows["input_ids"].shape and t.dtype == torch.long for t in rows.values())
    found = []
    for r in range(len(rows["input_ids"])):
        seg = rows["segment_ids"][r]
        k = int(seg.max())
        assert int((seg == 0).sum()) == seq_len - int((seg > 0).sum())  # padding at the end
        assert torch.all(rows["labels"][r][seg == 0] == IGNORE)
        for s in range(1, k + 1):
            at = (seg == s).nonzero().flatten()
            assert torch.equal(at, torch.arange(int(at[0]), int(at[-1]) + 1))  # contiguous
            ids = rows["input_ids"][r, at].tolist()
            labels = rows["labels"][r, at]
            assert torch.equal(rows["position_ids"][r, at], torch.arange(len(at)))
            found.append((ids, labels.tolist()))
        # HF predicts labels[t + 1] from token t: never from another sample (or padding)
        nxt = rows["labels"][r, 1:]
        crossing = seg[1:] != seg[:-1]
        assert torch.all(nxt[crossing] == IGNORE), "a label is predicted across a boundary"
    want = []
    for ids, mask in samples:
        labels = [i if m else IGNORE for i, m in zip(ids, mask)]
        want.append((ids, [IGNORE, *labels[1:]]))
    assert sorted(found) == sorted(want)
    # fewer rows than samples, and best-fit fills rows
    assert len(rows["input_ids"]) < len(samples) // 2
    padded = pad(samples, seq_len, pad_id=0)
    assert set(padded) == {"input_ids", "labels"} and len(padded["input_ids"]) == len(samples)


def test_packed_loss_is_the_per_sample_loss():
    """Labels of a packed row against plain transformers per sample: the logits of each
    sample computed on its own, placed where the packing put it; HF's loss on the packed
    labels is the per-sample losses' token-weighted mean."""
    from neuron_tp.job.presets import build_model

    model = build_model("tiny-llama", 257, 0).eval()
    samples = [(ids, [m or j % 3 == 0 for j, m in enumerate(mask)]) for ids, mask in _samples(7)]
    rows = pack(samples, 32, pad_id=0)
    logits = torch.zeros(*rows["input_ids"].shape, 257)
    total, count = 0.0, 0
    with torch.no_grad():
        for ids, mask in samples:
            x = torch.tensor([ids])
            lab = torch.tensor([[i if m else IGNORE for i, m in zip(ids, mask)]])
            out = model(input_ids=x, labels=lab)
            n = int((lab[0, 1:] != IGNORE).sum())
            total, count = total + float(out.loss) * n, count + n
            for r in range(len(rows["input_ids"])):  # its place in the packed rows
                row = rows["input_ids"][r].tolist()
                for s in range(1, int(rows["segment_ids"][r].max()) + 1):
                    at = (rows["segment_ids"][r] == s).nonzero().flatten()
                    if row[int(at[0]) : int(at[-1]) + 1] == ids:
                        logits[r, at] = out.logits[0]
        packed = model.loss_function(logits, rows["labels"], vocab_size=257)
    torch.testing.assert_close(packed, torch.tensor(total / count), atol=1e-5, rtol=0)


def test_overlong_truncated_or_dropped():
    long = (list(range(30)), [False] * 10 + [True] * 20)
    late = (list(range(30)), [False] * 25 + [True] * 5)
    short = (list(range(5)), [False, True, True, True, True])
    kept, counts = fit([long, late, short], 20, "truncate")
    assert [len(ids) for ids, _ in kept] == [20, 5] and counts.truncated == 1
    assert counts.dropped_no_loss == 1  # the answer of `late` lies beyond --seq-len
    assert "1 dropped: no loss token" in counts.describe(20, "truncate")
    kept, counts = fit([long, late, short], 20, "drop")
    assert kept == [short] and counts.dropped_long == 2
    assert "2 longer than --seq-len 20 dropped" in counts.describe(20, "drop")


def test_best_fit_rows():
    assert assign_rows([5, 3, 2, 7, 1], 8) == [[3, 4], [0, 1], [2]]  # 7+1, 5+3, 2
    assert assign_rows([8, 8], 8) == [[0], [1]]


def test_load_data_batches(tmp_path, tok):
    path = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in CHATS * 8])
    packed = load_data(path, tok, 128, 2, seed=1)
    batch = packed.next_batch()
    assert set(batch) == {"input_ids", "labels", "position_ids", "segment_ids"}
    assert all(t.shape == (2, 128) for t in batch.values())
    assert "24 of 24 samples used" in packed.notes[0]
    padded = load_data(path, tok, 128, 2, seed=1, packing=False)
    assert set(padded.next_batch()) == {"input_ids", "labels"}
    assert len(padded.chunks) == 24 and len(packed.chunks) < 24
    text = tmp_path / "t.txt"
    text.write_text("plain text " * 50)
    lm = load_data(str(text), ByteTokenizer(), 16, 2)
    b = lm.next_batch()
    assert set(b) == {"input_ids", "labels"} and torch.equal(b["input_ids"], b["labels"])


BAD = [
    ("shape", [{"question": "?"}], "bad.jsonl:1: expected a JSON object"),
    ("mixed", [{"text": "a"}, {"messages": CHATS[1]}], "bad.jsonl:2: a 'messages' line in a file"),
    ("json", ['{"text": '], "bad.jsonl:1: not valid JSON"),
    ("role", [{"messages": [{"role": "bot", "content": "x"}]}], "bad.jsonl:1: messages.0. has"),
    ("content", [{"messages": [{"role": "user", "content": 3}]}], r"bad.jsonl:1: messages\[0\]"),
    ("no answer", [{"messages": CHATS[1][:1]}], "bad.jsonl:1: no 'assistant' message"),
    ("pc types", [{"prompt": "a", "completion": ["b"]}], "bad.jsonl:1: 'prompt' and"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_lines_named(tmp_path, tok, case):
    _, lines, message = case
    path = tmp_path / "bad.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    with pytest.raises(ValueError, match=message):
        load_data(str(path), tok, 64, 1)


def test_bad_datasets_named(tmp_path, tok):
    (tmp_path / "d").mkdir()
    chat = _jsonl(tmp_path / "d" / "chat.jsonl", [{"messages": c} for c in CHATS])
    (tmp_path / "d" / "notes.txt").write_text("some text")
    with pytest.raises(ValueError, match="mixes raw text"):
        load_data(str(tmp_path / "d"), tok, 64, 1)
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        load_data(chat, ByteTokenizer(), 64, 1)
    tok.chat_template = "{{ raise_exception('no system messages') }}"
    try:
        with pytest.raises(ValueError, match="chat.jsonl:1: the chat template cannot render"):
            load_data(chat, tok, 64, 1)
    finally:
        tok.chat_template = CHAT_TEMPLATE


def test_shipped_example_loads():
    """examples/sft (scripts/build_sft_example.py): every sample used, the loss on answers."""
    import os

    from neuron_tp.job.data import load_tokenizer

    here = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "sft")
    tok = load_tokenizer(os.path.join(here, "tokenizer"))
    assert tok.chat_template == CHAT_TEMPLATE
    for name in ("chat.jsonl", "prompt_completion.jsonl"):
        data = load_data(os.path.join(here, name), tok, 128, 4)
        assert "400 of 400 samples used" in data.notes[0], data.notes
    _, records = read_records(os.path.join(here, "chat.jsonl"))
    ids, mask = encode_record(records[1], tok, "answers")
    assert _answers(tok, ids, mask) == records[1].value["messages"][-1]["content"] + "</s>"
