"""Detokenizer: the streamed text equals the whole decode, cut before the first stop string,
and nothing released is ever taken back (partial UTF-8 and stop-string prefixes held)."""

from __future__ import annotations

import pytest

from neuron_tp.infer.text import Detokenizer
from neuron_tp.job.data import ByteTokenizer

TOK = ByteTokenizer()


def _stream(text: str, stop: list[str]) -> tuple[list[str], Detokenizer]:
    d = Detokenizer(TOK, stop)
    parts = [d.add(t) for t in TOK.encode(text)]
    return parts + [d.finish()], d


@pytest.mark.parametrize(
    "text, stop, want",
    [
        ("hello world", [], "hello world"),
        ("hello world", ["wor"], "hello "),
        ("hello world", ["xyz", "lo w"], "hel"),
        ("abcabd", ["abd"], "abc"),  # a prefix of the stop string seen first, then the real one
        ("ab", ["abc"], "ab"),  # a held prefix that never completes is released at the end
        ("héllo wörld", ["ö"], "héllo w"),  # multi-byte characters in text and stop string
        ("日本語のテキスト", [], "日本語のテキスト"),
    ],
)
def test_streamed_text_is_the_decode_cut_at_the_first_stop(text, stop, want):
    parts, d = _stream(text, stop)
    assert "".join(parts) == want == d.text
    assert all("\ufffd" not in p for p in parts)  # no half character is ever released
    assert d.stopped == any(s in text for s in stop)


def test_text_that_may_start_a_stop_string_is_held_back():
    d = Detokenizer(TOK, ["END"])
    assert [d.add(t) for t in TOK.encode("xE")] == ["x", ""]  # "E" may start "END"
    assert d.add(TOK.encode("N")[0]) == ""
    assert d.add(TOK.encode("D")[0]) == "" and d.stopped and d.text == "x"
    assert d.add(TOK.encode("y")[0]) == "" and d.finish() == ""  # nothing after a stop


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="stop strings must not be empty"):
        Detokenizer(TOK, [""])
