"""`specrun serve`'s HTTP server, in the role of llama-server.

    app.py       the FastAPI app: endpoints, errors, authentication (create_app)
    slots.py     N engines over one model, a bounded queue, generation in worker threads
    schemas.py   request and response bodies (pydantic; the OpenAPI schema)
    metrics.py   Prometheus counters
"""
