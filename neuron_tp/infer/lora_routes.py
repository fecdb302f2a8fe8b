"""The LoRA routes of the HTTP API (vLLM's): ``GET /v1/models`` lists the adapters beside the
base model (``parent``: the base), ``POST /v1/load_lora_adapter`` ``{"lora_name",
"lora_path"}`` and ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` change them at run time
(the API key guards them like every route), and :func:`requested_adapter` resolves a
request's ``model``: the served name is the base model, an adapter's name that adapter."""

import asyncio

from ..errors import UserError
from .engine import Engine
from .limits import RequestError, parse_json, read_body
from .lora_slots import AdapterRef


class UnknownModel(LookupError):
    """A request names a model this server does not serve (HTTP 404 ``model_not_found``)."""


def requested_adapter(engine: Engine, model_name: str, name) -> AdapterRef | None:
    """The adapter a request's ``model`` names (None: the base model); UnknownModel when it
    names neither."""
    if name is None or name == model_name:
        return None
    ref = engine.adapters.get(name) if engine.adapters is not None else None
    if ref is None:
        served = (
            [model_name, *(r.name for r in engine.adapters.all())]
            if engine.adapters
            else [model_name]
        )
        raise UnknownModel(
            f"The model {name!r} does not exist: this server serves {served} (GET /v1/models)"
        )
    return ref


def model_cards(engine: Engine, model_name: str) -> list[dict]:
    """``/v1/models``' data: the base model, then each adapter with its parent."""
    cards = [{"id": model_name, "object": "model", "created": 0, "owned_by": "neuron-tp"}]
    for ref in engine.adapters.all() if engine.adapters is not None else []:
        cards.append(
            {
                "id": ref.name,
                "object": "model",
                "created": 0,
                "owned_by": "neuron-tp",
                "root": ref.path,
                "parent": model_name,
            }
        )
    return cards


def add_lora_routes(app, engine: Engine, limits, error) -> None:
    """Add the load and unload routes to ``app`` (``error(status, message, kind, param=,
    code=)`` makes the error responses)."""
    from fastapi import Request
    from fastapi.responses import PlainTextResponse

    async def body_of(request: Request, fields: tuple[str, ...]):
        try:
            body = parse_json(
                await read_body(request, limits.max_body_bytes), limits.max_json_depth
            )
        except RequestError as e:
            return error(e.status, str(e), param=e.param, code=e.code)
        if not isinstance(body, dict):
            return error(400, "the request body must be a JSON object")
        for name in fields:
            if not isinstance(body.get(name), str) or not body[name]:
                return error(400, f"{name} (a non-empty string) is required", param=name)
        if engine.adapters is None:
            why = (
                "the model is not ready yet"
                if not engine.ready
                else ("this server serves no LoRA adapters: start it with --enable-lora")
            )
            return error(503 if not engine.ready else 400, why)
        return body

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await body_of(request, ("lora_name", "lora_path"))
        if not isinstance(body, dict):
            return body
        name, adapters = body["lora_name"], engine.adapters
        assert adapters is not None  # checked by body_of
        try:  # reads and checks the whole adapter: off the event loop
            await asyncio.to_thread(adapters.load, name, body["lora_path"])
        except UserError as e:
            return error(400, str(e), param="lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await body_of(request, ("lora_name",))
        if not isinstance(body, dict):
            return body
        name, adapters = body["lora_name"], engine.adapters
        assert adapters is not None  # checked by body_of
        try:
            adapters.unload(name)
        except KeyError:
            message = f"The LoRA adapter {name!r} is not loaded (GET /v1/models)"
            return error(404, message, "not_found_error", param="lora_name", code="model_not_found")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
