"""Tool calls of a chat request: its ``tools`` (OpenAI's ``{"type": "function", "function":
{"name", "description", "parameters"}}``), ``tool_choice`` and ``parallel_tool_calls``, checked;
the grammar a forced choice generates under (a named function: its parameters' JSON, one call;
``required``: a JSON array of ``{"name", "arguments"}`` objects of any tool, at least one, or
one such object when ``parallel_tool_calls`` is false); the calls in a model's text for
``auto`` by the server's ``--tool-call-parser``: ``hermes`` (``<tool_call>{"name",
"arguments"}</tool_call>``, Hermes and Qwen) or ``llama3_json`` (a JSON ``{"name",
"parameters"}`` object, several separated by ``;``, Llama 3), the first only when
``parallel_tool_calls`` is false; and :class:`CallStream`, the same calls as OpenAI's streamed
``tool_calls`` deltas while the text arrives."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3_json")
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolChoice:
    """What a request lets the model call: ``mode`` ``auto``, ``none``, ``required`` or
    ``named`` (``name``: the function); ``tools``: the request's tools (as sent)."""

    mode: str
    tools: tuple[dict, ...]
    name: str | None = None
    parallel: bool = True  # several calls may be made (parallel_tool_calls)

    @property
    def forced(self) -> bool:
        """Whether the answer is a call generated under a grammar."""
        return self.mode in ("required", "named")

    def schema(self) -> dict:
        """The JSON schema of a forced answer."""
        params = {t["function"]["name"]: _parameters(t) for t in self.tools}
        if self.mode == "named":
            return params[self.name]
        one = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "arguments": p},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for n, p in params.items()
            ]
        }
        return {"type": "array", "items": one, "minItems": 1} if self.parallel else one

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_choice(tools: Any, choice: Any, parallel: Any = None) -> ToolChoice | None:
    """The checked ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a request (None:
    no tools); ValueError naming what is wrong."""
    if parallel not in (None, True, False):
        raise ValueError(f"parallel_tool_calls must be a boolean, got {parallel!r}")
    if tools is None:
        if parallel is not None:
            raise ValueError("parallel_tool_calls needs tools")
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise ValueError('tools must be a non-empty list of {"type": "function", "function"}')
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name"}}}}')
        if not isinstance(fn.get("parameters", {}), dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        names.append(fn["name"])
    parallel = parallel is not False
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(choice or "auto", tuple(tools), parallel=parallel)
    named = isinstance(choice, dict) and choice.get("type") == "function"
    fn = choice.get("function") if named else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError(
            'tool_choice must be "auto", "none", "required" or '
            '{"type": "function", "function": {"name": ...}}'
        )
    if name not in names:
        raise ValueError(f"tool_choice names {name!r}, which is not in tools")
    return ToolChoice("named", tuple(tools), name, parallel)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call(name: str, arguments: Any) -> dict:
    """One ``tool_calls`` entry (``arguments`` as a JSON string, as OpenAI sends it)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def forced_calls(choice: ToolChoice, text: str) -> list[dict]:
    """The calls of a forced answer's text (the grammar's output)."""
    if choice.mode == "named":
        return [call(str(choice.name), text)]
    value = json.loads(text)
    return [call(v["name"], v["arguments"]) for v in (value if choice.parallel else [value])]


def parse_calls(parser: str, text: str, names: set[str]) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a model's text by ``parser``: the calls to functions in
    ``names``; content: the text outside them (None when empty). Text that does not parse
    is content, with no calls."""
    calls: list[dict] = []
    if parser == "hermes":
        for body in HERMES_CALL.findall(text):
            value = _object(body)
            if value is None or value.get("name") not in names:
                return text, []
            calls.append(call(value["name"], value.get("arguments", {})))
        rest = HERMES_CALL.sub("", text).strip()
        return (rest or None) if calls else text, calls
    stripped = text.strip().removeprefix("<|python_tag|>")
    for part in stripped.split(";") if stripped.startswith("{") else []:
        value = _object(part)
        if value is None or value.get("name") not in names:
            return text, []
        calls.append(call(value["name"], value.get("parameters", value.get("arguments", {}))))
    return (None if calls else text), calls


