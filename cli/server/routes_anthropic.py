"""Anthropic's Messages API, as llama-server serves it: POST /v1/messages (stream: server-sent events
named by their type: message_start, content_block_start, content_block_delta, content_block_stop,
message_delta, message_stop) and POST /v1/messages/count_tokens. The conversation goes through the
model's chat template as /v1/chat/completions' does (a final assistant message is continued); text
only: tool, image and thinking blocks are a 400. Errors here are in Anthropic's shape."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request

from .errors import ANTHROPIC_PATH
from .middleware import off_loop_body
from .schemas import AnthropicMessageOut, InputTokens, MessagesRequest
from .slots import Outcome
from .state import Client, ServerState
from .streaming import stream
from .views import sse_doc

# Outcome.stop_type -> stop_reason ("interrupted" only reaches a client that left, or the shutdown's error)
_STOP_REASON = {"eos": "end_turn", "word": "stop_sequence", "limit": "max_tokens", "interrupted": "end_turn"}


def anthropic_router(state: ServerState) -> APIRouter:
    router = APIRouter(tags=["Anthropic"], route_class=off_loop_body(state.off_loop))
    alias = state.config.alias

    @router.post(ANTHROPIC_PATH, responses=sse_doc(AnthropicMessageOut), summary="Anthropic Messages API")
    async def messages(req: MessagesRequest, request: Request):
        fmt = state.chat_format()
        job = await state.job(ANTHROPIC_PATH, req, req.max_tokens, req.stop_sequences,
                              lambda: state.tokens(state.chat_prompt(req.chat())), fmt.stop_tokens,
                              stop_field="stop_sequences")
        head = {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": alias}

        def usage(o: Outcome) -> dict:
            return {"input_tokens": len(job.prompt) - o.n_cached, "cache_read_input_tokens": o.n_cached,
                    "output_tokens": len(o.tokens)}

        def start(ev: str | Outcome) -> list:
            """message_start once the prompt is evaluated (the first text, or the outcome)."""
            cached = ev.n_cached if isinstance(ev, Outcome) else len(job.prompt) - run.stats.n_prompt
            return [{"type": "message_start", "message": {
                        **head, "content": [], "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": len(job.prompt) - cached, "cache_read_input_tokens": cached,
                                  "output_tokens": 0}}},
                    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}]

        def end(o: Outcome) -> dict:
            return {"stop_reason": _STOP_REASON[o.stop_type], "stop_sequence": o.stopping_word or None}

        def last(o: Outcome) -> list:
            return [{"type": "content_block_stop", "index": 0},
                    {"type": "message_delta", "delta": end(o), "usage": usage(o)},
                    {"type": "message_stop"}]

        async with Client(request) as client:
            run = await state.start(job, client)
            if req.stream:
                return stream(run, state, start,
                              lambda s: {"type": "content_block_delta", "index": 0,
                                         "delta": {"type": "text_delta", "text": s}},
                              last, done=False, named=True)
            o = await state.finish(run, client)
        return await state.respond(lambda: {**head, "content": [{"type": "text", "text": o.text}] if o.text else [],
                                            **end(o), "usage": usage(o)})

    @router.post(f"{ANTHROPIC_PATH}/count_tokens", response_model=InputTokens, response_model_exclude_none=True,
                 summary="the prompt tokens of a Messages API request")
    async def count_tokens(req: MessagesRequest):
        state.chat_format()
        return {"input_tokens": len(await state.prepare(lambda: state.chat_prompt(req.chat())))}

    return router
