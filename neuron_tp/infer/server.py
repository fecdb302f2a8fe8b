"""An OpenAI-compatible HTTP API over an :class:`~.engine.Engine` (FastAPI; imported lazily).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream``:
server-sent events in OpenAI's chunk format, then ``data: [DONE]``), ``GET /v1/models``,
``GET /health`` (the process is up), ``GET /ready`` (200 once the model is loaded and its
warm-up graphs are captured, else 503) and ``GET /metrics`` (Prometheus, :mod:`.metrics`).

What a request may ask for and how it is checked is :mod:`.completion_request` (parameters,
prompts as text, token ids or chat messages); the API key, body size and JSON depth are
:mod:`.limits`. ``model``: the served name (what ``/v1/models`` lists; absent: that one) or a
LoRA adapter's name (:mod:`.lora_routes`); any other gets 404 ``model_not_found``. Invalid
requests get 400 with ``{"error": {"message", "type": "invalid_request_error", "param",
...}}``; a full queue 429 with ``Retry-After``; a request past its timeout 504 (a stream: an
error event); an exception of the server's own a JSON 500 for that request only.
"""

import asyncio
import dataclasses
import json
import time
import uuid

from .completion_request import BadRequest, CompletionRequest, prepare
from .engine import Engine, NotReady, QueueFull
from .limits import Guard, RequestError, ServeLimits, parse_json, read_body
from .lora_routes import UnknownModel, add_lora_routes, model_cards, requested_adapter
from .metrics import LOG, RequestTrace, ServerMetrics
from .responses import Answer, best_choices, usage_of
from .sampling import MAX_SEED
from .schedule import Delta, Done, Failed, Prompt

PARSE_INLINE = 64 * 1024  # bytes: larger bodies are parsed on a worker thread
RETRY_AFTER_S = 1  # the Retry-After of a 429 (queue full)


