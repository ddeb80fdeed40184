"""The OpenAI endpoints: POST /v1/completions and /v1/chat/completions (stream: server-sent events
ending with `data: [DONE]`; also /chat/completions, as llama-server); llama-server's chat helpers
POST /v1/chat/completions/input_tokens (a request's prompt tokens) and /apply-template (its prompt)."""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from .middleware import off_loop_body
from .schemas import ChatCompletion, ChatRequest, Completion, CompletionRequest, InputTokens
from .slots import Outcome
from .state import Client, ServerState
from .streaming import stream
from .views import sse_doc


def oai_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter(tags=["OpenAI"], route_class=off_loop_body(state.off_loop))
    alias = state.config.alias

    @router.post("/v1/completions", responses=sse_doc(Completion), summary="OpenAI text completion")
    async def completions(req: CompletionRequest, request: Request):
        job = await state.job("/v1/completions", req, req.max_tokens, req.stop, lambda: state.tokens(req.prompt),
                              logprobs=req.logprobs)
        head = {"id": oai_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": alias}

        def choice(text: str, finish: str | None, logprobs: dict | None = None) -> dict:
            return {"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}

        def last(o: Outcome) -> list:
            out = [{**head, "choices": [choice("", o.finish_reason)], "timings": state.timings(o)}]
            if req.stream_options and req.stream_options.include_usage:
                out.append({**head, "choices": [], "usage": state.usage(job, o)})
            return out

        async with Client(request) as client:
            run = await state.start(job, client)
            if req.stream:
                return stream(run, state, [], lambda s: {**head, "choices": [choice(s, None)]}, last, done=True)
            o = await state.finish(run, client)
        return await state.respond(lambda: {**head, "choices": [choice(o.text, o.finish_reason,
                                                                        state.completion_logprobs(o))],
                                            "usage": state.usage(job, o), "timings": state.timings(o)})

    @router.post("/v1/chat/completions", responses=sse_doc(ChatCompletion), summary="OpenAI chat completion")
    async def chat_completions(req: ChatRequest, request: Request):
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        fmt = state.chat_format()
        job = await state.job("/v1/chat/completions", req, max_tokens, req.stop, lambda: state.chat_tokens(req),
                              fmt.stop_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        cid, created = oai_id("chatcmpl"), int(time.time())
        chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": alias}

        def delta(d: dict, finish: str | None) -> dict:
            return {**chunk, "choices": [{"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}]}

        def last(o: Outcome) -> list:
            out = [{**delta({}, o.finish_reason), "timings": state.timings(o)}]
            if req.stream_options and req.stream_options.include_usage:
                out.append({**chunk, "choices": [], "usage": state.usage(job, o)})
            return out

        async with Client(request) as client:
            run = await state.start(job, client)
            if req.stream:
                return stream(run, state, [delta({"role": "assistant", "content": ""}, None)],
                              lambda s: delta({"content": s}, None), last, done=True)
            o = await state.finish(run, client)
        msg = {"role": "assistant", "content": o.text}
        return await state.respond(lambda: {
            "id": cid, "object": "chat.completion", "created": created, "model": alias,
            "choices": [{"index": 0, "message": msg, "logprobs": state.chat_logprobs(o), "finish_reason": o.finish_reason}],
            "usage": state.usage(job, o), "timings": state.timings(o)})

    router.add_api_route("/chat/completions", chat_completions, methods=["POST"], include_in_schema=False)

    @router.post("/v1/chat/completions/input_tokens", response_model=InputTokens,
                 summary="the prompt tokens of a chat request (llama-server's)")
    async def chat_input_tokens(req: ChatRequest):
        return {"input_tokens": len(await state.prepare(lambda: state.chat_prompt(state.chat_messages(req)))),
                "object": "response.input_tokens"}

    router.add_api_route("/chat/completions/input_tokens", chat_input_tokens, methods=["POST"],
                         include_in_schema=False)

    @router.post("/apply-template", summary="the prompt a chat request renders to, without running it "
                                            "(llama-server's)")
    async def apply_template(req: ChatRequest):
        return await state.respond(lambda: {"prompt": state.chat_text(state.chat_messages(req))})

    return router
