"""`specrun serve`: an OpenAI-compatible HTTP server (and llama-server's /completion, /metrics),
with --parallel slots over one loaded model.

The port is bound first and answers 503 `loading` while the model loads (in a thread). SIGTERM or
Ctrl-C: new requests get 503, queued ones 503 at once, those in flight get --drain-timeout seconds
to finish and are then stopped with an error (a JSON 503, or an SSE error event); then the process
exits 0. A second signal stops the generations in flight at once. This module turns the command line
into ServeOptions; the server's life is cli/server/lifecycle.py.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
import sys
from dataclasses import replace

import click

from .runtime.console import err_console, handle_errors, setup_logging
from .runtime.help import SectionedCommand
from .runtime.options import (
    chat_template_choice,
    engine_params,
    model_options,
    sampling_options,
    sampling_params,
    spec_options,
    template_options,
)
from .server import lifecycle
from .server.lifecycle import ServeOptions
from .server.state import BODY_TIMEOUT_S, DRAIN_TIMEOUT_S, MAX_BODY


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind (and listen) before loading the model, so a taken port fails at once and with a clear
    message, and clients connect from the first line on (answered 503 `loading`). The socket says
    IPPROTO_TCP, so asyncio sets TCP_NODELAY on every accepted connection (with protocol 0 it does
    not, and each request on a kept-alive connection waited for the client's delayed ACK)."""
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
              help="slots: requests served at once (with -cb, sequences of one batched decode)")
@click.option("-cb/-nocb", "--cont-batching/--no-cont-batching", "cont_batching", default=True, show_default=True,
              help="continuous batching: the -np slots share one context and one decode per step, with all the "
                   "threads (as llama-server); --no-cont-batching: each slot its own engine, the threads divided")
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
              help="GET /slots: each slot's request in flight or last one, its progress and settings, without "
                   "what the client typed (as llama-server's; --no-slots: a 501)")
@click.option("--slots-debug", "slots_debug", is_flag=True, envvar="LLAMA_SERVER_SLOTS_DEBUG",
              help="/slots shows every client's prompt, text so far, stop strings and grammar too "
                   "(llama-server's LLAMA_SERVER_SLOTS_DEBUG=1): for debugging on a server only you use")
@handle_errors
def serve(host, port, parallel, cont_batching, max_queue, api_key, alias, prefill_assistant, drain_timeout, max_body,
          body_timeout, slots_endpoint, slots_debug, **kw):
    """Serve a model over HTTP: /v1/completions, /v1/chat/completions, /v1/messages (Anthropic),
    /completion, /tokenize, /detokenize, /apply-template, /props, /slots, /v1/models, /health,
    /metrics (OpenAPI schema at /openapi.json). -n caps each request's tokens."""
    setup_logging(kw["verbose"])
    options = serve_options(host, port, parallel, max_queue, api_key, alias, prefill_assistant, drain_timeout,
                            max_body, body_timeout, slots_endpoint, slots_debug, cont_batching=cont_batching, **kw)
    with listen_socket(options.host, options.port) as sock:
        if warning := exposure_warning(sock.getsockname()[0], options.api_key):
            err_console.print(warning, markup=False, soft_wrap=True)
        ended = lifecycle.run(options, sock)
        if ended is not None:
            err_console.print(f"specrun serve: stopped{': ' + ended.stopped.line() if ended.stopped else ''}",
                              markup=False, soft_wrap=True)
            if ended.lost is not None:   # slot threads stay blocked in llama.cpp: do not join them
                err_console.print(f"error: {ended.lost}", style="red", markup=False, soft_wrap=True)
                sys.stdout.flush()
                os._exit(1)


def serve_options(host, port, parallel, max_queue, api_key, alias, prefill_assistant, drain_timeout, max_body,
                  body_timeout, slots_endpoint, slots_debug, cont_batching=True, **kw) -> ServeOptions:
    """serve's parameters (click's, as parsed) checked and made ServeOptions; raises
    click.ClickException (one line) before any port is bound. tests/serving.py builds its
    in-process servers with it."""
    if api_key is None and os.environ.get("SPECRUN_API_KEY") is not None:
        api_key = os.environ["SPECRUN_API_KEY"]      # click reads an empty variable as unset
    if api_key is not None and not api_key.strip():
        raise click.ClickException("the API key is empty (--api-key or SPECRUN_API_KEY); give a key, or leave "
                                   "both out to serve without one")
    chat_template, chat_template_file = chat_template_choice(kw)
    params = engine_params(kw)
    sampling = sampling_params(kw)   # a bad penalty, bias or grammar: one line before the port is bound
    batch_threads = kw["threads"]    # the batched context's: all of them
    if not kw["threads"]:   # the default threads (the idle cores, or LLAMA_ARG_THREADS), shared between the slots
        from specrun.kernels.llama import default_threads

        batch_threads = default_threads()
        params = replace(params, n_threads=max(1, batch_threads // parallel))
    return ServeOptions(model=kw["model"], params=params, sampling=sampling, n_predict=kw["n_predict"],
                        host=host, port=port, parallel=parallel, max_queue=max_queue, api_key=api_key, alias=alias,
                        chat_template=chat_template, chat_template_file=chat_template_file,
                        prefill_assistant=prefill_assistant, drain_timeout=drain_timeout, max_body=max_body,
                        body_timeout=body_timeout, slots_endpoint=slots_endpoint, slots_debug=slots_debug,
                        verbose=kw["verbose"], auto_refresh=kw["auto_refresh"], cont_batching=cont_batching,
                        batch_threads=batch_threads)
