"""What a completion or chat request asks for, checked before anything is queued: its
generation parameters (every numeric field range-checked), its prompts as token ids (text,
token ids checked against the vocabulary, or chat messages through the chat template) and
the engine's limits. Mistakes raise :class:`BadRequest` (HTTP 400) naming the field; so does
any field this server does not implement (:func:`check_fields`): nothing is silently ignored.

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

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .engine import Engine
from .grammar import json_grammar, schema_of
from .lora_slots import AdapterRef
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


@dataclass(frozen=True)
class CompletionRequest:
    """A checked completion or chat request: its parameters, whether its stream ends with a
    usage chunk, its prompts as token ids and each one's ``max_tokens`` (``n`` choices each),
    the prompts' texts (what ``echo`` shows; a chat's: the text its ``echo`` leads the answer
    with) and a chat answer's role."""

    params: CompletionParams
    include_usage: bool
    prompts: list[list[int]]
    max_tokens: list[int] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    role: str = "assistant"  # a chat answer's
    adapter: AdapterRef | None = None  # the LoRA adapter ``model`` names (None: the base)


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with the offending parameter."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def chat_prompt(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final: bool = False,
) -> str:
    """The prompt text of a chat (with the request's ``tools``): the tokenizer's chat
    template, else ``role: content`` lines (an assistant's tool calls and the tools as JSON)
    and ``assistant: `` (``add_generation_prompt``); ``continue_final``: the last message
    left open, the answer goes on with it."""
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        more = {"continue_final_message": True} if continue_final else {}
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **more,
        )
    lines = f"tools: {json.dumps(tools)}\n" if tools else ""
    for m in messages:
        calls = [c.get("function") for c in m.get("tool_calls") or []]
        lines += f"{m['role']}: {m['content']}{json.dumps(calls) if calls else ''}\n"
    if continue_final:
        return lines[:-1]
    return lines + ("assistant: " if add_generation_prompt else "")


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """The token ids of a prompt text (a chat's: without added specials, its template has
    them)."""
    if chat and hasattr(tokenizer, "apply_chat_template"):  # the template has the specials
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


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
    if not isinstance(ids, list) or not all(_is_id(t) for t in ids):
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


