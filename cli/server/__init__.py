"""`specrun serve`'s HTTP server, in the role of llama-server.

    lifecycle.py       ServeOptions; run(): the loader thread (503 `loading` meanwhile), --spec-type
                       auto's calibration, uvicorn with the drain on SIGTERM / Ctrl-C
    app.py             create_app: the routers, the error handlers, the OpenAPI schema
    routes_openai.py   /v1/completions, /v1/chat/completions
    routes_llama.py    /completion
    routes_service.py  /health, /v1/health, /metrics, /v1/models[/{id}]
    state.py           ServerConfig, ServerState: request -> checked job (prompt prepared off the
                       event loop) -> a slot; shutdown
    streaming.py       server-sent events
    middleware.py      Gate (503 while loading), Guard (API key, body limits, 503 while stopping, 500s)
    slots.py           N engines over one model, a bounded queue, generation in worker threads, drain
    schemas.py         request and response bodies (pydantic; the OpenAPI schema)
    errors.py          ApiError (OpenAI's error shape), validation messages
    limits.py          the chat template's time limit
    metrics.py         Prometheus counters
"""
