"""The HTTP server of `specrun serve` (FastAPI), in the role of llama-server.

    POST /v1/completions         OpenAI text completion (stream: SSE ending with `data: [DONE]`)
    POST /v1/chat/completions    OpenAI chat completion, through the model's chat template
    POST /v1/messages            Anthropic's Messages API (stream: named SSE events), and
                                 /v1/messages/count_tokens
    POST /completion             llama-server's completion, with its `timings` (also /completions)
    POST /tokenize, /detokenize, /apply-template, /v1/chat/completions/input_tokens
    GET  /props, /slots          llama-server's settings and per-slot state
    GET  /v1/models[/{id}]       the one model served, and the spec types a request may name
    GET  /health, /v1/health     {"status": "ok", ...} (never needs the API key; HEAD too)
    GET  /metrics                Prometheus text: requests, tokens, drafts, acceptance by position
    GET  /openapi.json, /docs    the schema of all of the above
(and llama-server's aliases without /v1: /chat/completions, /models).

Every error is OpenAI's shape, {"error": {"message", "type", "code"}} (under /v1/messages
Anthropic's, {"type": "error", "error": {"type", "message"}}), with a 4xx status for
anything the request got wrong (malformed JSON and wrong types included: 400, not FastAPI's 422),
401 without the API key, 403 for a Host header that does not name loopback on a loopback server
without a key (DNS rebinding), 413 for a body above --max-body, 408 for one slower than --body-timeout,
503 with Retry-After when every slot is busy and the queue is full, 503 `loading` / `shutting_down`.
Speculative options travel per request in an extra body field:
`"speculative": {"type": "ngram-simple", "n_max": 8, "p_min": 0.0}`.
"""

from __future__ import annotations

import gc
import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from .errors import ApiError, ClientGone, validation_message
from .middleware import OPEN_PATHS, Guard
from .routes_anthropic import anthropic_router
from .routes_llama import llama_router
from .routes_openai import openai_router
from .routes_service import service_router
from .state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "create_app"]


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="specrun serve", version="0.1.0",
                  description="OpenAI-compatible and llama-server endpoints over specrun's lossless "
                              "speculative decoding. Speculative options per request: the `speculative` field.")
    app.add_middleware(Guard, state=state)
    _error_handlers(app)
    app.include_router(openai_router(state))
    app.include_router(anthropic_router(state))
    app.include_router(llama_router(state))
    app.include_router(service_router(state))
    app.openapi = lambda: _openapi(app, bool(state.config.api_key))
    # The loaded server's objects (modules, schemas, the vocabulary's caches) live as long as it does:
    # frozen, the cyclic collector skips them. A full collection then scans what requests made, not
    # the whole heap: it runs in whichever thread allocates and holds the GIL meanwhile, so a large
    # request's worker would otherwise stall the event loop for as long as a full heap scan takes.
    gc.collect()
    gc.freeze()
    return app


def _error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's shape (an exception the app lets out is Guard's: a JSON 500)."""

    def answer(request: Request, e: ApiError):
        return e.response(request.url.path)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, code = validation_message(exc)
        return answer(request, ApiError(400, message, code))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, RecursionError):   # FastAPI's "error parsing the body" from json.loads
            return answer(request, ApiError(400, "the request body is not valid JSON here: it nests deeper than the "
                                                 f"JSON parser allows (about {sys.getrecursionlimit()} levels); send "
                                                 "a flatter object", "invalid_json"))
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return answer(request, ApiError(exc.status_code, msg, str(exc.detail).lower().replace(" ", "_"), exc.headers))

    @app.exception_handler(ClientGone)
    async def _gone(request: Request, exc: ClientGone):
        return Response(status_code=499)   # nobody reads it (nginx's "client closed request")


def _openapi(app: FastAPI, keyed: bool) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path, ops in schema["paths"].items():
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)   # validation errors answer 400 here (documented)
                if keyed and path not in OPEN_PATHS:
                    op["security"] = [{"bearer": []}, {"apikey": []}]
        comps = schema.setdefault("components", {}).setdefault("schemas", {})
        comps.pop("HTTPValidationError", None)
        comps.pop("ValidationError", None)
        if keyed:
            schema["components"]["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apikey": {"type": "apiKey", "in": "header", "name": "X-Api-Key"}}
        app.openapi_schema = schema
    return app.openapi_schema
