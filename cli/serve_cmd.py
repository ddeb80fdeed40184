"""`specrun serve`: an OpenAI-compatible HTTP server (and llama-server's /completion, /metrics),
with --parallel slots over one loaded model."""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import click

from .runtime.auto import resolve_auto
from .runtime.console import err_console, handle_errors, setup_logging
from .runtime.loading import open_engines
from .runtime.options import (
    AUTO,
    engine_params,
    model_options,
    sampling_options,
    sampling_params,
    spec_options,
)


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind before loading the model, so a taken port fails at once and with a clear message."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as e:
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}; choose another --port "
                                   "(0 picks a free one)") from None
    return sock


@click.command("serve")
@model_options
@spec_options
@sampling_options
@click.option("--host", default="127.0.0.1", show_default=True, envvar="SPECRUN_HOST",
              help="address to bind (0.0.0.0 exposes the server to the network)")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, envvar="SPECRUN_PORT",
              help="port (0: any free one, printed at start)")
@click.option("-np", "--parallel", type=click.IntRange(1, 64), default=1, show_default=True,
              help="slots: requests served at once, each by its own context over the shared model")
@click.option("--queue", "max_queue", type=click.IntRange(0), default=16, show_default=True,
              help="requests that may wait for a slot; beyond that the server answers 503")
@click.option("--api-key", "api_key", envvar="SPECRUN_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' on every endpoint but /health")
@click.option("-a", "--alias", default=None, help="the model's name in responses (default: the -m name)")
@click.option("--chat-template", "chat_template", default=None,
              help="a Jinja chat template file to use instead of the model's own")
@handle_errors
def serve(host, port, parallel, max_queue, api_key, alias, chat_template, **kw):
    """Serve a model over HTTP: /v1/completions, /v1/chat/completions, /completion, /v1/models,
    /health, /metrics (OpenAPI schema at /openapi.json). -n caps each request's tokens."""
    import uvicorn

    from specrun.gguf_spec.registry import KNOWN_MODELS
    from specrun.kernels.chat_template import TemplateError

    from .runtime.chat import ChatFormat
    from .server.app import ServerConfig, ServerState, create_app
    from .server.metrics import Metrics
    from .server.slots import SlotPool

    setup_logging(kw["verbose"])
    with listen_socket(host, port) as sock:
        params = engine_params(kw)
        if not kw["threads"]:   # the cores, shared between the slots
            params = replace(params, n_threads=max(1, (os.cpu_count() or 1) // parallel))
        auto = params.spec.types == AUTO
        engines = open_engines(kw["model"], params, parallel)
        pool = SlotPool(engines, max_queue)
        try:
            model = engines[0].model
            params = engines[0].params
            fmt, reason = None, ""
            try:
                fmt = ChatFormat.load(model, chat_template)
            except TemplateError as e:
                if chat_template:
                    raise
                reason = str(e)
            spec_types = ["none", "ngram-simple"]
            if "draft-simple" in params.spec.types:
                spec_types.append("draft-simple")
            if engines[0].mtp_enabled:
                spec_types.append("draft-mtp")
            if auto:
                params = replace(params, spec=resolve_auto(engines[0], params.spec))
                for e in engines:
                    e.set_spec(params.spec)
            stem = os.path.splitext(os.path.basename(model.path))[0]
            config = ServerConfig(alias=alias or (kw["model"] if kw["model"] in KNOWN_MODELS else stem),
                                  sampling=sampling_params(kw), n_predict=kw["n_predict"], spec=params.spec,
                                  spec_types=tuple(spec_types), max_queue=max_queue, api_key=api_key,
                                  chat_format=fmt, no_template_reason=reason)
            state = ServerState(config, pool, Metrics(tuple(t for t in spec_types if t != "none")))
            ucfg = uvicorn.Config(create_app(state), host=host, port=port, timeout_graceful_shutdown=10,
                                  log_level="info" if kw["verbose"] else "warning", access_log=kw["verbose"])
            slots = f"{parallel} slot{'s' * (parallel > 1)}"
            err_console.print(f"specrun serve: {config.alias} on http://{host}:{sock.getsockname()[1]} ({slots}, "
                              f"ctx {state.n_ctx}, spec {','.join(params.spec.types) or 'none'}, requests may "
                              f"use: {', '.join(spec_types)})", markup=False, soft_wrap=True)
            _run(ucfg, sock, pool.cancel_all)
            err_console.print("specrun serve: stopped", markup=False)
        finally:
            pool.close()


def _run(ucfg, sock, on_exit) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, which on Ctrl-C / SIGTERM also stops the generations in flight (so their
        responses end at once) and then returns instead of re-raising the signal: a clean exit 0."""

        def handle_exit(self, sig, frame) -> None:
            on_exit()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    Server(ucfg).run(sockets=[sock])
