"""An OpenAI-compatible HTTP API over an :class:`~.engine.Engine` (FastAPI; imported lazily).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``:
server-sent events in OpenAI's chunk format, then ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` (the process is up) and ``GET /ready`` (200 once the model is loaded and its
warm-up graphs are captured, else 503).

Parameters: ``max_tokens``, ``temperature`` (0: greedy), ``top_k`` (an extension; 0: off),
``seed`` (a seeded request reproduces its text), ``stop`` (a string or a list), ``n`` (1
only), ``stream_options.include_usage`` (a last chunk with the usage). ``model``: the served
name (what ``/v1/models`` lists; absent: that one), any other gets 404 ``model_not_found``.
``logprobs`` / ``top_logprobs`` are refused (400): see :func:`refuse_logprobs`. Chat messages
go through the tokenizer's chat template; a message's ``content`` is a string or a list of
text parts (``[{"type": "text", "text": ...}]``, joined with newlines; other part types get
a 400 naming them); a tokenizer without a template (e.g. the byte-level fallback) uses
``"{role}: {content}\\n"`` per message then ``"assistant: "``. Invalid requests get 400 with
``{"error": {"message", "type": "invalid_request_error", ...}}``.
"""

import asyncio
import json
import threading
import time
import uuid
from typing import Any

from ..errors import UserError
from .engine import Engine, NotReady
from .generate import Sampling

MAX_STOP = 4  # stop strings per request, as OpenAI allows


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


def _encode(tokenizer, text: str, chat: bool) -> list[int]:
    if chat and hasattr(tokenizer, "apply_chat_template"):  # the template has the specials
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def _number(body: dict, name: str, kind: type, default: Any, low: float | None = None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}", name)
    if kind is int and value != int(value):
        raise BadRequest(f"{name} must be an integer, got {value!r}", name)
    if low is not None and value < low:
        raise BadRequest(f"{name} must be >= {low:g}, got {value!r}", name)
    return kind(value)


def parse_params(body: dict, limit: int, default_max: int = 16) -> dict:
    """Generation parameters of a request body (BadRequest naming the wrong one);
    ``max_tokens`` defaults to ``default_max`` (at most the server's ``limit``)."""
    n = _number(body, "n", int, 1)
    if n != 1:
        raise BadRequest(f"n must be 1 (one choice per prompt), got {n}", "n")
    max_tokens = _number(body, "max_tokens", int, None)
    if max_tokens is None:
        max_tokens = _number(body, "max_completion_tokens", int, min(default_max, limit))
    if not 1 <= max_tokens <= limit:
        raise BadRequest(f"max_tokens must be in 1..{limit} (server limit), got {max_tokens}")
    temperature = _number(body, "temperature", float, 1.0, low=0)
    top_k = _number(body, "top_k", int, 0, low=0)
    seed = _number(body, "seed", int, None)
    if body.get("top_p") not in (None, 1, 1.0):
        raise BadRequest("top_p is not supported (use top_k)", "top_p")
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
    return {
        "max_tokens": max_tokens,
        "sampling": sampling,
        "stop": stop,
        "seeded": seed is not None,
    }


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


