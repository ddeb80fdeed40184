"""ASGI layers around the FastAPI app.

    Gate    the app while the model loads: 503 `loading` on every path (the port is bound first,
            as llama-server does), then the real app
    Guard   outermost layer of the app, in this order: the Host header (below), the API key (every
            path but the health checks), 503 `shutting_down` once SIGTERM came (but /metrics), the
            request body read
            whole within --body-timeout (408) and --max-body (413, checked on Content-Length
            before reading) and checked to be UTF-8 (400), then the app, with the body read as JSON
            whatever its Content-Type says (as llama-server); an exception the app lets out becomes
            a JSON 500 and the connection stays usable. It counts error responses, asks clients
            to close their connection while the server stops, and writes one line per request on
            stderr, as llama-server's log: method, path, client, status and duration, never a
            body (the health checks and other polled paths only when they fail, as llama-server).
            Host: a server on loopback without an API key answers only requests whose Host names
            loopback (localhost, 127.0.0.1, [::1], any port), so that a web page cannot reach it
            through a DNS name rebound to 127.0.0.1; others get a 403 that names the fix. With an
            API key, or on another address (0.0.0.0), any Host is accepted.
    OffLoopBody
            the route class of every endpoint with a JSON body: the body is parsed and validated in
            a worker thread (ServerState.off_loop), with FastAPI's own errors, so that a large body
            (millions of token ids, a logit_bias of 200k keys) never holds the event loop
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute

from ..runtime.console import err_console
from .errors import ApiError
from .state import ServerState

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/v1/health"})      # no API key needed, any Host
# polled paths, logged only when they fail (llama-server's log_server_request skips them)
QUIET_PATHS = frozenset({"/health", "/v1/health", "/models", "/v1/models", "/props", "/metrics"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_CLOSE = (b"connection", b"close")


async def _answer(err: ApiError, send, close: bool = False, path: str = "") -> None:
    """Send err as the response to a request for path (headers and all), optionally closing the
    connection after it."""
    headers = dict(err.headers or {})
    if close:
        headers["Connection"] = "close"
    await ApiError(err.status, err.message, err.code, headers).response(path)(
        {"type": "http"}, _no_receive, send)


async def _no_receive():
    return {"type": "http.disconnect"}


class Gate:
    """An ASGI app that answers 503 `loading` until `app` is set, then is that app."""

    def __init__(self) -> None:
        self.app = None

    async def __call__(self, scope, receive, send) -> None:
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "http":
            await _answer(ApiError(503, "Loading model", "loading", {"Retry-After": "1"}), send)


class Guard:
    """See the module's docstring."""

    def __init__(self, app, state: ServerState, log_line: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.state = state
        self.key = state.config.api_key.encode() if state.config.api_key else None
        host = getattr(state.config, "host", "")
        self.host = host if self.key is None and host and is_loopback(host) else None   # None: any Host
        shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self.names = LOOPBACK_NAMES if shown.lower() in LOOPBACK_NAMES else (*LOOPBACK_NAMES, shown)
        self.log_line = log_line or _stderr_line

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        bearer = headers.get(b"authorization", b"")
        got = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(got, self.key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [None]
        try:
            await self._guard(scope, receive, self._counting(send, status))
        finally:
            self._log(scope, status[0], time.perf_counter() - t0)

    def _log(self, scope, status: int | None, seconds: float) -> None:
        """One line per request on stderr: llama-server's `done request: METHOD PATH CLIENT STATUS`,
        with the duration."""
        path = scope["path"]
        if path in QUIET_PATHS and status is not None and status < 400:
            return
        client = scope.get("client")
        self.log_line(f"specrun serve: done request: {scope['method']} {_printable(path)} "
                      f"{client[0] if client else '-'} {status or '-'} {seconds * 1e3:.1f} ms")

    async def _guard(self, scope, receive, send) -> None:
        path = scope["path"]
        if self.host is not None and path not in OPEN_PATHS:
            given = _header(scope, b"host")
            if given is not None and not host_allowed(given, self.host):
                return await _answer(ApiError(
                    403, f"the Host header {given!r} does not name this server: it listens on {self.host} without an "
                    f"API key, so it answers only Host {', '.join(self.names)} (any port), "
                    "against DNS rebinding; reach it by one of those, or start it with --api-key KEY (or --host "
                    "0.0.0.0, which accepts any Host)", "host_not_allowed"), send, path=path)
        if self.key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            return await _answer(ApiError(401, "invalid or missing API key: send the header 'Authorization: "
                                          "Bearer KEY' (or 'X-Api-Key: KEY') with the key given to --api-key",
                                          "invalid_api_key", {"WWW-Authenticate": "Bearer"}), send, path=path)
        if self.state.stopping and path != "/metrics":
            self.state.n_refused += path not in OPEN_PATHS
            return await _answer(ApiError(503, "the server is shutting down and takes no new requests",
                                          "shutting_down"), send, close=True, path=path)
        if scope["method"] in _BODY_METHODS:
            body = await self._body(scope, receive, send)
            if body is None:
                return
            try:
                body.decode("utf-8")   # JSON on the network is UTF-8 (RFC 8259)
            except UnicodeDecodeError as e:
                return await _answer(ApiError(400, f"the request body is not valid JSON: it is not UTF-8 (byte "
                                              f"0x{body[e.start]:02x} at offset {e.start})", "invalid_json"), send,
                                     path=path)
            receive = _replay(body, receive)
            scope = _as_json(scope)
        started = False

        async def tracking(message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception as e:
            log.error("%s %s failed", scope["method"], path, exc_info=e)
            if started:
                raise   # headers are out: only closing the connection can tell the client
            await _answer(ApiError(500, f"internal error: {type(e).__name__}: {e}", "internal_error"), send, path=path)

    async def _body(self, scope, receive, send) -> bytes | None:
        """The whole request body, or None once answered (413, 408) or when the client left."""
        cfg = self.state.config
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > cfg.max_body:
            await _answer(self._too_large(int(length)), send, close=True, path=scope["path"])
            return None
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(cfg.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > cfg.max_body:
                        break
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            expected = f" of {int(length)}" if length is not None and length.isdigit() else ""
            await _answer(ApiError(408, f"the request body did not arrive within {cfg.body_timeout:g} s "
                                   f"(--body-timeout): got {size}{expected} bytes", "body_timeout"), send, close=True,
                          path=scope["path"])
            return None
        await _answer(self._too_large(size, at_least=True), send, close=True, path=scope["path"])
        return None

    def _too_large(self, size: int, at_least: bool = False) -> ApiError:
        more = "more than " if at_least else ""
        return ApiError(413, f"the request body is {more}{size} bytes, above this server's limit of "
                        f"{self.state.config.max_body} (--max-body)", "body_too_large")

    def _counting(self, send, seen: list):
        async def wrapped(message) -> None:
            if message["type"] == "http.response.start":
                status = seen[0] = message["status"]
                if status >= 400 and status != 499:
                    self.state.metrics.error(status)
                if self.state.stopping and _CLOSE not in message.get("headers", []):
                    message = {**message, "headers": [*message.get("headers", []), _CLOSE]}
            await send(message)

        return wrapped


def _stderr_line(line: str) -> None:
    err_console.print(line, markup=False, soft_wrap=True)


def _printable(text: str, limit: int = 200) -> str:
    """text for a log line: control characters escaped (a path could carry a newline), cut at limit."""
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])
    return out + ("..." if len(text) > limit else "")


def _header(scope, name: bytes) -> str | None:
    value = next((v for k, v in scope["headers"] if k == name), None)
    return None if value is None else value.decode("latin-1")


def is_loopback(host: str) -> bool:
    """Whether --host HOST listens on loopback only: localhost, a loopback address, or a name that
    resolves to loopback addresses alone."""
    name = host.strip("[]").lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name.split("%")[0]).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0].split("%")[0]).is_loopback for i in infos)


