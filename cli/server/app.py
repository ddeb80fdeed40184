"""The HTTP server of `specrun serve` (FastAPI), in the role of llama-server.

    POST /v1/completions         OpenAI text completion (stream: SSE ending with `data: [DONE]`)
    POST /v1/chat/completions    OpenAI chat completion, through the model's chat template
    POST /completion             llama-server's completion, with its `timings`
    GET  /v1/models              the one model served, and the spec types a request may name
    GET  /health                 {"status": "ok", ...} (never needs the API key)
    GET  /metrics                Prometheus text: requests, tokens, drafts, acceptance by position
    GET  /openapi.json, /docs    the schema of all of the above

Every error is OpenAI's shape, {"error": {"message", "type", "code"}}, with a 4xx status for
anything the request got wrong (malformed JSON and wrong types included: 400, not FastAPI's 422),
401 without the API key, 503 with Retry-After when every slot is busy and the queue is full.
Speculative options travel per request in an extra body field:
`"speculative": {"type": "ngram-simple", "n_max": 8, "p_min": 0.0}`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.params import SpecParams, parse_spec_types
from specrun.kernels.types import LLAMA_DEFAULT_SEED, SamplingParams

from ..runtime.chat import ChatFormat
from .metrics import Metrics
from .schemas import (
    ChatCompletion,
    ChatRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    Health,
    LlamaCompletion,
    LlamaCompletionRequest,
    ModelList,
    Speculative,
)
from .slots import Busy, Job, Outcome, Run, SlotPool

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    alias: str                      # the model's name in responses and /v1/models
    sampling: SamplingParams        # defaults for fields a request leaves out
    n_predict: int                  # default max tokens; when > 0 also the most a request gets
    spec: SpecParams                # the server's --spec-* options
    spec_types: tuple[str, ...]     # what a request may name in speculative.type ("none" included)
    max_queue: int
    api_key: str | None = None
    chat_format: ChatFormat | None = None     # the chat template bound to the model (chat requests)
    no_template_reason: str = ""


class ApiError(Exception):
    """An error answered as {"error": {"message", "type", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, code: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.headers = status, message, code, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class ServerState:
    """What the handlers share: the config, the slots, the metrics."""

    def __init__(self, config: ServerConfig, pool: SlotPool, metrics: Metrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        engine = pool.slots[0].engine
        self.model = engine.model
        self.n_ctx = engine.n_ctx
        self.created = int(time.time())
        pool.on_outcome = metrics.record

    # -- requests -> jobs ----------------------------------------------------------------------
    def sampling(self, req) -> SamplingParams:
        d = self.config.sampling
        seed = d.seed if req.seed is None else (LLAMA_DEFAULT_SEED if req.seed == -1 else req.seed)
        return SamplingParams(temp=d.temp if req.temperature is None else req.temperature,
                              top_k=d.top_k if req.top_k is None else req.top_k,
                              top_p=d.top_p if req.top_p is None else req.top_p,
                              min_p=d.min_p if req.min_p is None else req.min_p, seed=seed)

    def spec(self, sp: Speculative | None) -> SpecParams | None:
        if sp is None:
            return None
        spec = self.config.spec
        if sp.type is not None:
            try:
                types = parse_spec_types(sp.type)
            except SpecrunError as e:
                raise ApiError(400, f"speculative.type: {e}", "unknown_spec_type") from None
            missing = [t for t in types if t not in self.config.spec_types]
            if missing:
                raise ApiError(400, f"speculative.type: {', '.join(missing)} is not available on this server "
                               f"(available: {', '.join(self.config.spec_types)}); the server builds "
                               f"draft-simple only with -md DRAFT.gguf and draft-mtp only when started with "
                               f"--spec-type draft-mtp", "unavailable_spec_type")
            spec = replace(spec, types=types)
        return replace(spec, n_max=spec.n_max if sp.n_max is None else sp.n_max,
                       n_min=spec.n_min if sp.n_min is None else sp.n_min,
                       p_min=spec.p_min if sp.p_min is None else sp.p_min)

    def n_predict(self, requested: int | None) -> int:
        cap = self.config.n_predict
        if requested is None or requested < 0:
            return cap
        return min(requested, cap) if cap > 0 else requested

    def tokens(self, prompt: str | list, add_special: bool = True):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request (got {len(prompt)})", "invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            toks = self.model.tokenize(prompt, add_special=add_special)
        else:
            bad = [t for t in prompt if not 0 <= t < self.model.n_vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is out of the vocabulary (0..{self.model.n_vocab - 1})",
                               "invalid_value")
            toks = prompt
        if len(toks) == 0:
            raise ApiError(400, "prompt: the prompt is empty (0 tokens)", "invalid_value")
        if len(toks) >= self.n_ctx:
            raise ApiError(400, f"the prompt exceeds the context size ({len(toks)} tokens, ctx {self.n_ctx}); "
                           "shorten it or restart the server with a larger -c", "context_length_exceeded")
        return toks

    def job(self, endpoint: str, req, prompt, n_predict: int | None, stop,
            stop_tokens: frozenset[int] = frozenset()) -> Job:
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if len(stop) > 4:
            raise ApiError(400, f"stop: at most 4 stop strings (got {len(stop)})", "invalid_value")
        if any(not s for s in stop):
            raise ApiError(400, "stop: a stop string is empty", "invalid_value")
        return Job(endpoint, np.asarray(prompt, dtype=np.int32), self.n_predict(n_predict), self.sampling(req),
                   self.spec(req.speculative), stop, stop_tokens)

    def chat_prompt(self, req: ChatRequest):
        """The prompt tokens of a chat request: the conversation through the model's chat template
        (runtime.chat.ChatFormat, as the REPL renders it)."""
        fmt = self.config.chat_format
        if fmt is None:
            raise ApiError(400, f"this server has no chat template: {self.config.no_template_reason}; "
                           "use /v1/completions", "no_chat_template")
        messages = []
        for m in req.messages:
            content = m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content})
        try:
            text = fmt.render(messages)
        except SpecrunError as e:
            raise ApiError(400, f"messages: {e}", "invalid_value") from None
        return self.tokens(fmt.tokenize(text))

    async def start(self, job: Job) -> Run:
        try:
            return await self.pool.start(job)
        except Busy as e:
            raise ApiError(503, str(e), "server_busy", headers={"Retry-After": "1"}) from None

    # -- output shapes --------------------------------------------------------------------------
    @staticmethod
    def timings(o: Outcome) -> dict:
        st = o.stats
        pm, gm = st.t_prompt_s * 1e3, st.t_gen_s * 1e3
        return {"prompt_n": st.n_prompt, "prompt_ms": pm,
                "prompt_per_token_ms": pm / st.n_prompt if st.n_prompt else 0.0,
                "prompt_per_second": st.prompt_tps, "predicted_n": st.n_gen, "predicted_ms": gm,
                "predicted_per_token_ms": gm / st.n_gen if st.n_gen else 0.0,
                "predicted_per_second": st.gen_tps, "draft_n": st.n_drafted, "draft_n_accepted": st.n_accepted,
                "drafts": sum(d.n_gen_drafts for d in st.drafters)}

    @staticmethod
    def usage(job: Job, o: Outcome) -> dict:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": len(o.tokens),
                "total_tokens": len(job.prompt) + len(o.tokens)}