def _object(text: str) -> dict | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


HERMES_OPEN, HERMES_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


class _CallText:
    """One call's JSON object as its text arrives: ``{"name": ..., "arguments" (or
    "parameters"): value}``; the name once its string is complete, then the value's text as
    it comes (trailing whitespace held back until more follows)."""

    def __init__(self) -> None:
        self.buf, self.depth, self.in_str, self.escaped = "", 0, False, False
        self.closed = False
        self.head: int | None = None  # where the value starts, once the name is known
        self.name: str | None = None
        self.value_end: int | None = None  # where the value ended (a "," or the closing "}")
        self.sent = 0  # characters of the value given out

    def feed(self, text: str) -> str:
        """Take ``text`` up to the end of the object: the rest (after it)."""
        for k, ch in enumerate(text):
            self.buf += ch
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_str = False
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = True
                    self._value_ends(len(self.buf) - 1)
                    return text[k + 1 :]
            elif ch == "," and self.depth == 1:
                self._value_ends(len(self.buf) - 1)
            if self.head is None and not ch.isspace():  # the value's first character?
                m = _HEAD.match(self.buf)
                if m is not None and m.end() == len(self.buf) - 1:
                    self.name, self.head = json.loads(m.group(1)), m.end()
        return ""

    def _value_ends(self, at: int) -> None:
        if self.head is not None and self.value_end is None and at >= self.head:
            self.value_end = at

    def take(self) -> str:
        """The value's text since the last call."""
        assert self.head is not None
        end = self.value_end if self.value_end is not None else len(self.buf)
        text = self.buf[self.head : end]
        text = text if self.value_end is not None else text.rstrip()
        piece, self.sent = text[self.sent :], max(self.sent, len(text))
        return piece

    def whole(self) -> dict | None:
        """The closed object (None: not JSON, or no object)."""
        return _object(self.buf)


