"""`specrun serve`: an OpenAI-compatible HTTP server (and llama-server's /completion, /metrics),
with --parallel slots over one loaded model.

The port is bound first and answers 503 `loading` while the model loads (in a thread). SIGTERM or
Ctrl-C: new requests get 503, queued ones 503 at once, those in flight get --drain-timeout seconds
to finish and are then stopped with an error (a JSON 503, or an SSE error event); then the process
exits 0. A second signal stops the generations in flight at once.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import os
import socket
import sys
import threading
from dataclasses import replace

import click

from .runtime.auto import resolve_auto
from .runtime.console import err_console, handle_errors, setup_logging
from .runtime.help import SectionedCommand
from .runtime.loading import open_engines
from .runtime.options import (
    AUTO,
    chat_template_choice,
    engine_params,
    model_options,
    sampling_options,
    sampling_params,
    spec_options,
    template_options,
)
from .server.state import BODY_TIMEOUT_S, DRAIN_TIMEOUT_S, MAX_BODY


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind (and listen) before loading the model, so a taken port fails at once and with a clear
    message, and clients connect from the first line on (answered 503 `loading`). The socket says
    IPPROTO_TCP, so asyncio sets TCP_NODELAY on every accepted connection (with protocol 0 it does
    not, and each request on a kept-alive connection waited ~40 ms for the client's delayed ACK)."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(info[4])
        sock.listen(2048)
    except OSError as e:
        fix = "choose another --port (0 picks a free one)" if e.errno == errno.EADDRINUSE else \
            "give --host an address of this machine (127.0.0.1, or 0.0.0.0 for all)"
        raise click.ClickException(f"cannot listen on {host}:{port}: {e.strerror or e}; {fix}") from None
    return sock


def exposure_warning(address: str, api_key: str | None) -> str | None:
    """A warning line when the server listens beyond this machine without an API key."""
    if api_key or ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return None
    return (f"specrun serve: warning: listening on {address} without --api-key: anyone who can reach this "
            "address can use the model; give --api-key KEY, or bind 127.0.0.1")


@click.command("serve", cls=SectionedCommand)
@model_options
@spec_options
@sampling_options
@click.option("--host", default="127.0.0.1", show_default=True, envvar="SPECRUN_HOST",
              help="address to bind (0.0.0.0 exposes the server to the network: give --api-key)")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, envvar="SPECRUN_PORT",
              help="port (0: any free one, printed at start)")
@click.option("-np", "--parallel", type=click.IntRange(1, 64), default=1, show_default=True,
              help="slots: requests served at once, each by its own context over the shared model")
@click.option("--queue", "max_queue", type=click.IntRange(0), default=16, show_default=True,
              help="requests that may wait for a slot; beyond that the server answers 503")
@click.option("--api-key", "api_key", envvar="SPECRUN_API_KEY", default=None,
              help="require 'Authorization: Bearer KEY' (or 'X-Api-Key: KEY') on every endpoint but /health")
@click.option("-a", "--alias", default=None, help="the model's name in responses (default: the -m name)")
@template_options
@click.option("--prefill-assistant/--no-prefill-assistant", "prefill_assistant", default=True, show_default=True,
              help="a chat request that ends with an assistant message continues that message, as llama-server "
                   "does (--no-prefill-assistant: it is closed as a whole turn and a new one begins)")
@click.option("--drain-timeout", "drain_timeout", type=click.FloatRange(0), default=DRAIN_TIMEOUT_S,
              show_default=True, help="on SIGTERM / Ctrl-C, seconds the requests in flight get to finish before "
                                      "they are stopped with an error")
@click.option("--max-body", "max_body", type=click.IntRange(1), default=MAX_BODY, show_default=True,
              help="largest request body in bytes (more: 413)")
@click.option("--body-timeout", "body_timeout", type=click.FloatRange(0, min_open=True), default=BODY_TIMEOUT_S,
              show_default=True, help="seconds a request body may take to arrive (then: 408)")
@click.option("--slots/--no-slots", "slots_endpoint", default=True, show_default=True,
              help="GET /slots: each slot's request in flight or last one, with its prompt, text so far and "
                   "settings (as llama-server's; --no-slots hides them from the clients)")
@handle_errors
def serve(host, port, parallel, max_queue, api_key, alias, prefill_assistant, drain_timeout, max_body, body_timeout,
          slots_endpoint, **kw):
    """Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/messages (Anthropic),
    /completion, /tokenize, /detokenize, /apply-template, /props, /slots, /v1/models, /health,
    /metrics (OpenAPI schema at /openapi.json). -n caps each request's tokens."""
    import uvicorn

    from .server.middleware import Gate

    if api_key is None and os.environ.get("SPECRUN_API_KEY") is not None:
        api_key = os.environ["SPECRUN_API_KEY"]      # click reads an empty variable as unset
    if api_key is not None and not api_key.strip():
        raise click.ClickException("the API key is empty (--api-key or SPECRUN_API_KEY); give a key, or leave "
                                   "both out to serve without one")
    setup_logging(kw["verbose"])
    chat_template, chat_template_file = chat_template_choice(kw)
    params = engine_params(kw)
    sampling = sampling_params(kw)   # a bad penalty, bias or grammar: one line before the port is bound
    if not kw["threads"]:   # the cores, shared between the slots
        params = replace(params, n_threads=max(1, (os.cpu_count() or 1) // parallel))
    with listen_socket(host, port) as sock:
        address, bound = sock.getsockname()[:2]
        url = f"http://{host}:{bound}"
        if warning := exposure_warning(address, api_key):
            err_console.print(warning, markup=False, soft_wrap=True)
        gate = Gate()
        server = _make_server(uvicorn.Config(gate, lifespan="off", timeout_graceful_shutdown=max(drain_timeout, 5.0),
                                        log_level="info" if kw["verbose"] else "warning", access_log=kw["verbose"]))
        options = dict(parallel=parallel, max_queue=max_queue, api_key=api_key, alias=alias, sampling=sampling,
                       chat_template=chat_template, chat_template_file=chat_template_file,
                       drain_timeout=drain_timeout, max_body=max_body, body_timeout=body_timeout,
                       prefill_assistant=prefill_assistant, slots_endpoint=slots_endpoint)
        loader = _Loader(kw, params, options, url, gate, server)
        err_console.print(f"specrun serve: loading {kw['model']} on {url}", markup=False, soft_wrap=True)
        loader.start()
        try:
            server.run(sockets=[sock])
        finally:
            loader.join()
            if loader.state is not None:
                loader.state.pool.close()
        if loader.error is not None:
            raise loader.error
        if loader.state is not None:
            stopped = loader.state.stopped(server.drained) if server.drained else None
            err_console.print(f"specrun serve: stopped{': ' + stopped.line() if stopped else ''}", markup=False,
                              soft_wrap=True)
            if loader.state.pool.lost is not None:   # slot threads stay blocked in llama.cpp: do not join them
                err_console.print(f"error: {loader.state.pool.lost}", style="red", markup=False, soft_wrap=True)
                sys.stdout.flush()
                os._exit(1)


class _Loader(threading.Thread):
    """Loads the engines and builds the app while the port answers 503 `loading`; then installs the
    app in the gate. A failure (the model, a --chat-template that does not render) stops the server
    and is raised by serve() as one line."""

    def __init__(self, kw: dict, params, options: dict, url: str, gate, server) -> None:
        super().__init__(name="specrun-load", daemon=True)
        self.kw, self.params, self.options, self.url, self.gate, self.server = kw, params, options, url, gate, server
        self.state = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._load()
        except BaseException as e:  # raised again by serve() in the main thread
            self.error = e
            self.server.should_exit = True

    def _load(self) -> None:
        from specrun.gguf_spec.registry import KNOWN_MODELS
        from specrun.kernels.chat_template import TemplateError

        from .runtime.chat import ChatFormat
        from .server.app import ServerConfig, ServerState, create_app
        from .server.limits import time_limited
        from .server.metrics import Metrics
        from .server.slots import SlotPool

        kw, opt, params = self.kw, self.options, self.params
        auto = params.spec.types == AUTO
        engines = open_engines(kw["model"], params, opt["parallel"], start_prefill=True)
        pool = SlotPool(engines, opt["max_queue"])
        if params.placement is not None:   # a worker lost: fail those requests, keep answering (kernels/rpc.py)
            from specrun.kernels import rpc

            rpc.on_worker_lost(pool.worker_lost)
        try:
            model = engines[0].model
            params = engines[0].params
            fmt, reason = None, ""
            try:
                fmt = time_limited(lambda: ChatFormat.load(model, opt["chat_template"], opt["chat_template_file"]))
            except TemplateError as e:
                if opt["chat_template"] or opt["chat_template_file"]:
                    flag = "--chat-template" if opt["chat_template"] else "--chat-template-file"
                    raise TemplateError(f"{flag} {opt['chat_template'] or opt['chat_template_file']}: {e}") from None
                reason = str(e)
            spec_types = ["none", *engines[0].spec_types]
            if auto:
                params = replace(params, spec=resolve_auto(engines[0], params.spec))
                for e in engines:
                    e.set_spec(params.spec)
                for e in engines[1:]:   # the calibration's pass costs, for every slot
                    e.pass_cost = engines[0].pass_cost.copy()
            stem = os.path.splitext(os.path.basename(model.path))[0]
            config = ServerConfig(alias=opt["alias"] or (kw["model"] if kw["model"] in KNOWN_MODELS else stem),
                                  sampling=opt["sampling"], n_predict=kw["n_predict"], spec=params.spec,
                                  spec_types=tuple(spec_types), max_queue=opt["max_queue"], api_key=opt["api_key"],
                                  chat_format=fmt, no_template_reason=reason, max_body=opt["max_body"],
                                  body_timeout=opt["body_timeout"], drain_timeout=opt["drain_timeout"],
                                  prefill_assistant=opt["prefill_assistant"], slots_endpoint=opt["slots_endpoint"])
            state = ServerState(config, pool, Metrics(tuple(t for t in spec_types if t != "none")))
            app = create_app(state)
        except BaseException:
            pool.close()
            raise
        self.state = state
        self.server.state = state
        self.gate.app = app
        n = opt["parallel"]
        err_console.print(f"specrun serve: {config.alias} on {self.url} ({n} slot{'s' * (n > 1)}, ctx {state.n_ctx}, "
                          f"spec {','.join(params.spec.types) or 'none'}, requests may use: {', '.join(spec_types)})",
                          markup=False, soft_wrap=True)


def _make_server(config):
    """uvicorn's Server with the drain (uvicorn is imported on first use: the CLI starts faster)."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, with a drain on the first SIGTERM / Ctrl-C (ServerState.shut_down) before
        uvicorn's own shutdown; a second signal stops the generations in flight at once. It returns
        instead of re-raising the signal: a clean exit 0."""

        def __init__(self, config) -> None:
            super().__init__(config)
            self.state = None            # set once the model is loaded
            self.drained = None          # slots.Drained, once the drain is over
            self._loop: asyncio.AbstractEventLoop | None = None
            self._signals = 0

        async def startup(self, sockets=None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame) -> None:
            self._signals += 1
            if self.state is None or self._loop is None:   # still loading: stop now
                self.should_exit = True
                return
            if self._signals == 1:
                self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))
            elif self._signals == 2:
                self._loop.call_soon_threadsafe(self.state.pool.cancel_all, "shutdown")
            else:
                self.force_exit = True

        async def _drain(self) -> None:
            try:
                self.drained = await self.state.shut_down()
            finally:
                self.should_exit = True

    return Server(config)
