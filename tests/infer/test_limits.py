"""neuron_tp.infer.limits on its own: the JSON shape measured before parsing equals a
recursive walk of what ``json.loads`` returns (random documents full of quotes, backslashes
and brackets inside strings), and the API key check accepts exactly ``Bearer <key>``."""

from __future__ import annotations

import json
import random
import re

import pytest

from neuron_tp.infer.limits import RequestError, json_shape, key_matches, parse_json

TRICKY = ["\\", '"', "[", "]", "{", "}", "a", "\\\\", '\\"', " ", "é", "\n", '\\"]', '"['] + [""]


def _walk(value) -> tuple[int, int]:
    """(depth, number of arrays/objects) of a parsed JSON value, recursively."""
    if isinstance(value, (list, dict)):
        items = value.values() if isinstance(value, dict) else value
        shapes = [_walk(v) for v in items]
        return 1 + max((d for d, _ in shapes), default=0), 1 + sum(n for _, n in shapes)
    return 0, 0


def _document(rng: random.Random, depth: int = 0):
    roll = rng.random()
    if depth > 6 or roll < 0.3:
        return "".join(rng.choice(TRICKY) for _ in range(rng.randint(0, 6)))
    if roll < 0.4:
        return rng.choice([0, -1.5, True, None, 2**70])
    if roll < 0.7:
        return [_document(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {_document(rng, 9): _document(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def test_json_shape_equals_a_walk_of_the_parsed_value():
    rng = random.Random(28)
    for _ in range(3000):
        value = _document(rng)
        text = json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 1]))
        assert json_shape(text) == _walk(json.loads(text)), text
        assert parse_json(text.encode(), 64) == json.loads(text)


def test_parse_json_refuses_deep_wide_and_invalid_bodies():
    for body, words in (
        (b"[" * 65 + b"]" * 65, "nests 65 deep"),
        (b"[" * 100_000, "nests 100000 deep"),
        (b"[" + b"[]," * 70_000 + b"[]]", "has 70002 JSON arrays/objects"),
        (b'["' + b'\\"' * 100_000, "not valid JSON"),  # an unterminated string: linear
        (b"\xff", "not valid JSON (UTF-8)"),
    ):
        with pytest.raises(RequestError, match=re.escape(words)) as err:
            parse_json(body, 64)
        assert err.value.status == 400
    assert parse_json(b'{"a": "[[[[' + b"[" * 100 + b'"}', 1) == {"a": "[[[[" + "[" * 100}


def test_key_matches_only_bearer_and_the_exact_key():
    key = "k3y-28"
    assert key_matches(b"Bearer k3y-28", key) and key_matches(b"bearer k3y-28", key)
    for header in (None, b"", b"k3y-28", b"Bearer", b"Bearer k3y-2", b"Bearer k3y-288",
                   b"Basic k3y-28", b"Bearer K3Y-28", b"Bearerk3y-28"):  # fmt: skip
        assert not key_matches(header, key), header