def message_text(index: int, message: Any) -> dict:
    """A chat message with its ``content`` as a string: a string, or a list of text parts
    (``{"type": "text", "text": ...}``) joined with newlines; BadRequest otherwise."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"messages[{index}] must be an object with a string role", "messages")
    content = message.get("content")
    if content is None and message.get("tool_calls"):
        content = ""
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                what = f"of type {kind!r}" if isinstance(kind, str) else repr(part)
                raise BadRequest(
                    f"messages[{index}].content: a part {what} is not supported; this server "
                    'takes text only: a string or [{"type": "text", "text": "..."}]',
                    "messages",
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    if not isinstance(content, str):
        raise BadRequest(
            f"messages[{index}].content must be a string or a list of text parts, got "
            f"{type(content).__name__}",
            "messages",
        )
    return {**message, "content": content}


def prepare(engine: Engine, body: dict, chat: bool) -> CompletionRequest:
    """A request's generation parameters, whether its stream ends with the usage, and its
    prompts as token ids (with each one's ``max_tokens``), all checked against the engine's
    limits (BadRequest or ValueError naming what is wrong; nothing is queued)."""
    limit, vocab = engine.max_tokens_limit, vocab_size(engine)
    defaults = getattr(engine, "sampling_defaults", None)
    params = parse_params(body, limit, vocab, chat=chat, defaults=defaults)
    usage = stream_usage(body)
    prompts, texts = request_prompts(engine, body, chat, vocab, params)
    most = getattr(engine, "max_queue", None)
    wanted = len(prompts) * params.candidates
    if most is not None and wanted > most:
        param = "best_of" if params.ranked else "n" if params.n > 1 else "prompt"
        raise BadRequest(
            f"at most {most} sequences per request (prompts x max(n, best_of); neuron-tp serve "
            f"--max-queue), got {wanted}",
            param,
        )
    lengths = []
    for p in prompts:
        n = params.max_tokens
        if n is None:
            room = engine.room(len(p))
            n = max(1, min(room, COMPLETION_DEFAULT_MAX) if not chat else room)
        engine.check(p, n, params.stop, params.sampling, params.output())
        lengths.append(n)
    role = "assistant"
    if chat and not params.add_generation_prompt:  # the answer goes on in the last turn
        role = body["messages"][-1]["role"]
    return CompletionRequest(params, usage, prompts, lengths, texts, role)


def stream_usage(body: dict) -> bool:
    """Whether a streamed request asks for a last chunk with the usage
    (``stream_options.include_usage``); BadRequest when ``stream_options`` is malformed."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict) or options.get("include_usage") not in (None, False, True):
        raise BadRequest(
            'stream_options must be an object like {"include_usage": true}', "stream_options"
        )
    return bool(options.get("include_usage"))


def request_prompts(
    engine: Engine,
    body: dict,
    chat: bool,
    vocab: int | None,
    params: CompletionParams | None = None,
) -> tuple[list[list[int]], list[str]]:
    """The prompts of a request as token ids and as text: a chat's messages through the chat
    template (its text: what its ``echo`` shows, the last message's content when that is the
    answer's role, per ``params``); a completion's ``prompt`` as a string, a list of strings,
    a list of token ids or a list of such lists (ids checked by :func:`token_ids`, their text
    decoded)."""
    tok = engine.tokenizer
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
        messages = [message_text(i, m) for i, m in enumerate(messages)]
        tools = body.get("tools") if body.get("tool_choice") != "none" else None
        params = params or CompletionParams(None, Sampling(), [], False)
        last = messages[-1]
        if params.continue_final and last["role"] != "assistant":
            raise BadRequest(
                "continue_final_message needs the last message to be the assistant's",
                "continue_final_message",
            )
        text = chat_prompt(
            tok,
            messages,
            tools,
            add_generation_prompt=params.add_generation_prompt,
            continue_final=params.continue_final,
        )
        role = "assistant" if params.add_generation_prompt else last["role"]
        lead = last["content"] if params.chat_echo and last["role"] == role else ""
        return [encode_prompt(tok, text, chat=True)], [lead]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        ids = [token_ids(prompt, vocab, "prompt")]  # one prompt of token ids
        return ids, [tok.decode(ids[0]) for _ in ids]
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if isinstance(prompts, list) and prompts and all(isinstance(p, list) for p in prompts):
        ids = [token_ids(p, vocab, f"prompt[{i}]") for i, p in enumerate(prompts)]
        return ids, [tok.decode(p) for p in ids]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(
            "prompt must be a string, a non-empty list of strings, a list of token ids "
            "or a list of lists of token ids",
            "prompt",
        )
    return [encode_prompt(tok, p, chat=False) for p in prompts], list(prompts)


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def token_ids(ids: list, vocab: int | None, where: str) -> list[int]:
    """A prompt given as token ids: BadRequest naming the first that is not an id of the
    model's vocabulary (``0..vocab-1``; any int >= 0 when ``vocab`` is None)."""
    if not ids:
        raise BadRequest(f"{where} has no token ids: a prompt needs at least one", "prompt")
    for j, t in enumerate(ids):
        if not _is_id(t) or t < 0 or (vocab is not None and t >= vocab):
            valid = f"0..{vocab - 1}" if vocab is not None else "integers >= 0"
            raise BadRequest(
                f"{where}[{j}]: {t!r} is not a token id of this model (valid: {valid})", "prompt"
            )
    return list(ids)


def vocab_size(engine: Engine) -> int | None:
    """The size of the served model's vocabulary (token ids are ``0..size-1``); None when the
    engine's generator has no model config (tests)."""
    config = getattr(getattr(engine.gen, "model", None), "config", None)
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) else None
