"""What a completion or chat request asks for, checked before anything is queued: its
generation parameters (every numeric field range-checked), its prompts as token ids (text,
token ids checked against the vocabulary, or chat messages through the chat template) and
the engine's limits. Mistakes raise :class:`BadRequest` (HTTP 400) naming the field; so does
any field this server does not implement (:func:`check_fields`): nothing is silently ignored.

The generation parameters and their checks: :mod:`.request_params`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .engine import Engine
from .lora_slots import AdapterRef
from .request_params import (
    COMPLETION_DEFAULT_MAX,
    BadRequest,
    CompletionParams,
    is_token_id,
    parse_params,
)
from .sampling import Sampling


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
    if message.get("tool_calls"):
        return {**message, "content": content, "tool_calls": _calls(index, message["tool_calls"])}
    return {**message, "content": content}


def _calls(index: int, calls: Any) -> list[dict]:
    """An assistant message's ``tool_calls`` with each ``function.arguments`` as the object
    its JSON text holds: chat templates render the arguments (``| tojson``) as an object, as
    the model wrote them; the string OpenAI clients send back would be rendered quoted."""
    where = f"messages[{index}].tool_calls"
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be a list of {{id, type, function}}", "messages")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(
                f'{where}[{j}] must be {{"type": "function", "function": {{"name", "arguments"}}}}',
                "messages",
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(args, dict):
            raise BadRequest(
                f"{where}[{j}].function.arguments must be a JSON object (as text, as the "
                f"server sent it), got {fn.get('arguments')!r}",
                "messages",
            )
        out.append({**c, "function": {**fn, "arguments": args}})
    return out


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
    if isinstance(prompt, list) and prompt and all(is_token_id(t) for t in prompt):
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


def token_ids(ids: list, vocab: int | None, where: str) -> list[int]:
    """A prompt given as token ids: BadRequest naming the first that is not an id of the
    model's vocabulary (``0..vocab-1``; any int >= 0 when ``vocab`` is None)."""
    if not ids:
        raise BadRequest(f"{where} has no token ids: a prompt needs at least one", "prompt")
    for j, t in enumerate(ids):
        if not is_token_id(t) or t < 0 or (vocab is not None and t >= vocab):
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