def _error(status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def create_app(engine: Engine, model_name: str):
    """The FastAPI application serving ``engine`` as model ``model_name``."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="neuron-tp serve")

    @app.get("/health")
    async def health():
        if engine.error:  # generation failed: the ranks may be out of step, restart
            return JSONResponse({"status": "failed", "error": engine.error}, status_code=503)
        return {"status": "ok"}

    @app.get("/ready")
    async def ready():
        if engine.ready:
            return {"status": "ready"}
        status = "failed" if engine.error else "loading"
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "neuron-tp"}
        return {"object": "list", "data": [card]}

    async def handle(request: Request, chat: bool):
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        if body.get("model") not in (None, model_name):
            message = (
                f"The model {body['model']!r} does not exist: this server serves "
                f"{model_name!r} (GET /v1/models)"
            )
            return _error(404, message, param="model", code="model_not_found")
        if not engine.ready:
            why = engine.error or "the model is not ready yet"
            return _error(503, why, "service_unavailable")
        try:
            limit = engine.max_tokens_limit  # chat: as long as the server allows
            params = parse_params(body, limit, limit if chat else 16)
            refuse_logprobs(body)
            prompts = _prompts(engine, body, chat)
            for p in prompts:
                engine.check(p, params["max_tokens"], params["stop"], params["sampling"])
        except BadRequest as e:
            return _error(400, str(e), param=e.param)
        except ValueError as e:
            return _error(400, str(e))
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def sink(index: int):
            return lambda ev: loop.call_soon_threadsafe(events.put_nowait, (index, ev))

        try:
            args = (params["max_tokens"], params["sampling"], params["stop"])
            reqs = [
                engine.submit(p, *args, sink(i), params["seeded"]) for i, p in enumerate(prompts)
            ]
        except NotReady as e:
            return _error(503, str(e), "service_unavailable")
        meta = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "created": int(time.time()),
            "model": model_name,
        }
        if body.get("stream"):
            options = body.get("stream_options") or {}
            usage = isinstance(options, dict) and bool(options.get("include_usage"))
            chunks = _stream(events, reqs, meta, chat, usage)
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            return await _collect(events, reqs, meta, chat)
        finally:
            for r in reqs:
                r.cancel()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def _prompts(engine: Engine, body: dict, chat: bool) -> list[list[int]]:
    tok = engine.tokenizer
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content}", "messages")
        messages = [message_text(i, m) for i, m in enumerate(messages)]
        return [_encode(tok, chat_prompt(tok, messages), chat=True)]
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise BadRequest("prompt must be a string or a non-empty list of strings", "prompt")
    return [_encode(tok, p, chat=False) for p in prompts]


def _choice(chat: bool, index: int, text: str | None, reason: str | None, stream: bool) -> dict:
    if not chat:
        return {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
    if stream:
        delta = {"content": text} if text is not None else {}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}


async def _collect(events: asyncio.Queue, reqs, meta: dict, chat: bool):
    from fastapi.responses import JSONResponse

    texts, done = [""] * len(reqs), [None] * len(reqs)
    while any(d is None for d in done):
        i, ev = await events.get()
        if ev["type"] == "delta":
            texts[i] += ev["text"]
        elif ev["type"] == "error":
            return _error(500, ev["message"], "server_error")
        else:
            done[i] = ev
    choices = [
        _choice(chat, i, t, d["finish_reason"], False) for i, (t, d) in enumerate(zip(texts, done))
    ]
    kind = "chat.completion" if chat else "text_completion"
    return JSONResponse({**meta, "object": kind, "choices": choices, "usage": _usage(done)})


def _usage(done: list[dict]) -> dict:
    prompt = sum(d["prompt_tokens"] for d in done)
    completion = sum(d["completion_tokens"] for d in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def _stream(events: asyncio.Queue, reqs, meta: dict, chat: bool, usage: bool):
    """SSE chunks until every choice is done (then one with the usage and no choices when
    ``stream_options.include_usage``); a client that leaves cancels its requests."""
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(*choices: dict, **extra) -> str:
        body = {**meta, "object": kind, "choices": list(choices), **extra}
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:
            for i in range(len(reqs)):
                first = {"index": i, "delta": {"role": "assistant", "content": ""}}
                yield chunk({**first, "logprobs": None, "finish_reason": None})
        left, done = len(reqs), []
        while left:
            i, ev = await events.get()
            if ev["type"] == "delta":
                yield chunk(_choice(chat, i, ev["text"], None, True))
            elif ev["type"] == "error":
                err = {"message": ev["message"], "type": "server_error"}
                yield f"data: {json.dumps({'error': err})}\n\n"
                break
            else:
                left -= 1
                done.append(ev)
                yield chunk(_choice(chat, i, None, ev["finish_reason"], True))
        if usage and not left:
            yield chunk(usage=_usage(done))
        yield "data: [DONE]\n\n"
    finally:
        for r in reqs:
            r.cancel()


def serve(config, stop: threading.Event | None = None) -> None:
    """``neuron-tp serve`` on this rank: load the model, warm up, then rank 0 answers HTTP
    (``/health`` from the start, ``/ready`` once warm) while the other tp ranks follow its
    batches. SIGTERM/SIGINT (on the main thread; or ``stop`` set by the caller): rank 0 stops
    accepting, finishes what runs, tells the other ranks to stop; every rank returns."""
    from ..job.config import ServeConfig
    from ..job.runtime import refuse_xla_ranks_off_neuron
    from ..parallel import agreement
    from ..parallel.mesh import init_mesh

    config = ServeConfig.from_args(config)
    refuse_xla_ranks_off_neuron(config.device)
    world = agreement.world_group()
    error, values = None, {}
    try:  # local checks; a failure here is shared with every rank by check_agreement
        if world.size != config.tp:
            raise UserError(
                f"neuron-tp serve runs one server over its tp ranks: launch exactly --tp "
                f"{config.tp} processes, got {world.size}"
            )
        if world.rank == 0:
            import fastapi  # noqa: F401 - fail before loading a model
            import uvicorn  # noqa: F401
        values = {**config.option_values(), "library versions": agreement.versions()}
    except Exception as e:  # noqa: BLE001 - re-raised on this rank by check_agreement
        error = e
    agreement.check_agreement(values, world, error=error, what="neuron-tp serve")
    mesh = init_mesh(tp=config.tp)
    engine = Engine(mesh.group("world"))
    stop = stop or stop_on_signals()
    if mesh.rank != 0:
        _load(engine, config, mesh)
        engine.follow(should_stop=stop.is_set)
        return
    import uvicorn

    app = create_app(engine, config.model_name)
    server = uvicorn.Server(
        uvicorn.Config(
            app, config.host, config.port, log_level="warning", timeout_graceful_shutdown=10
        )
    )
    # HTTP on a thread from the start (/health answers while the model loads); the model
    # loads on the main thread, like the other ranks (host exchanges count calls per thread).
    http = threading.Thread(target=server.run, name="http", daemon=True)
    http.start()
    while not server.started and http.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise RuntimeError(f"neuron-tp serve: cannot listen on {config.host}:{config.port}")
    try:
        _load(engine, config, mesh)
        engine.start()
        print(f"neuron-tp serve: ready on http://{config.host}:{config.port}", flush=True)
        while not stop.wait(0.1) and http.is_alive() and engine.error is None:
            pass
    finally:
        server.should_exit = True
        http.join()
        engine.shutdown()
    if engine.error is not None:
        raise RuntimeError(f"neuron-tp serve: {engine.error}")


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (handlers installed when called on the main
    thread)."""
    import signal

    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda _s, _f: stop.set())
    return stop


def _load(engine: Engine, config, mesh) -> None:
    """Load the model onto this rank's device, attach it to ``engine`` and warm up."""
    from ..job.runtime import rank_device
    from ..parallel.sharding import move_to
    from .batch import eos_ids
    from .load import load_for_generation
    from .slots import SlotGenerator

    model, tok = load_for_generation(config.generate_config(), mesh)
    move_to(model, rank_device(config.device))
    pad = getattr(tok, "pad_token_id", None) or 0
    chunk = min(config.prefill_chunk, max(config.buckets))
    gen = SlotGenerator(
        model,
        slots=max(config.batch_buckets),
        max_len=max(config.buckets) + config.max_new_tokens,
        chunk=chunk,
        prefill_buckets=sorted({b for b in config.buckets if b < chunk} | {chunk}),
        decode_buckets=config.batch_buckets,
        pad_id=pad,
    )
    engine.attach(gen, tok, eos_ids(model, tok), config.max_new_tokens)
    engine.warmup(every_shape=config.warmup == "all")
