"""The life of `specrun serve`'s server, from a bound socket to the exit.

run() starts uvicorn on the socket at once: the Gate answers 503 `loading` while the Loader thread
opens the engines, resolves --spec-type auto (its calibration) and builds the app. On SIGTERM or
Ctrl-C the server drains (ServerState.shut_down) before uvicorn's own shutdown; a second signal
stops the generations in flight at once. run() returns how it ended; the command prints it.
tests/serving.py serves the same app in a thread of the tests' process: make_server, a Loader
given engines kept open across servers (build), the drain by handle_exit.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specrun.kernels.params import EngineParams
from specrun.kernels.types import SamplingParams

from ..runtime.auto import resolve_auto
from ..runtime.console import err_console
from ..runtime.loading import open_engines
from ..runtime.options import AUTO
from .middleware import Gate
from .state import ServerState, Stopped

if TYPE_CHECKING:
    from specrun.kernels.batch import SeqEngine
    from specrun.kernels.engine import Engine


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """`specrun serve`'s command line, checked: serve_cmd builds it once, before the port is bound."""

    model: str                          # -m: a registry name or a GGUF path
    params: EngineParams                # model and --spec-* options; --spec-type auto is resolved after loading
    sampling: SamplingParams            # the defaults a request's fields override
    n_predict: int                      # -n: a request's default max tokens; when > 0 also its cap
    host: str                           # --host, as given (the URL printed)
    port: int                           # --port (0: any free one)
    parallel: int                       # -np: slots (sequences of one batched context, or engines of their own)
    max_queue: int                      # --queue: requests that may wait for a slot
    api_key: str | None                 # --api-key / SPECRUN_API_KEY, never empty
    alias: str | None                   # -a: the model's name in responses (None: the -m name)
    chat_template: str | None           # --chat-template NAME|JINJA
    chat_template_file: str | None      # --chat-template-file FILE (at most one of the two)
    prefill_assistant: bool             # a final assistant message is continued
    drain_timeout: float                # seconds the requests in flight get on SIGTERM / Ctrl-C
    max_body: int                       # bytes of a request body; more is a 413
    body_timeout: float                 # seconds a request body may take; then a 408
    slots_endpoint: bool                # GET /slots shows the slots (--no-slots: it does not)
    slots_debug: bool                   # /slots shows the requests' texts too (LLAMA_SERVER_SLOTS_DEBUG)
    verbose: bool                       # -v: uvicorn's info log (its access log stays off)
    auto_refresh: bool = False          # --spec-auto-refresh: auto measures this machine's costs again
    cont_batching: bool = True          # -cb / -nocb: -np > 1 slots share one batched decode (kernels/batch.py)
    batch_threads: int = 0              # the batched context's threads (all of them; 0: params.n_threads)


@dataclass(frozen=True, slots=True)
class Ended:
    """How a server whose model loaded ended."""

    stopped: Stopped | None             # the drain's summary (None: uvicorn stopped without a drain)
    lost: Exception | None              # an RPC worker lost: its slot threads stay blocked in llama.cpp


SWITCH_INTERVAL = 0.0005   # seconds (Python's default: 0.005); see run()