def _error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    *,
    param=None,
    code=None,
    headers: dict | None = None,
):
    from fastapi.responses import JSONResponse

    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def create_app(engine: Engine, model_name: str, limits: ServeLimits | None = None):
    """The FastAPI application serving ``engine`` as model ``model_name`` within ``limits``
    (API key, body size, JSON depth, request timeout; default: :class:`ServeLimits`), with
    its own Prometheus registry (``GET /metrics``)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response

    limits = limits or ServeLimits()
    metrics = ServerMetrics(
        engine.queue_depth,
        engine.slots_in_use,
        prefix=engine.prefix_stats,
        speculation=engine.speculation,
    )
    app = FastAPI(title="neuron-tp serve")
    paths: set[str] = set()

    def routes() -> set[str]:
        if not paths:
            paths.update(getattr(r, "path", "") for r in app.routes)
        return paths

    def count(endpoint: str, status: int) -> None:
        metrics.requests.labels(endpoint, str(status)).inc()

    app.add_middleware(Guard, api_key=limits.api_key, routes=routes, on_response=count)

    @app.exception_handler(Exception)
    async def crashed(request: Request, exc: Exception):  # a bug outside the handlers
        return _error(500, f"internal server error ({type(exc).__name__})", "server_error")

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

    @app.get("/metrics")
    async def scrape(request: Request):
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": model_cards(engine, model_name)}

    add_lora_routes(app, engine, limits, _error)

    answers = _Completions(engine, model_name, limits, metrics)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answers.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await answers.handle(request, chat=True)

    return app


class _Completions:
    """``POST /v1/completions`` and ``/v1/chat/completions``: read and check a request, queue
    its prompts on ``engine``, answer (JSON, or a stream of server-sent events)."""

    def __init__(self, engine: Engine, model_name: str, limits: ServeLimits, metrics):
        self.engine, self.model_name = engine, model_name
        self.limits, self.metrics = limits, metrics

    async def handle(self, request, chat: bool):
        from fastapi.responses import StreamingResponse

        prefix = "chatcmpl-" if chat else "cmpl-"
        trace = RequestTrace(self.metrics, prefix + uuid.uuid4().hex)
        try:
            response = await self._answer(request, chat, trace)
        except Exception as e:  # noqa: BLE001 - a bug: this request fails, the server goes on
            LOG.exception("request %s failed", trace.id)
            message = f"internal server error ({type(e).__name__}: {str(e)[:200]})"
            response = _error(500, message, "server_error")
        if not isinstance(response, StreamingResponse):  # a stream finishes its trace itself
            status = response.status_code
            trace.finish(status, "timeout" if status == 504 else "error" if status >= 500 else None)
        return response

    async def _answer(self, request, chat: bool, trace: RequestTrace):
        from fastapi.responses import StreamingResponse

        checked = await self._checked(request, chat)
        if not isinstance(checked, tuple):
            return checked  # an error response
        body, completion = checked
        trace.choices = len(completion.prompts) * completion.params.candidates
        loop, events = asyncio.get_running_loop(), asyncio.Queue()

        def sink(index: int):
            return lambda ev: loop.call_soon_threadsafe(events.put_nowait, (index, ev))

        reqs = self._submit(completion, sink)
        if not isinstance(reqs, list):
            return reqs  # an error response
        served = completion.adapter.name if completion.adapter is not None else self.model_name
        meta = {"id": trace.id, "created": int(time.time()), "model": served}
        timeout = self.limits.request_timeout_s
        wait = Deadline(trace.start + timeout, timeout)
        parser = getattr(self.engine, "tool_call_parser", "hermes")
        shape = Answer(self.engine.tokenizer, completion, chat, parser)
        if body.get("stream"):
            usage = completion.include_usage
            chunks = _stream(
                events, reqs, meta=meta, shape=shape, usage=usage, trace=trace, wait=wait
            )
            return StreamingResponse(chunks, media_type="text/event-stream")
        try:
            return await _collect(events, reqs, meta=meta, shape=shape, trace=trace, wait=wait)
        finally:
            for r in reqs:
                r.cancel()

    async def _checked(self, request, chat: bool):
        """``(body, CompletionRequest)`` of a request, or the error response refusing it."""
        engine, limits, model_name = self.engine, self.limits, self.model_name
        try:
            raw = await read_body(request, limits.max_body_bytes)
            if len(raw) > PARSE_INLINE:  # off the event loop: other requests go on
                body = await asyncio.to_thread(parse_json, raw, limits.max_json_depth)
            else:
                body = parse_json(raw, limits.max_json_depth)
        except RequestError as e:
            return _error(e.status, str(e), param=e.param, code=e.code)
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            adapter = requested_adapter(engine, model_name, body.get("model"))
        except UnknownModel as e:
            return _error(404, str(e), param="model", code="model_not_found")
        if not engine.ready:
            why = engine.error or "the model is not ready yet"
            return _error(503, why, "service_unavailable")
        try:
            if len(raw) > PARSE_INLINE:  # a long prompt is tokenized off the event loop
                completion = await asyncio.to_thread(prepare, engine, body, chat)
            else:
                completion = prepare(engine, body, chat)
        except BadRequest as e:
            return _error(400, str(e), param=e.param)
        except ValueError as e:
            return _error(400, str(e))
        return body, dataclasses.replace(completion, adapter=adapter)

    def _submit(self, completion: CompletionRequest, sink):
        """Queue ``max(n, best_of)`` sequences of each prompt (``sink(i)`` gets sequence
        ``i``'s events, ``i * count + j`` is prompt ``i``'s ``j``-th; with a seed, ``j`` draws
        with ``seed + j``; they share the prompt's prefill): the engine's requests, or (none
        queued) the 503 / 429 response."""
        params, reqs = completion.params, []
        try:
            for i, p in enumerate(completion.prompts):
                output = dataclasses.replace(params.output(), siblings=uuid.uuid4().hex)
                for j in range(params.candidates):
                    seed = (params.sampling.seed + j) % (MAX_SEED + 1)
                    sampling = dataclasses.replace(params.sampling, seed=seed)
                    args = (p, completion.max_tokens[i], sampling, params.stop)
                    sunk = sink(len(reqs))
                    reqs.append(
                        self.engine.submit(
                            *args,
                            sink=sunk,
                            seeded=params.seeded,
                            output=output,
                            adapter=completion.adapter,
                        )
                    )
        except (NotReady, QueueFull) as e:
            for r in reqs:
                r.cancel()
            if isinstance(e, NotReady):
                return _error(503, str(e), "service_unavailable")
            message = f"the server is busy: {e} (neuron-tp serve --max-queue); retry later"
            headers = {"Retry-After": str(RETRY_AFTER_S)}
            return _error(429, message, "rate_limit_error", code="queue_full", headers=headers)
        return reqs


class Deadline:
    """When a request must have finished (``time.monotonic()``), and its timeout."""

    def __init__(self, at: float, timeout_s: float):
        self.at, self.timeout_s = at, timeout_s

    async def next(self, events: asyncio.Queue):
        """The next event; asyncio.TimeoutError once the deadline has passed."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise asyncio.TimeoutError
        return await asyncio.wait_for(events.get(), left)

    @property
    def message(self) -> str:
        return (
            f"the request did not finish within {self.timeout_s:g} s "
            "(neuron-tp serve --request-timeout-s); it was cancelled"
        )


async def _collect(
    events: asyncio.Queue, reqs, *, meta: dict, shape: Answer, trace, wait: Deadline
):
    from fastapi.responses import JSONResponse

    echo = shape.params.echo
    texts = list(shape.texts) if echo else [""] * len(reqs)
    lps: list[list] = [[] for _ in reqs]
    scores = [0.0] * len(reqs)  # the cumulative log-probability of each sequence's tokens
    done: list[Done | None] = [None] * len(reqs)
    if echo and not shape.params.output().prompt_logprobs:
        lps = [shape.echo_entries(i) for i in range(len(reqs))]
    while any(d is None for d in done):
        try:
            i, ev = await wait.next(events)
        except asyncio.TimeoutError:
            return _error(504, wait.message, "timeout_error", code="request_timeout")
        trace.event(i, ev)
        if isinstance(ev, Prompt):
            lps[i] = shape.echo_entries(i, ev.logprobs) + lps[i]
        elif isinstance(ev, Delta):
            texts[i] += ev.text
            lps[i] += shape.entries(ev.logprobs)
            scores[i] += sum(e.logprob for e in ev.logprobs)
        elif isinstance(ev, Failed):
            return _error(500, ev.message, "server_error")
        else:
            done[i] = ev
    finished = [d for d in done if d is not None]
    choices = [
        shape.choice(i, texts[i], finished[i].finish_reason, False, lps[i], index=k)
        for k, i in enumerate(best_choices(scores, shape.params.candidates, shape.params.n))
    ]
    kind = "chat.completion" if shape.chat else "text_completion"
    return JSONResponse({**meta, "object": kind, "choices": choices, "usage": usage_of(finished)})


async def _stream(
    events: asyncio.Queue, reqs, *, meta: dict, shape: Answer, usage: bool, trace, wait: Deadline
):
    """SSE chunks until every choice is done (then one with the usage and no choices when
    ``stream_options.include_usage``); a client that leaves cancels its requests; past the
    deadline, or on a failure, an error event ends the stream. With ``echo`` each choice's
    first chunk is its prompt (with its log-probabilities once they are computed)."""
    chat = shape.chat
    kind = "chat.completion.chunk" if chat else "text_completion"
    note = "disconnected"  # why the stream ended before its choices did
    prompt_lps = shape.params.output().prompt_logprobs

    def chunk(*choices: dict, **extra) -> str:
        body = {**meta, "object": kind, "choices": list(choices), **extra}
        return f"data: {json.dumps(body)}\n\n"

    def failure(message: str, kind: str, code: str | None = None) -> str:
        err = {"message": message, "type": kind, "param": None, "code": code}
        return f"data: {json.dumps({'error': err})}\n\n"

    try:
        if chat:
            for i in range(len(reqs)):
                first = {"index": i, "delta": {"role": shape.role, "content": shape.leads[i]}}
                yield chunk({**first, "logprobs": None, "finish_reason": None})
        if shape.params.echo and not prompt_lps:
            for i in range(len(reqs)):
                yield chunk(shape.choice(i, shape.texts[i], None, True, shape.echo_entries(i)))
        left, done = len(reqs), []
        while left:
            try:
                i, ev = await wait.next(events)
            except asyncio.TimeoutError:
                note = "timeout"
                yield failure(wait.message, "timeout_error", "request_timeout")
                break
            trace.event(i, ev)
            if isinstance(ev, Prompt):
                entries = shape.echo_entries(i, ev.logprobs)
                yield chunk(shape.choice(i, shape.texts[i], None, True, entries))
            elif isinstance(ev, Delta):
                entries = shape.entries(ev.logprobs)
                yield chunk(shape.choice(i, ev.text, None, True, entries))
            elif isinstance(ev, Failed):
                note = "error"
                yield failure(ev.message, "server_error")
                break
            else:
                left -= 1
                done.append(ev)
                yield chunk(shape.choice(i, None, ev.finish_reason, True))
        if usage and not left:
            yield chunk(usage=usage_of(done))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001 - a bug: this stream ends in an error, others go on
        note = "error"
        LOG.exception("request %s failed", trace.id)
        yield failure(f"internal server error ({type(e).__name__})", "server_error")
    finally:
        for r in reqs:
            r.cancel()
        trace.finish(200, note)