# ---- streaming ----------------------------------------------------------------------------------


def sse(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


class SSEResponse(StreamingResponse):
    """Server-sent events that stop the generation as soon as the client goes away: it listens
    for the disconnect while streaming, and always closes the body (whose finally cancels the run)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def listen() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(listen)
                try:
                    await self.stream_response(send)
                except OSError:  # the client is gone
                    pass
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


def stream(run: Run, state: ServerState, first: list, piece: Callable[[str], dict],
           last: Callable[[Outcome], list], done: bool) -> SSEResponse:
    async def body() -> AsyncIterator[str]:
        try:
            for obj in first:
                yield sse(obj)
            async for ev in run.events():
                if isinstance(ev, Outcome):
                    for obj in last(ev):
                        yield sse(obj)
                else:
                    yield sse(piece(ev))
        except Exception as e:  # headers are sent: the error travels as an event
            log.exception("generation failed while streaming")
            state.metrics.error(500)
            yield sse({"error": {"message": str(e), "type": "server_error", "code": "generation_failed"}})
        finally:
            run.cancel()   # no-op when it ended; else the client left: free the slot now
        if done:
            yield sse("[DONE]")

    return SSEResponse(body(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def finish(run: Run, request: Request) -> Outcome:
    """The outcome of a non-streamed run; a client that leaves meanwhile stops it."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result = asyncio.ensure_future(run.outcome())
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({result, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not result.done():
            run.cancel()
        return await result
    finally:
        watch.cancel()


async def run_errors(run_call):
    """Await a run's outcome; engine errors become API errors (their messages are the user's fix)."""
    try:
        return await run_call
    except SpecrunError as e:
        raise ApiError(400, str(e), "invalid_value") from None


# ---- the app ------------------------------------------------------------------------------------

_ERRORS = {400: {"model": ErrorResponse, "description": "the request is invalid (the message says how)"},
           503: {"model": ErrorResponse, "description": "every slot is busy and the queue is full"}}


def _sse_doc(model) -> dict:
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": "JSON, or server-sent events when stream is true"}, **_ERRORS}


class Guard:
    """ASGI middleware: the API key on every path but /health, and the error counter."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self.expected = f"Bearer {key}".encode() if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.expected is not None and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = ApiError(401, "invalid or missing API key: send the header 'Authorization: Bearer KEY' "
                               "with the key given to --api-key", "invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                return await err.response()(scope, receive, self._counting(send))
        await self.app(scope, receive, self._counting(send))

    def _counting(self, send):
        async def wrapped(message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                self.state.metrics.error(message["status"])
            await send(message)

        return wrapped


def _validation_message(exc: RequestValidationError) -> tuple[str, str]:
    parts: list[str] = []
    code = "invalid_value"
    for err in exc.errors():
        if err["type"] == "json_invalid":
            ctx = err.get("ctx", {}).get("error", "")
            return f"the request body is not valid JSON ({ctx})", "invalid_json"
        if tuple(err["loc"]) == ("body",) and isinstance(err.get("input"), bytes | str):
            return ("the request body must be a JSON object, sent with 'Content-Type: application/json'",
                    "invalid_json")
        loc = [str(x) for x in err["loc"][1:] if not (isinstance(x, str) and ("[" in x or x in ("str", "int")))]
        where = ".".join(loc) or "body"
        if err["type"] == "missing":
            code = "missing_field"
        line = f"{where}: {err['msg']}"
        if line not in parts:
            parts.append(line)
    more = f" (and {len(parts) - 3} more)" if len(parts) > 3 else ""
    return "; ".join(parts[:3]) + more, code


def create_app(state: ServerState) -> FastAPI:
    cfg = state.config
    app = FastAPI(title="specrun serve", version="0.1.0",
                  description="OpenAI-compatible and llama-server endpoints over specrun's lossless "
                              "speculative decoding. Speculative options per request: the `speculative` field.")
    app.add_middleware(Guard, state=state)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, code = _validation_message(exc)
        return ApiError(400, message, code).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return ApiError(exc.status_code, msg, str(exc.detail).lower().replace(" ", "_"), exc.headers).response()

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception):
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        state.metrics.error(500)   # answered outside Guard (by Starlette's outermost middleware)
        return JSONResponse({"error": {"message": f"internal error: {type(exc).__name__}: {exc}",
                                       "type": "server_error", "code": "internal_error"}}, status_code=500)

    def oai_id(kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex[:24]}"

    # -- OpenAI ---------------------------------------------------------------------------------
    @app.post("/v1/completions", responses=_sse_doc(Completion), summary="OpenAI text completion")
    async def completions(req: CompletionRequest, request: Request):
        job = state.job("/v1/completions", req, state.tokens(req.prompt), req.max_tokens, req.stop)
        run = await state.start(job)
        head = {"id": oai_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": cfg.alias}

        def choice(text: str, finish: str | None) -> dict:
            return {"text": text, "index": 0, "logprobs": None, "finish_reason": finish}

        if req.stream:
            def last(o: Outcome) -> list:
                out = [{**head, "choices": [choice("", o.finish_reason)], "timings": state.timings(o)}]
                if req.stream_options and req.stream_options.include_usage:
                    out.append({**head, "choices": [], "usage": state.usage(job, o)})
                return out

            return stream(run, state, [], lambda s: {**head, "choices": [choice(s, None)]}, last, done=True)
        o = await run_errors(finish(run, request))
        return {**head, "choices": [choice(o.text, o.finish_reason)], "usage": state.usage(job, o),
                "timings": state.timings(o)}

    @app.post("/v1/chat/completions", responses=_sse_doc(ChatCompletion), summary="OpenAI chat completion")
    async def chat_completions(req: ChatRequest, request: Request):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        job = state.job("/v1/chat/completions", req, state.chat_prompt(req), max_tokens, req.stop,
                        cfg.chat_format.stop_tokens)
        run = await state.start(job)
        cid, created = oai_id("chatcmpl"), int(time.time())
        head = {"id": cid, "object": "chat.completion", "created": created, "model": cfg.alias}
        chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": cfg.alias}

        def delta(d: dict, finish: str | None) -> dict:
            return {**chunk, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}

        if req.stream:
            def last(o: Outcome) -> list:
                out = [{**delta({}, o.finish_reason), "timings": state.timings(o)}]
                if req.stream_options and req.stream_options.include_usage:
                    out.append({**chunk, "choices": [], "usage": state.usage(job, o)})
                return out

            return stream(run, state, [delta({"role": "assistant", "content": ""}, None)],
                          lambda s: delta({"content": s}, None), last, done=True)
        o = await run_errors(finish(run, request))
        msg = {"role": "assistant", "content": o.text}
        return {**head, "choices": [{"index": 0, "message": msg, "logprobs": None, "finish_reason": o.finish_reason}],
                "usage": state.usage(job, o), "timings": state.timings(o)}

    @app.get("/v1/models", response_model=ModelList, summary="the model served")
    async def models():
        meta = {"n_ctx": state.n_ctx, "n_ctx_train": state.model.n_ctx_train, "n_vocab": state.model.n_vocab,
                "slots": len(state.pool.slots), "spec_type": list(cfg.spec.types) or ["none"],
                "spec_types_available": list(cfg.spec_types), "chat_template": cfg.chat_format is not None}
        return {"object": "list", "data": [{"id": cfg.alias, "object": "model", "created": state.created,
                                            "owned_by": "specrun", "meta": meta}]}

    # -- llama-server ---------------------------------------------------------------------------
    @app.post("/completion", responses=_sse_doc(LlamaCompletion), summary="llama-server completion")
    async def completion(req: LlamaCompletionRequest, request: Request):
        job = state.job("/completion", req, state.tokens(req.prompt), req.n_predict, req.stop)
        run = await state.start(job)

        def final(o: Outcome, content: str) -> dict:
            return {"content": content, "tokens": o.tokens, "id_slot": run.slot.id, "stop": True, "model": cfg.alias,
                    "tokens_predicted": len(o.tokens), "tokens_evaluated": len(job.prompt),
                    "stop_type": "none" if o.stop_type == "interrupted" else o.stop_type,
                    "stopping_word": o.stopping_word, "tokens_cached": o.n_cached, "truncated": False,
                    "generation_settings": settings(), "timings": state.timings(o)}

        def settings() -> dict:
            s, sp = job.sampling, job.spec or cfg.spec
            return {"n_predict": job.n_predict, "temperature": s.temp, "top_k": s.top_k, "top_p": s.top_p,
                    "min_p": s.min_p, "seed": s.seed, "stop": list(job.stop),
                    "speculative": {"type": list(sp.types) or ["none"], "n_max": sp.n_max, "n_min": sp.n_min,
                                    "p_min": sp.p_min}}

        if req.stream:
            return stream(run, state, [], lambda s: {"content": s, "stop": False, "id_slot": run.slot.id},
                          lambda o: [final(o, "")], done=False)
        o = await run_errors(finish(run, request))
        return final(o, o.text)

    # -- service --------------------------------------------------------------------------------
    @app.get("/health", response_model=Health, summary="liveness (no API key needed)")
    async def health():
        busy = state.pool.n_busy
        return {"status": "ok", "slots_idle": len(state.pool.slots) - busy, "slots_processing": busy}

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def metrics():
        text = state.metrics.render(slots=len(state.pool.slots), busy=state.pool.n_busy,
                                    waiting=state.pool.n_waiting, queue=cfg.max_queue)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path, ops in schema["paths"].items():
                for op in ops.values():
                    responses = op.setdefault("responses", {})
                    responses.pop("422", None)   # validation errors answer 400 here (documented)
                    if cfg.api_key and path != "/health":
                        op["security"] = [{"bearer": []}]
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            comps.pop("HTTPValidationError", None)
            comps.pop("ValidationError", None)
            if cfg.api_key:
                schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app