def run(options: ServeOptions, sock) -> Ended | None:
    """Serve on sock (bound and listening) until SIGTERM / Ctrl-C. Returns None when the server
    stopped before the model loaded; raises what the loading raised (a bad model, a
    --chat-template that does not render)."""
    url = f"http://{options.host}:{sock.getsockname()[1]}"
    # The event loop answers between the worker threads' Python steps: a thread that wants the GIL
    # waits a switch interval for it, and one /health answer needs it several times.
    sys.setswitchinterval(SWITCH_INTERVAL)
    gate = Gate()
    server = make_server(options, gate)
    loader = Loader(options, url, gate, server)
    err_console.print(f"specrun serve: loading {options.model} on {url}", markup=False, soft_wrap=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        loader.join()
        if loader.state is not None:
            loader.state.pool.close()
    if loader.error is not None:
        raise loader.error
    if loader.state is None:
        return None
    return ended(server, loader.state)


def make_server(options: ServeOptions, gate: Gate):
    """uvicorn's Server for options around gate, with the drain on its first SIGTERM / Ctrl-C
    (handle_exit). It captures the signals only when run in the main thread. No access log, even
    with -v: Guard writes the one line per request (uvicorn's would be a second, on stdout)."""
    import uvicorn

    return _make_server(uvicorn.Config(gate, lifespan="off", timeout_graceful_shutdown=max(options.drain_timeout, 5.0),
                                       log_level="info" if options.verbose else "warning", access_log=False))


def ended(server, state: ServerState) -> Ended:
    """How the server (make_server's, its run() returned) of state ended."""
    return Ended(state.stopped(server.drained) if server.drained else None, state.pool.lost)


class Loader(threading.Thread):
    """Loads the engines and builds the app while the port answers 503 `loading`; then installs the
    app in the gate. A failure (the model, a --chat-template that does not render) stops the server
    and is raised by run() as one line."""

    def __init__(self, options: ServeOptions, url: str, gate: Gate, server,
                 engines: Callable[[ServeOptions], list[Engine]] | None = None) -> None:
        """engines: how to get the engines for options (default: open_engines, the prompt worker
        started); tests/serving.py passes engines it keeps open across servers."""
        super().__init__(name="specrun-load", daemon=True)
        self.options, self.url, self.gate, self.server = options, url, gate, server
        self.engines = engines or load_engines
        self.built: Built | None = None
        self.state: ServerState | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._load()
        except BaseException as e:  # raised again by run() in the main thread
            self.error = e
            self.server.should_exit = True

    def _load(self) -> None:
        opt = self.options
        built = build(opt, self.engines(opt))
        self.built, self.state = built, built.state
        self.server.state = built.state
        self.gate.app = built.app
        err_console.print(built.ready_line(self.url), markup=False, soft_wrap=True)


def load_engines(opt: ServeOptions) -> list[Engine | SeqEngine]:
    """The slots' engines: with -np > 1 and continuous batching, a sequence each of one batched
    context (batch_slots) on all the batch's threads, unless the settings cannot be batched (one
    stderr line says why); else -np engines over the model, the threads divided between them, its
    prompt worker started (open_engines)."""
    if opt.parallel == 1 or not opt.cont_batching:
        return open_engines(opt.model, opt.params, opt.parallel, start_prefill=True)
    from specrun.kernels.batch import batch_slots, not_batchable

    why = not_batchable(opt.params)
    if not why:
        # the model's owner (the batch, its prompt worker, --spec-type auto's calibration): all the threads
        [owner] = open_engines(opt.model, replace(opt.params, n_threads=opt.batch_threads or opt.params.n_threads), 1)
        why = not_batchable(owner.params, owner.model.recurrent)
        if not why:
            try:
                return batch_slots(owner, opt.parallel)
            except BaseException:
                owner.close()
                raise
        owner.close()         # a hybrid model: loaded again below, with the threads divided
    err_console.print(f"specrun serve: -np {opt.parallel}: each slot decodes with an engine of its own, not in "
                      f"one batch ({why})", markup=False, soft_wrap=True)
    return open_engines(opt.model, opt.params, opt.parallel, start_prefill=True)


@dataclass(frozen=True, slots=True)
class Built:
    """The server's app around its loaded engines (build)."""

    state: ServerState
    app: object                         # the FastAPI app (create_app)
    spec: tuple[str, ...]               # the spec types a request runs by default (auto: resolved)
    spec_types: tuple[str, ...]         # the spec types a request may name, "none" first
    batched: bool = False               # the slots share one batched decode

    def ready_line(self, url: str) -> str:
        """The line `specrun serve` prints once the model is loaded."""
        n = len(self.state.pool.slots)
        how = " in one batched decode" if self.batched else ""
        return (f"specrun serve: {self.state.config.alias} on {url} ({n} slot{'s' * (n > 1)}{how}, "
                f"ctx {self.state.n_ctx}, "
                f"spec {','.join(self.spec) or 'none'}, requests may use: {', '.join(self.spec_types)})")


def build(opt: ServeOptions, engines: list[Engine | SeqEngine]) -> Built:
    """The slots, the chat format, --spec-type auto's choice, the state and the app for options
    around engines (open_engines(opt.model, opt.params, opt.parallel)). Takes the engines over: on
    an error (a --chat-template that does not render) they are closed and the error raised."""
    from specrun.gguf_spec.registry import KNOWN_MODELS
    from specrun.kernels.chat_template import TemplateError

    from ..runtime.chat import ChatFormat
    from .app import ServerConfig, create_app
    from .limits import time_limited
    from .metrics import Metrics
    from .slots import SlotPool

    auto = opt.params.spec.types == AUTO
    pool = SlotPool(engines, opt.max_queue)
    if opt.params.placement is not None:   # a worker lost: fail those requests, keep answering (kernels/rpc.py)
        from specrun.kernels import rpc

        rpc.on_worker_lost(pool.worker_lost)
    try:
        model = engines[0].model
        params = engines[0].params
        fmt, reason = None, ""
        try:
            fmt = time_limited(lambda: ChatFormat.load(model, opt.chat_template, opt.chat_template_file))
        except TemplateError as e:
            if opt.chat_template or opt.chat_template_file:
                flag = "--chat-template" if opt.chat_template else "--chat-template-file"
                raise TemplateError(f"{flag} {opt.chat_template or opt.chat_template_file}: {e}") from None
            reason = str(e)
        spec_types = ["none", *engines[0].spec_types]
        if auto:
            params = resolve_auto_spec(engines, params, refresh=opt.auto_refresh)
        stem = os.path.splitext(os.path.basename(model.path))[0]
        config = ServerConfig(alias=opt.alias or (opt.model if opt.model in KNOWN_MODELS else stem),
                              sampling=opt.sampling, n_predict=opt.n_predict, spec=params.spec,
                              spec_types=tuple(spec_types), max_queue=opt.max_queue, api_key=opt.api_key,
                              chat_format=fmt, no_template_reason=reason, max_body=opt.max_body,
                              body_timeout=opt.body_timeout, drain_timeout=opt.drain_timeout,
                              prefill_assistant=opt.prefill_assistant, slots_endpoint=opt.slots_endpoint,
                              slots_debug=opt.slots_debug, model_path=opt.model, host=opt.host)
        state = ServerState(config, pool, Metrics(tuple(t for t in spec_types if t != "none")))
        app = create_app(state)
    except BaseException:
        pool.close()
        raise
    return Built(state, app, tuple(params.spec.types), tuple(spec_types), hasattr(engines[0], "owner"))


def resolve_auto_spec(engines: list[Engine | SeqEngine], params: EngineParams, *, refresh: bool = False) -> EngineParams:
    """--spec-type auto: measure on the first engine (batched slots: the engine that owns the
    model) and choose its spec types (runtime.auto), then give every slot that spec and the first
    engine's pass costs. refresh: measure again (no cached machine costs). Returns params with the
    spec chosen."""
    first = getattr(engines[0], "owner", engines[0])
    params = replace(params, spec=resolve_auto(first, params.spec, refresh=refresh))
    for e in engines:
        e.set_spec(params.spec)
    for e in engines:   # the calibration's pass costs, for every slot
        if e is not first:
            e.pass_cost = first.pass_cost.copy()
    return params


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