def host_allowed(given: str, bound: str) -> bool:
    """Whether a Host header (host, optionally :port) names loopback, or the --host the server was
    started with: localhost (and *.localhost), 127.0.0.0/8, [::1]."""
    value = given.strip().lower()
    if value.startswith("["):                      # [v6] or [v6]:port
        name = value[1:value.find("]")] if "]" in value else ""
        rest = value[value.find("]") + 1:] if "]" in value else "x"
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return False
    else:
        name, _, port = value.partition(":")
        if port and not port.isdigit():
            return False
    name = name.rstrip(".")
    if name in ("localhost", bound.strip("[]").lower().rstrip(".")) or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _as_json(scope) -> dict:
    """scope with its body declared JSON: llama-server reads every body as JSON whatever the
    Content-Type says, and `curl -d` sends application/x-www-form-urlencoded (FastAPI would not
    parse those as JSON, nor a body without a Content-Type)."""
    headers = scope["headers"]
    given = next((v for k, v in headers if k == b"content-type"), b"")
    media = given.split(b";")[0].strip().lower()
    if media == b"application/json" or media.endswith(b"+json"):
        return scope
    return {**scope, "headers": [*((k, v) for k, v in headers if k != b"content-type"),
                                 (b"content-type", b"application/json")]}


def _replay(body: bytes, receive):
    """receive() that gives the body read already, then what the connection sends (the disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def off_loop_body(run: Callable[[Callable[[], Any]], Awaitable[Any]]) -> type[APIRoute]:
    """The route class whose JSON body is parsed and validated by run(fn) (a worker thread):
    FastAPI's handler then finds the validated model and takes it as it is (pydantic does not
    validate an instance of the model again)."""

    class OffLoopBody(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()
            field = self.body_field
            if field is None:
                return handler

            async def parse_off_loop(request: Request):
                body = await request.body()
                if not body or not _json_media(request.headers.get("content-type", "")):
                    return await handler(request)   # FastAPI's own answer (Guard makes every body JSON)
                return await handler(_Parsed(request, body, await run(lambda: _validated(field, body))))

            return parse_off_loop

    return OffLoopBody


class _Parsed(Request):
    """A request whose body was parsed and validated already: json() gives the model."""

    def __init__(self, request: Request, body: bytes, value: Any) -> None:
        super().__init__(request.scope, request.receive)
        self._raw, self._value = body, value

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._value


def _json_media(content_type: str) -> bool:
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _parse(body: bytes) -> Any:
    """The body as JSON, as FastAPI's json.loads reads it (the same values and errors), with a
    Python hook per number: json.loads' C parser never lets go of the GIL on its own, so a body of
    millions of numbers would hold the event loop for seconds; a hook gives it its turns."""
    return json.loads(body, parse_int=_int, parse_float=_float)


def _int(s: str) -> int:
    return int(s)


def _float(s: str) -> float:
    return float(s)


def _validated(field, body: bytes) -> Any:
    """The body parsed and validated as FastAPI would, with its errors (RequestValidationError,
    or the HTTPException 400 of a body its parser cannot read, such as one nested too deep)."""
    try:
        value = _parse(body)
    except json.JSONDecodeError as e:
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", e.pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": e.msg}}], body=e.doc) from e
    except Exception as e:
        raise HTTPException(status_code=400, detail="There was an error parsing the body") from e
    model, errors = field.validate(value, {}, loc=("body",))
    if errors:
        raise RequestValidationError(errors, body=value)
    return model
