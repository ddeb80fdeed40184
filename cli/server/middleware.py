"""ASGI layers around the FastAPI app.

    Gate    the app while the model loads: 503 `loading` on every path (the port is bound first,
            as llama-server does), then the real app
    Guard   outermost layer of the app, in this order: the API key (every path but the health
            checks), 503 `shutting_down` once SIGTERM came (but /metrics), the request body read
            whole within --body-timeout (408) and --max-body (413, checked on Content-Length
            before reading) and checked to be UTF-8 (400), then the app, with the body read as JSON
            whatever its Content-Type says (as llama-server); an exception the app lets out becomes
            a JSON 500 and the connection stays usable. It counts error responses, and asks clients
            to close their connection while the server stops.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from .errors import ApiError
from .state import ServerState

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/v1/health"})      # no API key needed
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

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state
        self.key = state.config.api_key.encode() if state.config.api_key else None

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        bearer = headers.get(b"authorization", b"")
        got = bearer[7:] if bearer[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(got, self.key)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        send = self._counting(send)
        path = scope["path"]
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

    def _counting(self, send):
        async def wrapped(message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                if status >= 400 and status != 499:
                    self.state.metrics.error(status)
                if self.state.stopping and _CLOSE not in message.get("headers", []):
                    message = {**message, "headers": [*message.get("headers", []), _CLOSE]}
            await send(message)

        return wrapped


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
