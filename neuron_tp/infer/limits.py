"""What a request to ``neuron-tp serve`` may be, checked before anything else reads it: its
API key (an ASGI middleware: ``Authorization: Bearer KEY`` on every path but ``/health``,
``/ready`` and ``/metrics``, compared in constant time), its body size (413 past
``max_body_bytes``, from ``Content-Length`` before reading, else counted while reading) and
its JSON shape (400 past ``max_json_depth`` nesting or ``MAX_JSON_CONTAINERS`` arrays and
objects, measured before the parser runs)."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_MAX_BODY = 4 * 1024 * 1024  # bytes: far above any prompt a bucket holds
MAX_JSON_DEPTH = 64  # arrays/objects inside each other; an OpenAI request needs < 10
MAX_JSON_CONTAINERS = 65536  # arrays/objects in a request (a prompt of token ids is one)
OPEN_PATHS = ("/health", "/ready", "/metrics")  # probes and scrapes need no key (as vLLM)
API_KEY_ENV = "NEURON_TP_API_KEY"
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))


@dataclass(frozen=True)
class ServeLimits:
    """The server's limits on one request (see ``neuron-tp serve --help``)."""

    api_key: str | None = None  # None: no key asked
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_json_depth: int = MAX_JSON_DEPTH
    request_timeout_s: float = 600.0  # admission to the last token


class RequestError(ValueError):
    """A request refused before generation: HTTP ``status`` with an OpenAI-style error."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


async def read_body(request, limit: int) -> bytes:
    """The request's body; :class:`RequestError` 413 when it is longer than ``limit`` bytes
    (a ``Content-Length`` above it is refused before reading; a chunked body is read only
    up to it)."""
    too_large = RequestError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes "
        "(neuron-tp serve --max-body-bytes)",
        code="request_too_large",
    )
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(400, f"Content-Length must be a number of bytes, got {declared!r}")
        if int(declared) > limit:
            raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def json_shape(text: str) -> tuple[int, int]:
    """(how deeply arrays and objects nest, how many there are) in the JSON ``text``; the
    brackets inside string literals do not count. Exact for valid JSON (for invalid JSON,
    which the parser refuses anyway, only an estimate); linear, in C, no recursion."""
    unescaped = text.replace("\\\\", "").replace('\\"', "")  # no quote left inside a string
    outside = "".join(unescaped.split('"')[0::2])  # what lies between the string literals
    brackets = outside.encode().translate(None, _NOT_BRACKET)
    if not brackets:
        return 0, 0
    steps = np.frombuffer(brackets, dtype=np.uint8)
    opens = (steps == ord("[")) | (steps == ord("{"))
    depth = int(np.cumsum(np.where(opens, 1, -1), dtype=np.int64).max())
    return depth, int(opens.sum())


def parse_json(body: bytes, max_depth: int, max_containers: int = MAX_JSON_CONTAINERS) -> Any:
    """The JSON value of a request body (UTF-8); :class:`RequestError` 400 when it is not
    valid JSON, nests deeper than ``max_depth`` or holds more than ``max_containers`` arrays
    and objects (measured before parsing: the parser would recurse, and allocating a million
    containers holds the interpreter for seconds)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(400, "the request body is not valid JSON (UTF-8)") from None
    nested = f"JSON arrays/objects may nest at most {max_depth} deep in a request"
    depth, containers = json_shape(text)
    if depth > max_depth:
        raise RequestError(400, f"the request body nests {depth} deep: {nested}")
    if containers > max_containers:
        raise RequestError(
            400,
            f"the request body has {containers} JSON arrays/objects; at most {max_containers} "
            "are allowed in a request",
        )
    try:
        return json.loads(text)
    except RecursionError:  # not reached when the shape is right; never a crash
        raise RequestError(400, f"the request body nests too deep: {nested}") from None
    except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
        raise RequestError(400, f"the request body is not valid JSON: {e}") from None


def key_matches(authorization: bytes | None, key: str) -> bool:
    """Whether an ``Authorization`` header value is ``Bearer <key>`` (constant time: digests
    are compared, so neither the key's content nor its length leaks through timing)."""
    scheme, _, token = (authorization or b"").partition(b" ")
    given = hashlib.sha256(token.strip()).digest()
    expected = hashlib.sha256(key.encode()).digest()
    return hmac.compare_digest(given, expected) and scheme.lower() == b"bearer"


class Guard:
    """ASGI middleware: the API key on every path but :data:`OPEN_PATHS` (401 in the OpenAI
    error shape otherwise), and ``on_response(endpoint, status)`` once per HTTP response
    (``endpoint``: the path if ``routes`` has it, else ``"other"``; status 500 when the app
    raised before answering)."""

    def __init__(
        self,
        app,
        api_key: str | None,
        routes: Callable[[], set[str]],
        on_response: Callable[[str, int], None],
    ):
        self.app, self.api_key, self.routes, self.on_response = app, api_key, routes, on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        status = 500

        async def counted(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if self.api_key is not None and path not in OPEN_PATHS:
                header = dict(scope.get("headers") or ()).get(b"authorization")
                if not key_matches(header, self.api_key):
                    return await _unauthorized(header is None)(scope, receive, counted)
            await self.app(scope, receive, counted)
        finally:
            self.on_response(path if path in self.routes() else "other", status)


def _unauthorized(missing: bool):
    from fastapi.responses import JSONResponse

    what = "no API key given" if missing else "incorrect API key"
    message = f"{what}: send the header 'Authorization: Bearer <key>' with this server's key"
    error = {"message": message, "type": "invalid_request_error", "param": None}
    return JSONResponse(
        {"error": {**error, "code": "invalid_api_key"}},
        status_code=401,
        headers={"WWW-Authenticate": "Bearer"},
    )