class CallStream:
    """One choice's streamed answer with tools: :meth:`feed` each piece of text, get the
    content to send and the ``tool_calls`` delta entries (``{"index", "id", "type",
    "function": {"name", "arguments"}}`` first, then ``{"index", "function": {"arguments"}}``
    pieces); :meth:`finish` flushes what was held back. Forced answers are calls (``named``:
    the text is the arguments; ``required``: the grammar's JSON); ``auto`` answers are read by
    ``parser``: content as it comes (a possible start of a call held back), a call to a known
    function streamed from its name on, its arguments as generated; a call to an unknown
    function, or text that is no call, is content. Without ``parallel`` only the first call is
    sent."""

    def __init__(self, choice: ToolChoice, parser: str = "hermes"):
        self.choice, self.parser, self.names = choice, parser, choice.names
        self.pending = ""  # text not yet decided
        self.state = "start"
        self.call: _CallText | None = None
        self.calls = 0  # calls announced
        self.announced = False  # the current call's name was sent
        self.ids: list[str] = []

    @property
    def called(self) -> bool:
        return self.calls > 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """``(content, entries)`` of the text so far."""
        self.pending += text
        content: list[str] = []
        entries: list[dict] = []
        while self.pending:
            if not self._step(content, entries):
                break
        return "".join(content), entries

    def finish(self) -> tuple[str, list[dict]]:
        """``(content, entries)`` of what was held back at the end of the text."""
        content: list[str] = []
        entries: list[dict] = []
        if self.choice.mode == "named":
            return "", entries
        if self.call is not None and not self.call.closed and not self.announced:
            if self.choice.mode == "auto":  # an unfinished call of no known name: content
                opener = HERMES_OPEN if self.parser == "hermes" else ""
                content.append(opener + self.call.buf)
        if self.state in ("content", "start", "text") and self.choice.mode == "auto":
            content.append(self.pending)
        self.pending = ""
        return "".join(content), entries

    # -- the states ------------------------------------------------------------------------
    def _step(self, content: list[str], entries: list[dict]) -> bool:
        """Advance on ``self.pending``; False: wait for more text."""
        mode = self.choice.mode
        if mode == "named":
            entries += self._named(self.pending)
            self.pending = ""
            return True
        if self.state == "call":
            return self._in_call(content, entries)
        if mode == "required":
            return self._between("[,]" if self.choice.parallel else "")
        if self.parser == "hermes":
            return self._hermes(content)
        return self._llama(content)

    def _named(self, text: str) -> list[dict]:
        if not text:
            return []
        fn: dict = {"arguments": text}
        if self.calls:
            return [{"index": 0, "function": fn}]
        self.calls, self.ids = 1, [call_id()]
        fn = {"name": str(self.choice.name), **fn}
        return [{"index": 0, "id": self.ids[0], "type": "function", "function": fn}]

    def _between(self, separators: str) -> bool:
        """Before, between or after JSON calls: skip whitespace and ``separators``; a ``{``
        starts a call; anything else ends the calls (dropped)."""
        text = self.pending.lstrip()
        while text and text[0] in separators:
            text = text[1:].lstrip()
        self.pending = text
        if not text:
            return False
        if text[0] != "{" or self.state == "done":
            self.state, self.pending = "done", ""
            return False
        self._open()
        return True

    def _hermes(self, content: list[str]) -> bool:
        if self.state == "close":  # after a call's object: up to its closing tag
            k = self.pending.find(HERMES_CLOSE)
            if k < 0:
                return False
            self.pending, self.state = self.pending[k + len(HERMES_CLOSE) :], "content"
            return True
        k = self.pending.find(HERMES_OPEN)
        if k < 0:
            held = _held_back(self.pending, HERMES_OPEN)
            content.append(self.pending[: len(self.pending) - held])
            self.pending = self.pending[len(self.pending) - held :]
            return False
        content.append(self.pending[:k])
        self.pending = self.pending[k + len(HERMES_OPEN) :]
        self._open()
        return True

    def _llama(self, content: list[str]) -> bool:
        if self.state == "text":
            content.append(self.pending)
            self.pending = ""
            return False
        if self.state == "start":
            text = self.pending.lstrip()
            if not text or (PYTHON_TAG.startswith(text) and text != PYTHON_TAG):
                return False  # undecided yet
            text = text.removeprefix(PYTHON_TAG).lstrip()
            if not text:
                return False
            if text[0] != "{":
                self.state = "text"
                return True
            self.pending, self.state = text, "between"
        return self._between(";")

    def _open(self) -> None:
        self.call, self.state, self.announced = _CallText(), "call", False

    def _in_call(self, content: list[str], entries: list[dict]) -> bool:
        """Feed the current call; announce it once its name is known, then its arguments."""
        c = self.call
        assert c is not None
        self.pending = c.feed(self.pending)
        muted = self.calls >= 1 and not self.choice.parallel and not self.announced
        if c.name is not None and not self.announced and not muted:
            if c.name not in self.names and self.choice.mode == "auto":
                return self._not_a_call(content)
            self.announced = True
            self.ids.append(call_id())
            self.calls += 1
            head = {"index": self.calls - 1, "id": self.ids[-1], "type": "function"}
            entries.append({**head, "function": {"name": c.name, "arguments": c.take()}})
        elif self.announced:
            piece = c.take()
            if piece:
                entries.append({"index": self.calls - 1, "function": {"arguments": piece}})
        if not c.closed:
            return False
        if c.head is None and not muted:  # keys in another order: the whole object at once
            value = c.whole()
            if value is None or value.get("name") not in self.names:
                return self._not_a_call(content)
            one = call(value["name"], value.get("arguments", value.get("parameters", {})))
            self.calls += 1
            self.ids.append(one["id"])
            entries.append({"index": self.calls - 1, **one})
        self.call, self.announced = None, False
        if self.choice.mode == "required":
            self.state = "between" if self.choice.parallel else "done"
        else:
            self.state = "close" if self.parser == "hermes" else "between"
        return True

    def _not_a_call(self, content: list[str]) -> bool:
        """The current call is text after all: it, and (llama3_json) all after it, content."""
        c = self.call
        assert c is not None
        opener = HERMES_OPEN if self.parser == "hermes" else ""
        content.append(opener + c.buf)
        self.call = None
        self.state = "content" if self.parser == "hermes" else "text"
        return True


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
