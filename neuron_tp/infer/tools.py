"""Tool calls of a chat request: its ``tools`` (OpenAI's ``{"type": "function", "function":
{"name", "description", "parameters"}}``) and ``tool_choice``, checked; the grammar a forced
choice generates under (a named function: its parameters' JSON; ``required``: one
``{"name", "arguments"}`` object of any tool); and the calls in a model's text for ``auto``
by the server's ``--tool-call-parser``: ``hermes`` (``<tool_call>{"name", "arguments"}
</tool_call>``, Hermes and Qwen) or ``llama3_json`` (a JSON ``{"name", "parameters"}``
object, several separated by ``;``, Llama 3)."""

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

    @property
    def forced(self) -> bool:
        """Whether the answer is a call generated under a grammar."""
        return self.mode in ("required", "named")

    def schema(self) -> dict:
        """The JSON schema of a forced answer."""
        params = {t["function"]["name"]: _parameters(t) for t in self.tools}
        if self.mode == "named":
            return params[self.name]
        return {
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


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def tool_choice(tools: Any, choice: Any) -> ToolChoice | None:
    """The checked ``tools`` / ``tool_choice`` of a request (None: no tools); ValueError
    naming what is wrong."""
    if tools is None:
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
    if choice is None or choice in ("auto", "none", "required"):
        return ToolChoice(choice or "auto", tuple(tools))
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
    return ToolChoice("named", tuple(tools), name)


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call(name: str, arguments: Any) -> dict:
    """One ``tool_calls`` entry (``arguments`` as a JSON string, as OpenAI sends it)."""
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": args}}


def forced_calls(choice: ToolChoice, text: str) -> list[dict]:
    """The call of a forced answer's text (the grammar's output)."""
    if choice.mode == "named":
        return [call(str(choice.name), text)]
    value = json.loads(text)
    return [call(value["name"], value["arguments"])]


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
