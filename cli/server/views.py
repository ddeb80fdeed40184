"""OpenAPI documentation shared by the routers: the error responses and the streamed 200."""

from __future__ import annotations

from .schemas import ErrorResponse

ERRORS = {400: {"model": ErrorResponse, "description": "the request is invalid (the message says how)"},
          503: {"model": ErrorResponse, "description": "every slot is busy and the queue is full, or the "
                                                       "server is loading or shutting down"}}


def sse_doc(model) -> dict:
    return {200: {"model": model, "content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": "JSON, or server-sent events when stream is true"}, **ERRORS}
