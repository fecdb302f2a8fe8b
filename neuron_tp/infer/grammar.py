"""Grammar-constrained generation (structured outputs, forced tool calls) with llguidance: a
request's grammar (a JSON schema, any JSON object) compiled once per request, a matcher per row
advanced on the host with every accepted token, and the tokens it allows next as a packed row
of bits (llguidance's bitmask, ``vocab / 32`` int32 words) that the slot generator uploads as
data and its graphs unpack into an additive row (0: allowed, ``-inf``: not) beside the row's
``logit_bias`` (no graph per schema). The matcher allows the end-of-text token only
where the grammar may end; a row ends when its grammar is complete.

llguidance is imported lazily (the ``grammar`` extra)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch

from .sampling import WORD_BITS, allowed_words, unpack_allowed


def _llguidance():
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - the extra is missing
        raise ValueError(
            "structured outputs need llguidance (pip install 'neuron-tp[grammar]')"
        ) from e
    return llguidance


def json_grammar(schema: dict | None) -> str:
    """The grammar of JSON text matching ``schema`` (None: any JSON object), compact (no
    whitespace between tokens: a model cannot pad it forever)."""
    llg = _llguidance()
    options: Any = {"whitespace_flexible": False}
    try:
        return llg.LLMatcher.grammar_from_json_schema(schema or {"type": "object"}, options)
    except ValueError as e:
        raise ValueError(f"not a JSON schema: {e}") from None


class _ByteTokens:
    """The byte-level tokenizer as llguidance's tokenizer interface."""

    def __init__(self, tokenizer):
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = None
        self.tokens = [bytes([i]) for i in range(256)] + [b"<|endoftext|>"]
        self.special_token_ids = [self.eos_token_id]

    def __call__(self, text):
        return list(text.encode("utf-8") if isinstance(text, str) else text)


class Grammars:
    """A tokenizer's llguidance view for a ``vocab``-token model (built once)."""

    def __init__(self, tokenizer, vocab: int, eos_ids: list[int]):
        llg = _llguidance()
        if hasattr(tokenizer, "backend_tokenizer") or hasattr(tokenizer, "_tokenizer"):
            import llguidance.hf

            self.tokens = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        else:
            wrapped = llg.TokenizerWrapper(_ByteTokens(tokenizer))
            self.tokens = llg.LLTokenizer(wrapped, n_vocab=vocab, eos_token=eos_ids or None)
        self.vocab, self.eos_ids = vocab, list(eos_ids)

    def check(self, grammar: str) -> None:
        """ValueError when ``grammar`` does not compile."""
        Guide(self, grammar)

    def guide(self, grammar: str) -> Guide:
        return Guide(self, grammar)


class Guide:
    """One row's grammar state: :meth:`mask` of the next token, :meth:`accept` a token."""

    def __init__(self, grammars: Grammars, grammar: str):
        llg = _llguidance()
        self.vocab, self.eos_ids = grammars.vocab, grammars.eos_ids
        self.matcher = llg.LLMatcher(grammars.tokens, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"grammar: {self.matcher.get_error()}")

    def bits(self) -> torch.Tensor:
        """``[allowed_words(vocab)]`` int32: bit ``j`` of word ``w`` set where the grammar
        allows token ``32 w + j`` next (an end token only where the grammar may end, even
        when it is also a text token; ids past the tokenizer's never): llguidance's bitmask
        as it is, the row the slot generator uploads and unpacks on the device."""
        n = allowed_words(self.vocab)
        words = np.zeros(n, dtype=np.int32)
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.int32)[:n]
        words[: len(packed)] = packed
        if self.vocab % WORD_BITS:  # the last word's bits past the vocabulary
            words[-1] &= np.int32((1 << (self.vocab % WORD_BITS)) - 1)
        accepting = self.matcher.is_accepting()
        for e in self.eos_ids:
            w, bit = e // WORD_BITS, np.int32(1) << np.int32(e % WORD_BITS)
            words[w] = words[w] | bit if accepting else words[w] & ~bit
        return torch.from_numpy(words)

    def mask(self) -> torch.Tensor:
        """``[vocab]`` float: 0 where the grammar allows the token next, ``-inf`` elsewhere
        (:meth:`bits` unpacked)."""
        return unpack_allowed(self.bits(), self.vocab)

    def accept(self, token: int) -> None:
        """Advance by ``token``; ValueError when the grammar does not allow it."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} breaks the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """Whether the grammar is complete (nothing but the end may follow)."""
        return self.matcher.is_stopped()


def schema_of(response_format: Any) -> tuple[bool, dict | None]:
    """``(constrained, schema)`` of a request's ``response_format``: ``text`` (not
    constrained), ``json_object`` (any object: schema None) or ``json_schema``
    (``{"json_schema": {"name", "schema", "strict"}}``); ValueError otherwise."""
    if response_format is None:
        return False, None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return False, None
    if kind == "json_object":
        return True, None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ValueError('response_format.json_schema must be {"name": ..., "schema": {...}}')
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be an object")
        return True, schema
    raise ValueError(
        'response_format.type must be "text", "json_object" or "json_schema", got '
        + json.dumps(kind)
    )
