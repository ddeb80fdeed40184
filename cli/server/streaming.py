"""Server-sent events: a run's text as `data: {...}` events, ending with `data: [DONE]` on the
OpenAI endpoints. Once the headers are sent an error can only travel as an event: a generation that
fails, or that the shutdown stops, ends with `data: {"error": {...}}` (then `[DONE]`), never with a
final chunk that looks complete."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

import anyio
from fastapi.responses import StreamingResponse

from .slots import Outcome, Run
from .state import ServerState

log = logging.getLogger(__name__)


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
    """first: the events before any text; piece(text): one event; last(outcome): the closing events;
    done: end with `data: [DONE]` (OpenAI; llama-server's /completion has none)."""

    async def body() -> AsyncIterator[str]:
        try:
            for obj in first:
                yield sse(obj)
            async for ev in run.events():
                if not isinstance(ev, Outcome):
                    yield sse(piece(ev))
                elif run.shut_down:
                    state.metrics.error(503)
                    yield sse(state.shutdown_error(ev).body())
                else:
                    for obj in last(ev):
                        yield sse(obj)
        except Exception as e:  # headers are sent: the error travels as an event
            log.exception("generation failed while streaming")
            state.metrics.error(500)
            yield sse({"error": {"message": str(e), "type": "server_error", "code": "generation_failed"}})
        finally:
            run.cancel()   # no-op when it ended; else the client left: free the slot now
        if done:
            yield sse("[DONE]")

    return SSEResponse(body(), headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
