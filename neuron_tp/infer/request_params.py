"""The generation parameters of a completion or chat request, checked: every numeric field
range-checked, every field this server does not implement refused (:func:`check_fields`);
mistakes raise :class:`BadRequest` (HTTP 400) naming the field.

Parameters (both endpoints unless said): ``max_tokens`` (or ``max_completion_tokens``;
0..the server's ``--max-new-tokens``, 0 only with ``echo``; absent: completions 16, chat the
room left in the slot, both at most that room and the server limit), ``temperature`` (0..2;
0: greedy), ``top_p`` ((0, 1]), ``top_k`` (0: off, at most the vocabulary), ``min_p`` (0..1),
``presence_penalty`` / ``frequency_penalty`` (-2..2, OpenAI's), ``repetition_penalty``
((0, 10], vLLM's), ``logit_bias`` (``{"token id": -100..100}``), ``seed`` (0..2**63-1; a
seeded request reproduces its text; choice ``j`` of ``n`` uses ``seed + j``), ``n`` (choices
per prompt), ``stop`` (a string or a list of them),
``stop_token_ids`` (ids that end a choice like EOS), ``stream`` (a boolean),
``stream_options.include_usage`` (a last chunk with the usage), ``user`` (accepted, no
effect). Completions: ``best_of`` (>= ``n``, not streamed: that many candidates per prompt,
candidate ``j`` drawn with ``seed + j``, the ``n`` with the highest cumulative log-probability
of their tokens returned, best first; the usage counts every candidate), ``logprobs``
(0..20: the chosen token's log-probability and that many most likely tokens per position),
``echo`` (the prompt in front of the text; with
``logprobs`` its tokens' log-probabilities too, the first one null). Chat: ``logprobs``
(a boolean) and ``top_logprobs`` (0..20); vLLM's ``echo`` (the last message's content leads
the answer when it has the answer's role), ``add_generation_prompt`` (default true) and
``continue_final_message`` (the assistant's last message goes on; the answer's role is the
last message's when the turn is not opened). The model's ``generation_config`` supplies the
defaults of ``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``repetition_penalty`` a
request leaves out (:func:`generation_defaults`). A chat message's ``content`` is a string or
a list of text parts (``[{"type": "text", "text": ...}]``, joined with newlines; other part
types get a 400 naming them); a tokenizer without a chat template (e.g. the byte-level
fallback) uses ``"{role}: {content}\\n"`` per message then ``"assistant: "``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .grammar import json_grammar, schema_of
from .sampling import MAX_LOGPROBS, MAX_SEED, Sampling
from .schedule import Output
from .tools import ToolChoice, tool_choice

MAX_TEMPERATURE = 2.0  # OpenAI's range: 0..2
MAX_INT = 2**63 - 1  # no count in a request needs more
COMPLETION_DEFAULT_MAX = 16  # OpenAI's default max_tokens of /v1/completions
COMMON_FIELDS = frozenset(
    (
        "model max_tokens max_completion_tokens temperature top_p top_k min_p n stream "
        "stream_options stop stop_token_ids presence_penalty frequency_penalty "
        "repetition_penalty logit_bias seed user"
    ).split()
)
FIELDS = {
    False: COMMON_FIELDS | {"prompt", "echo", "logprobs", "best_of"},
    True: COMMON_FIELDS
    | {
        "echo",
        "add_generation_prompt",
        "continue_final_message",
        "messages",
        "logprobs",
        "top_logprobs",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    },
}
NOT_IMPLEMENTED = {  # OpenAI fields this server refuses, and why
    "suffix": "insertion (suffix) is not supported",
    "response_format": "structured outputs (response_format) are chat-only",
    "functions": "function calls are not supported",
    "function_call": "function calls are not supported",
    "audio": "audio output is not supported",
    "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning effort is not supported",
    "web_search_options": "web search is not supported",
}
GENERATION_DEFAULTS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class CompletionParams:
    """The generation parameters of a completion or chat request (``seeded``: it named its
    seed, so its text is reproducible; ``max_tokens`` None: the default of each prompt;
    ``logprobs``: top log-probabilities per position, None: none; ``echo``: the prompt leads
    each choice's text)."""

    max_tokens: int | None
    sampling: Sampling
    stop: list[str]
    seeded: bool
    n: int = 1
    best_of: int = 1  # candidates per prompt (>= n): the n with the highest log-probability win
    logprobs: int | None = None
    echo: bool = False
    stop_ids: tuple[int, ...] = ()
    grammar: str | None = None  # what the text follows (response_format, a forced tool call)
    tools: ToolChoice | None = None
    chat_echo: bool = False  # the last message's content leads the answer (its role's)
    add_generation_prompt: bool = True  # chat: the template opens the assistant's turn
    continue_final: bool = False  # chat: the answer goes on with the last message

    def output(self) -> Output:
        """What the engine must return besides the text (log-probabilities also to rank
        ``best_of`` candidates)."""
        lp = self.logprobs is not None
        return Output(lp or self.ranked, lp and self.echo, self.stop_ids, self.grammar)

    @property
    def ranked(self) -> bool:
        """Whether candidates beyond ``n`` are generated and ranked (``best_of > n``)."""
        return self.best_of > self.n

    @property
    def candidates(self) -> int:
        """Sequences generated per prompt."""
        return max(self.n, self.best_of)


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with the offending parameter."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _number(
    body: dict, name: str, kind: type, default: Any, *, low: float, high: float, why: str = ""
):
    """``body[name]`` (``default`` when absent or null) as ``kind``: BadRequest naming it
    unless it is a finite number (an integer for ``int``) in ``low..high``."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"{name} must be a number, got {value!r}", name)
    if kind is int and value != int(value):
        raise BadRequest(f"{name} must be an integer, got {value!r}", name)
    if not low <= value <= high:  # before converting: a huge int is no float
        a_kind = "an integer" if kind is int else "a number"
        span = f"{low:g}..{high:g}" if kind is float else f"{low}..{high}"
        raise BadRequest(f"{name} must be {a_kind} in {span}{why}, got {value!r}", name)
    return kind(value)


def check_fields(body: dict, chat: bool) -> None:
    """BadRequest naming the first field of ``body`` (not null) this endpoint does not
    implement: a known OpenAI field that is not supported, or an unknown one."""
    endpoint = "/v1/chat/completions" if chat else "/v1/completions"
    for name, value in body.items():
        if value is None or name in FIELDS[chat]:
            continue
        why = NOT_IMPLEMENTED.get(name)
        if why is not None:
            raise BadRequest(f"{name}: {why} by this server; leave {name} unset", name)
        raise BadRequest(
            f"unknown field {name!r} for {endpoint} (this server refuses what it does not "
            "implement rather than ignore it; see docs/inference.md)",
            name,
        )


def generation_defaults(generation_config) -> dict:
    """The sampling defaults a model's ``generation_config`` sets (only what differs from
    transformers' own defaults, as vLLM reads it): a subset of
    :data:`GENERATION_DEFAULTS`."""
    if generation_config is None:
        return {}
    diff = generation_config.to_diff_dict()
    return {k: diff[k] for k in GENERATION_DEFAULTS if diff.get(k) is not None}


def _logit_bias(body: dict, vocab: int | None) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise BadRequest('logit_bias must be an object {"token id": bias}', "logit_bias")
    out = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise BadRequest(f"logit_bias: {key!r} is not a token id", "logit_bias") from None
        if token < 0 or (vocab is not None and token >= vocab):
            raise BadRequest(f"logit_bias: {token} is not a token id of this model", "logit_bias")
        out.append(
            (token, _number({"logit_bias": value}, "logit_bias", float, 0.0, low=-100, high=100))
        )
    return tuple(sorted(out))


def _stop_ids(body: dict, vocab: int | None) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(is_token_id(t) for t in ids):
        raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
    for t in ids:
        if t < 0 or (vocab is not None and t >= vocab):
            raise BadRequest(
                f"stop_token_ids: {t} is not a token id of this model", "stop_token_ids"
            )
    return tuple(ids)


def _logprobs(body: dict, chat: bool) -> int | None:
    """Top log-probabilities per position asked for (None: no log-probabilities)."""
    if not chat:
        return _number(body, "logprobs", int, None, low=0, high=MAX_LOGPROBS)
    if body.get("logprobs") not in (None, False, True):
        raise BadRequest(f"logprobs must be a boolean, got {body['logprobs']!r}", "logprobs")
    top = _number(body, "top_logprobs", int, None, low=0, high=MAX_LOGPROBS)
    if top is not None and not body.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    return (top or 0) if body.get("logprobs") else None


def parse_params(
    body: dict,
    limit: int,
    vocab: int | None = None,
    *,
    chat: bool = False,
    defaults: dict | None = None,
) -> CompletionParams:
    """Generation parameters of a request body (BadRequest naming the wrong one);
    ``max_tokens`` at most the server's ``limit`` (None when absent); ``top_k`` at most
    ``vocab`` (the model's vocabulary size, when known); ``defaults``: the model's
    generation_config values of what the body leaves out (:func:`generation_defaults`)."""
    check_fields(body, chat)
    body_or = {**(defaults or {}), **{k: v for k, v in body.items() if v is not None}}
    n = _number(body, "n", int, 1, low=1, high=MAX_INT, why=" (choices per prompt)")
    for flag in ("stream", "echo"):
        if body.get(flag) not in (None, False, True):
            raise BadRequest(f"{flag} must be a boolean, got {body[flag]!r}", flag)
    best_of = _number(body, "best_of", int, n, low=1, high=MAX_INT)
    if best_of < n:
        raise BadRequest(f"best_of must be >= n ({n}), got {best_of}", "best_of")
    if best_of > n and body.get("stream"):
        raise BadRequest("best_of > n cannot be streamed (set stream false)", "best_of")
    echo = bool(body.get("echo")) and not chat
    server = " (server limit: neuron-tp serve --max-new-tokens" + ("" if echo else "; 0 with echo")
    name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = _number(body, name, int, None, low=0 if echo else 1, high=limit, why=server + ")")
    temperature = _number(body_or, "temperature", float, 1.0, low=0.0, high=MAX_TEMPERATURE)
    top_k = _number(
        body_or, "top_k", int, 0, low=0, high=vocab or MAX_INT, why=" (0: off; at most the vocab)"
    )
    top_p = _number(body_or, "top_p", float, 1.0, low=0.0, high=1.0)
    if top_p == 0:
        raise BadRequest("top_p must be in (0, 1] (use temperature 0 for greedy), got 0", "top_p")
    min_p = _number(body_or, "min_p", float, 0.0, low=0.0, high=1.0)
    penalties = {
        p: _number(body, p, float, 0.0, low=-2.0, high=2.0)
        for p in ("presence_penalty", "frequency_penalty")
    }
    repetition = _number(body_or, "repetition_penalty", float, 1.0, low=0.0, high=10.0)
    if repetition == 0:
        raise BadRequest("repetition_penalty must be in (0, 10], got 0", "repetition_penalty")
    seed = _number(body, "seed", int, None, low=0, high=MAX_SEED)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop")
    rest = dict(
        top_p=top_p,
        min_p=min_p,
        repetition_penalty=repetition,
        logit_bias=_logit_bias(body, vocab),
        **penalties,
    )
    grammar, tools = _grammar(body) if chat else (None, None)
    turn = _turn(body) if chat else (True, False)
    if temperature == 0:
        sampling = Sampling(seed=seed or 0, **rest)
    else:
        sampling = Sampling(True, temperature, top_k, seed if seed is not None else 0, **rest)
    return CompletionParams(
        max_tokens,
        sampling,
        stop,
        seeded=seed is not None,
        n=n,
        best_of=best_of,
        logprobs=_logprobs(body, chat),
        echo=echo,
        stop_ids=_stop_ids(body, vocab),
        grammar=grammar,
        tools=tools,
        chat_echo=chat and bool(body.get("echo")),
        add_generation_prompt=turn[0],
        continue_final=turn[1],
    )


def _turn(body: dict) -> tuple[bool, bool]:
    """A chat's ``add_generation_prompt`` (default true) and ``continue_final_message``
    (vLLM's); BadRequest when they are not booleans or both true."""
    for flag in ("add_generation_prompt", "continue_final_message"):
        if body.get(flag) is not None and not isinstance(body[flag], bool):
            raise BadRequest(f"{flag} must be a boolean, got {body[flag]!r}", flag)
    opened = body.get("add_generation_prompt") is not False
    final = bool(body.get("continue_final_message"))
    if opened and final:
        raise BadRequest(
            "continue_final_message needs add_generation_prompt: false", "continue_final_message"
        )
    return opened, final


def _grammar(body: dict) -> tuple[str | None, ToolChoice | None]:
    """The grammar of a chat's ``response_format`` or forced tool call, and its tools."""
    try:
        tools = tool_choice(
            body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
        )
    except ValueError as e:
        param = "tools" if body.get("tools") is None else "tool_choice"
        raise BadRequest(str(e), "parallel_tool_calls" if "parallel" in str(e) else param) from None
    try:
        constrained, schema = schema_of(body.get("response_format"))
    except ValueError as e:
        raise BadRequest(str(e), "response_format") from None
    if tools is not None and tools.forced:
        if constrained:
            raise BadRequest(
                "response_format and a forced tool_choice exclude each other", "tool_choice"
            )
        constrained, schema = True, tools.schema()
    if not constrained:
        return None, tools
    try:
        return json_grammar(schema), tools
    except ValueError as e:
        raise BadRequest(str(e), "response_format") from None


def is_token_id(value: Any) -> bool:
    """An int that is not a bool (JSON's true / false are not token ids)."""
    return isinstance(value, int) and not isinstance(value, bool)
