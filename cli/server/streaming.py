"""Server-sent events: a run's text as `data: {...}` events, ending with `data: [DONE]` on the
OpenAI endpoints; on Anthropic's /v1/messages each event is also named by its type (`event:
content_block_delta`). Once the headers are sent an error can only travel as an event: a generation
that fails, or that the shutdown stops, ends with `data: {"error": {...}}` (then `[DONE]`; Anthropic:
`event: error`), never with a final chunk that looks complete."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse

from .errors import ApiError
from .slots import Outcome, Run
from .state import ServerState

log = logging.getLogger(__name__)


def sse(obj, named: bool = False) -> str:
    """One event; named: an `event:` line with obj's type first (Anthropic's streams)."""
    head = f"event: {obj['type']}\n" if named else ""
    return f"{head}data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


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


def stream(run: Run, state: ServerState, first: list | Callable[[str | Outcome], list], piece: Callable[[str], dict],
           last: Callable[[Outcome], list], done: bool, named: bool = False) -> SSEResponse:
    """first: the events before any text, or first(event) making them once the run's first text
    piece (or its outcome) is there, the prompt evaluated (Anthropic's message_start carries the
    prompt's cached and evaluated tokens); piece(text): one event; last(outcome): the closing
    events; done: end with `data: [DONE]` (OpenAI; llama-server's /completion has none); named:
    every event named by its type, errors in Anthropic's shape (/v1/messages)."""

    def error(e: ApiError) -> str:
        return sse(e.anthropic_body(), named=True) if named else sse(e.body())

    async def body() -> AsyncIterator[str]:
        later = first if callable(first) else None
        try:
            for obj in [] if later else first:
                yield sse(obj, named)
            async for ev in run.events():
                if later is not None and not (isinstance(ev, Outcome) and run.shut_down):
                    for obj in later(ev):
                        yield sse(obj, named)
                    later = None
                if not isinstance(ev, Outcome):
                    yield sse(piece(ev), named)
                elif run.shut_down:
                    state.metrics.error(503)
                    yield error(state.shutdown_error(ev))
                else:
                    for obj in last(ev):
                        yield sse(obj, named)
        except Exception as e:  # headers are sent: the error travels as an event
            log.exception("generation failed while streaming")
            state.metrics.error(500)
            yield error(ApiError(500, str(e), "generation_failed"))
        finally:
            run.cancel()   # no-op when it ended; else the client left: free the slot now
        if done:
            yield sse("[DONE]")

    return SSEResponse(body(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
