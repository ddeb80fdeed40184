"""llama-server's own endpoints: POST /completion, with `tokens`, `timings` and the settings used
(stream: server-sent events without `[DONE]`, as llama-server); POST /tokenize and /detokenize;
GET /props (the settings a client reads: context size, slots, defaults, chat template); GET /slots
(each slot's request in flight or last one, its progress and settings; --no-slots turns it off).
/slots leaves out what a client typed (prompt, text, stop strings, grammar, logit biases) unless
--slots-debug (LLAMA_SERVER_SLOTS_DEBUG=1) asks for it, as llama-server does."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request

from . import bulk
from .errors import ApiError
from .middleware import off_loop_body
from .schemas import (
    DetokenizeRequest,
    ErrorResponse,
    LlamaCompletion,
    LlamaCompletionRequest,
    TokenizeRequest,
)
from .slots import Outcome, Slot
from .state import Client, ServerState
from .streaming import stream
from .views import sse_doc

_PRIVATE = frozenset({"stop", "grammar", "logit_bias"})   # settings /slots shows only with --slots-debug


def llama_router(state: ServerState) -> APIRouter:
    router = APIRouter(tags=["llama-server"], route_class=off_loop_body(state.off_loop))
    cfg = state.config

    @router.post("/completion", responses=sse_doc(LlamaCompletion), summary="llama-server completion")
    async def completion(req: LlamaCompletionRequest, request: Request):
        job = await state.job("/completion", req, req.n_predict, req.stop, lambda: state.tokens(req.prompt))

        def final(o: Outcome, content: str) -> dict:
            return {"content": content, "tokens": o.tokens, "id_slot": run.slot.id, "stop": True, "model": cfg.alias,
                    "tokens_predicted": len(o.tokens), "tokens_evaluated": len(job.prompt),
                    "stop_type": "none" if o.stop_type == "interrupted" else o.stop_type,
                    "stopping_word": o.stopping_word, "tokens_cached": o.n_cached, "truncated": False,
                    "generation_settings": state.settings(run.job), "timings": state.timings(o)}

        async with Client(request) as client:
            run = await state.start(job, client)
            if req.stream:
                return stream(run, state, [], lambda s: {"content": s, "stop": False, "id_slot": run.slot.id},
                              lambda o: [final(o, "")], done=False)
            o = await state.finish(run, client)
        return await state.respond(lambda: final(o, o.text))

    router.add_api_route("/completions", completion, methods=["POST"], include_in_schema=False)
    model = state.model

    def tokens(req: TokenizeRequest) -> list[bytes]:
        """The answer's JSON, in parts: {"tokens": [ids]}, or [{"id", "piece"}] with_pieces, written as
        text (a million small dicts would keep the garbage collector, and the GIL, busy for seconds)
        and in steps (bulk)."""
        ids: list[int] = []
        parts = [req.content] if isinstance(req.content, str) else req.content
        for i, part in enumerate(parts):
            if isinstance(part, int):
                if not 0 <= part < model.n_vocab:
                    raise ApiError(400, f"content.{i}: token id {part} is out of the vocabulary "
                                   f"(0..{model.n_vocab - 1})", "invalid_value")
                ids.append(part)
            else:    # llama-server's tokenize_mixed: BOS only in front of the first text
                ids += bulk.as_list(model.tokenize(part, add_special=req.add_special and i == 0,
                                                   parse_special=req.parse_special))

        def entry(t: int) -> str:
            b = model.piece(t, special=True)
            try:
                piece: str | list[int] = b.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(b)
            return _json({"id": t, "piece": piece}).decode()

        try:
            return [b'{"tokens":', *bulk.json_array(ids, entry if req.with_pieces else str), b"}"]
        finally:
            bulk.release(ids)

    def text(req: DetokenizeRequest) -> str:
        bad = [t for t in req.tokens if not 0 <= t < model.n_vocab]
        if bad:
            raise ApiError(400, f"tokens: token id {bad[0]} is out of the vocabulary (0..{model.n_vocab - 1})",
                           "invalid_value")
        return state.detokenize(req.tokens)

    # both answer off the event loop: a body of millions of ids or pieces takes seconds to make and encode
    @router.post("/tokenize", summary="text -> token ids (llama-server's)")
    async def tokenize(req: TokenizeRequest):
        return bulk.PartsResponse(await state.prepare(lambda: tokens(req)))

    @router.post("/detokenize", summary="token ids -> text (llama-server's)")
    async def detokenize(req: DetokenizeRequest):
        return bulk.PartsResponse(await state.off_loop(lambda: [b'{"content":', *bulk.json_string(text(req)), b"}"]))

    def props() -> dict:
        s, sp, fmt = cfg.sampling, cfg.spec, cfg.chat_format
        try:
            build = f"specrun {version('specrun')}, llama-cpp-python {version('llama_cpp_python')}"
        except PackageNotFoundError:
            build = "specrun"
        params = {"n_predict": cfg.n_predict, "temperature": s.temp, "top_k": s.top_k, "top_p": s.top_p,
                  "min_p": s.min_p, "seed": s.seed, "repeat_penalty": s.repeat_penalty,
                  "repeat_last_n": s.repeat_last_n, "presence_penalty": s.presence_penalty,
                  "frequency_penalty": s.frequency_penalty, "ignore_eos": s.ignore_eos,
                  "speculative": {"type": list(sp.types) or ["none"], "n_max": sp.n_max, "n_min": sp.n_min,
                                  "p_min": sp.p_min}}
        return {"default_generation_settings": {"n_ctx": state.n_ctx, "params": params},
                "total_slots": len(state.pool.slots), "model_alias": cfg.alias, "model_path": cfg.model_path,
                "modalities": {"vision": False, "video": False, "audio": False},
                "chat_template": fmt.template.source if fmt is not None else "",
                "bos_token": model.token_text(model.bos),
                "eos_token": model.token_text(model.eos),
                "build_info": build}

    @router.get("/props", summary="the server's settings (llama-server's)")
    async def get_props():
        return props()

    def slot_view(slot: Slot) -> dict:
        run = slot.last
        out = {"id": slot.id, "n_ctx": state.n_ctx, "is_processing": slot.busy,
               "speculative": bool((run.job.spec if run and run.job.spec else cfg.spec).types)}
        if run is None:
            return out
        job, st, text = run.job, run.stats, "".join(run.text)
        o = run.result if isinstance(run.result, Outcome) else None
        n_gen = len(o.tokens) if o is not None else st.n_gen if st is not None else 0
        n_new = st.n_prompt if st is not None and (st.n_gen or o is not None) else 0   # known once the prompt is in
        settings = state.settings(job)
        if not cfg.slots_debug:   # what one client typed is no other client's business (llama-server's rule)
            settings = {k: v for k, v in settings.items() if k not in _PRIVATE}
        out.update({"id_task": run.id_task, "n_prompt_tokens": len(job.prompt),
                    "n_prompt_tokens_processed": n_new,
                    "n_prompt_tokens_cache": len(job.prompt) - n_new if n_new else 0,
                    "params": settings,
                    "next_token": [{"has_next_token": run.result is None, "has_new_line": "\n" in text,
                                    "n_remain": max(job.n_predict - n_gen, 0) if job.n_predict >= 0 else -1,
                                    "n_decoded": n_gen}]})
        if cfg.slots_debug:
            out.update({"prompt": state.detokenize(job.prompt), "generated": text})
        return out

    @router.get("/slots", summary="each slot's state: the request in flight or the last one (llama-server's)",
                responses={501: {"model": ErrorResponse, "description": "started with --no-slots"},
                           503: {"model": ErrorResponse, "description": "?fail_on_no_slot=1 and every slot busy"}})
    async def slots(fail_on_no_slot: str = ""):
        if not cfg.slots_endpoint:   # llama-server's words and code
            raise ApiError(501, "This server does not support slots endpoint. Start it with `--slots`",
                           "not_supported_error")
        if fail_on_no_slot and state.pool.n_busy == len(state.pool.slots):
            raise ApiError(503, "no slot available: every slot is processing a request", "unavailable_error")
        return [slot_view(s) for s in state.pool.slots]

    return router


def _json(obj) -> bytes:
    """obj as JSONResponse writes it (compact, UTF-8)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode()
