"""llama-server's own endpoint: POST /completion, with `tokens`, `timings` and the settings used
(stream: server-sent events without `[DONE]`, as llama-server)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from .schemas import LlamaCompletion, LlamaCompletionRequest
from .slots import Outcome
from .state import Client, ServerState
from .streaming import stream
from .views import sse_doc


def llama_router(state: ServerState) -> APIRouter:
    router = APIRouter(tags=["llama-server"])
    cfg = state.config

    @router.post("/completion", responses=sse_doc(LlamaCompletion), summary="llama-server completion")
    async def completion(req: LlamaCompletionRequest, request: Request):
        job = await state.job("/completion", req, req.n_predict, req.stop, lambda: state.tokens(req.prompt))

        def settings() -> dict:
            s, sp = job.sampling, job.spec or cfg.spec
            return {"n_predict": job.n_predict, "temperature": s.temp, "top_k": s.top_k, "top_p": s.top_p,
                    "min_p": s.min_p, "seed": s.seed, "stop": list(job.stop), "repeat_penalty": s.repeat_penalty,
                    "repeat_last_n": s.repeat_last_n, "presence_penalty": s.presence_penalty,
                    "frequency_penalty": s.frequency_penalty, "ignore_eos": s.ignore_eos,
                    "logit_bias": [[t, b if b > float("-inf") else False] for t, b in s.logit_bias],
                    "grammar": s.grammar or "",
                    "speculative": {"type": list(sp.types) or ["none"], "n_max": sp.n_max, "n_min": sp.n_min,
                                    "p_min": sp.p_min}}

        def final(o: Outcome, content: str) -> dict:
            return {"content": content, "tokens": o.tokens, "id_slot": run.slot.id, "stop": True, "model": cfg.alias,
                    "tokens_predicted": len(o.tokens), "tokens_evaluated": len(job.prompt),
                    "stop_type": "none" if o.stop_type == "interrupted" else o.stop_type,
                    "stopping_word": o.stopping_word, "tokens_cached": o.n_cached, "truncated": False,
                    "generation_settings": settings(), "timings": state.timings(o)}

        async with Client(request) as client:
            run = await state.start(job, client)
            if req.stream:
                return stream(run, state, [], lambda s: {"content": s, "stop": False, "id_slot": run.slot.id},
                              lambda o: [final(o, "")], done=False)
            o = await state.finish(run, client)
        return final(o, o.text)

    return router
