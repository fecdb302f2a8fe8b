"""What a completion or chat request asks for, checked before anything is queued: its
generation parameters (every numeric field range-checked), its prompts as token ids (text,
token ids checked against the vocabulary, or chat messages through the chat template) and
the engine's limits. Mistakes raise :class:`BadRequest` (HTTP 400) naming the field.

Parameters: ``max_tokens`` (or ``max_completion_tokens``; 1..the server's
``--max-new-tokens``), ``temperature`` (0..2; 0: greedy), ``top_k`` (an extension; 0: off, at
most the vocabulary), ``seed`` (0..2**63-1; a seeded request reproduces its text), ``stop`` (a
string or a list of up to 4), ``n`` / ``best_of`` (1 only), ``stream`` (a boolean),
``stream_options.include_usage`` (a last chunk with the usage). ``top_p`` other than 1,
non-zero ``presence_penalty`` / ``frequency_penalty``, ``echo`` and ``logprobs`` /
``top_logprobs`` (see :func:`refuse_logprobs`) are refused. A chat message's ``content`` is a
string or a list of text parts (``[{"type": "text", "text": ...}]``, joined with newlines;
other part types get a 400 naming them); a tokenizer without a chat template (e.g. the
byte-level fallback) uses ``"{role}: {content}\\n"`` per message then ``"assistant: "``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .engine import Engine
from .sampling import MAX_SEED, Sampling

MAX_STOP = 4  # stop strings per request, as OpenAI allows
MAX_TEMPERATURE = 2.0  # OpenAI's range: 0..2
MAX_INT = 2**63 - 1  # no count in a request needs more


@dataclass(frozen=True)
class CompletionParams:
    """The generation parameters of a completion or chat request (``seeded``: it named its
    seed, so its text is reproducible)."""

    max_tokens: int
    sampling: Sampling
    stop: list[str]
    seeded: bool


@dataclass(frozen=True)
class CompletionRequest:
    """A checked completion or chat request: its parameters, whether its stream ends with a
    usage chunk, and its prompts as token ids (one choice each)."""

    params: CompletionParams
    include_usage: bool
    prompts: list[list[int]]


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with the offending parameter."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def chat_prompt(tokenizer, messages: list[dict]) -> str:
    """The prompt text of a chat: the tokenizer's chat template, else ``role: content`` lines
    and ``assistant: ``."""
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return lines + "assistant: "


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


def parse_params(
    body: dict, limit: int, default_max: int = 16, vocab: int | None = None
) -> CompletionParams:
    """Generation parameters of a request body (BadRequest naming the wrong one);
    ``max_tokens`` defaults to ``default_max`` (at most the server's ``limit``); ``top_k`` is
    at most ``vocab`` (the model's vocabulary size, when known)."""
    if _number(body, "n", int, 1, low=1, high=MAX_INT, why=" (one choice per prompt)") != 1:
        raise BadRequest(f"n must be 1 (one choice per prompt), got {body['n']}", "n")
    if _number(body, "best_of", int, 1, low=1, high=MAX_INT, why=" (one choice per prompt)") != 1:
        got = body["best_of"]
        raise BadRequest(f"best_of must be 1 (one choice per prompt), got {got}", "best_of")
    server = " (server limit: neuron-tp serve --max-new-tokens)"
    name = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = _number(body, name, int, min(default_max, limit), low=1, high=limit, why=server)
    temperature = _number(body, "temperature", float, 1.0, low=0.0, high=MAX_TEMPERATURE)
    top_k = _number(
        body, "top_k", int, 0, low=0, high=vocab or MAX_INT, why=" (0: off; at most the vocab)"
    )
    seed = _number(body, "seed", int, None, low=0, high=MAX_SEED)
    if _number(body, "top_p", float, 1.0, low=0.0, high=1.0) != 1:
        raise BadRequest("top_p is not supported (use top_k); leave it unset or 1", "top_p")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if _number(body, penalty, float, 0.0, low=-2.0, high=2.0) != 0:
            raise BadRequest(f"{penalty} is not supported; leave it unset or 0", penalty)
    for flag in ("stream", "echo"):
        if body.get(flag) not in (None, False, True):
            raise BadRequest(f"{flag} must be a boolean, got {body[flag]!r}", flag)
    if body.get("echo"):
        raise BadRequest("echo is not supported; leave it unset or false", "echo")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP:
        raise BadRequest(f"at most {MAX_STOP} stop strings, got {len(stop)}", "stop")
    if temperature == 0:
        sampling = Sampling()
    else:
        sampling = Sampling(True, temperature, top_k, seed if seed is not None else 0)
    return CompletionParams(max_tokens, sampling, stop, seeded=seed is not None)


def refuse_logprobs(body: dict) -> None:
    """BadRequest when a request asks for log-probabilities (``logprobs``, ``top_logprobs``).

    Not supported: the replayed step graphs return only each row's chosen token (one small
    transfer per token); log-probabilities would be more graph outputs, and with them a
    second set of prefill/decode graphs per bucket to compile (or top-k work in every
    request's graphs). Refused rather than answered with ``null``."""
    for name in ("logprobs", "top_logprobs"):
        value = body.get(name)
        if value is not None and value is not False:  # 0 asks for the chosen token's
            raise BadRequest(
                f"{name} is not supported by this server (token log-probabilities are not "
                f"computed); leave {name} unset",
                name,
            )


def message_text(index: int, message: Any) -> dict:
    """A chat message with its ``content`` as a string: a string, or a list of text parts
    (``{"type": "text", "text": ...}``) joined with newlines; BadRequest otherwise."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise BadRequest(f"messages[{index}] must be an object with a string role", "messages")
    content = message.get("content")
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
    prompts as token ids, all checked against the engine's limits (BadRequest or ValueError
    naming what is wrong; nothing is queued)."""
    limit, vocab = engine.max_tokens_limit, vocab_size(engine)
    params = parse_params(body, limit, limit if chat else 16, vocab)  # chat: the limit
    refuse_logprobs(body)
    usage = stream_usage(body)
    prompts = request_prompts(engine, body, chat, vocab)
    most = getattr(engine, "max_queue", None)
    if most is not None and len(prompts) > most:
        raise BadRequest(
            f"at most {most} prompts per request (neuron-tp serve --max-queue), got {len(prompts)}",
            "prompt",
        )
    for p in prompts:
        engine.check(p, params.max_tokens, params.stop, params.sampling)
    return CompletionRequest(params, usage, prompts)


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


def request_prompts(engine: Engine, body: dict, chat: bool, vocab: int | None) -> list[list[int]]:
    """The prompts of a request as token ids: a chat's messages through the chat template;
    a completion's ``prompt`` as a string, a list of strings, a list of token ids or a list
    of such lists (ids checked by :func:`token_ids`)."""
    tok = engine.tokenizer
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
        messages = [message_text(i, m) for i, m in enumerate(messages)]
        return [encode_prompt(tok, chat_prompt(tok, messages), chat=True)]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return [token_ids(prompt, vocab, "prompt")]  # one prompt of token ids
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if isinstance(prompts, list) and prompts and all(isinstance(p, list) for p in prompts):
        return [token_ids(p, vocab, f"prompt[{i}]") for i, p in enumerate(prompts)]
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(
            "prompt must be a string, a non-empty list of strings, a list of token ids "
            "or a list of lists of token ids",
            "prompt",
        )
    return [encode_prompt(tok, p, chat=False) for p in prompts]


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
