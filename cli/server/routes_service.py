"""The service endpoints: GET|HEAD /health and /v1/health (no API key needed), GET /metrics
(Prometheus), GET /v1/models and /v1/models/{id}."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from .errors import ApiError
from .schemas import ErrorResponse, Health, ModelCard, ModelList
from .state import ServerState


def service_router(state: ServerState) -> APIRouter:
    router = APIRouter(tags=["service"])
    cfg = state.config

    async def health():
        if state.pool.lost is not None:
            raise ApiError(503, str(state.pool.lost), "rpc_worker_lost")
        busy = state.pool.n_busy
        return {"status": "ok", "slots_idle": len(state.pool.slots) - busy, "slots_processing": busy}

    # one route per method: a route of two methods gives both the same operationId, which OpenAPI forbids
    for path, name, summary in (("/health", "health", "liveness (no API key needed); 503 while loading or "
                                 "shutting down"), ("/v1/health", "v1_health", "/health, under /v1")):
        for method in ("GET", "HEAD"):
            router.add_api_route(path, health, methods=[method], response_model=Health, summary=summary,
                                 operation_id=f"{name}_{method.lower()}")

    @router.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def metrics():
        runner = getattr(state.pool.slots[0].engine, "runner", None)   # batched slots (kernels/batch.py)
        text = state.metrics.render(slots=len(state.pool.slots), busy=state.pool.n_busy,
                                    waiting=state.pool.n_waiting, queue=cfg.max_queue,
                                    batch=None if runner is None else (runner.n_steps, runner.n_seq_steps))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def card() -> dict:
        meta = {"n_ctx": state.n_ctx, "n_ctx_train": state.model.n_ctx_train, "n_vocab": state.model.n_vocab,
                "slots": len(state.pool.slots), "spec_type": list(cfg.spec.types) or ["none"],
                "spec_types_available": list(cfg.spec_types), "spec_n_max_cap": state.n_max_cap,
                "chat_template": cfg.chat_format is not None}
        return {"id": cfg.alias, "object": "model", "created": state.created, "owned_by": "specrun", "meta": meta}

    @router.get("/v1/models", response_model=ModelList, summary="the model served")
    async def models():
        return {"object": "list", "data": [card()]}

    router.add_api_route("/models", models, methods=["GET"], include_in_schema=False)

    @router.get("/v1/models/{model_id:path}", response_model=ModelCard, summary="the model served, by its id",
                responses={404: {"model": ErrorResponse, "description": "not the model served"}})
    async def model(model_id: str):
        if model_id != cfg.alias:
            raise ApiError(404, f"model '{model_id}' is not served here; this server serves '{cfg.alias}'",
                           "model_not_found")
        return card()

    return router
