"""`specrun serve` for the tests: in this process (InProcessServer), or as a process (ServerProcess).

In process, the server is cli/server's app built as `specrun serve` builds it: the same command
line parsed by serve's own click options (serve_cmd.serve_options), lifecycle's Gate, Loader and
uvicorn Server (make_server, with its drain), served by uvicorn in a thread on a socket bound to
127.0.0.1:0 (serve_cmd.listen_socket). Tests drive it with real clients (httpx, openai, anthropic)
over loopback, every request with a timeout (T). Only the engines differ: they are opened once per
pytest session (per xdist worker) for each model, engine options and -np, and handed from one
server to the next when the first stops (EngineCache). A server that stops drains as on SIGTERM
(handle_exit), then its thread is joined.

Use conftest's session fixture `servers` (a Servers):

    @pytest.fixture(scope="module")
    def server(servers):    # the same arguments in any module: the same server, for the session
        return servers.shared("-m", MODEL, "-c", "512", "-np", "2", "-n", "64")

    def test_no_slots(servers):    # a server of its own, stopped (drained) at the end of the block
        with servers.start("-m", MODEL, "-c", "256", "--no-slots", api_key="sk-1") as srv:
            assert srv.http.get("/slots").status_code == 501

A handle (both kinds) has url, api_key, http (an httpx.Client with the key), client() (openai),
post(path, body), completion(prompt, n, **fields) (greedy /completion, asserted 200) and
metrics() ({'name{labels}': value}), log(): what the server printed (in process: its start and
stop lines and the records of the `specrun` and `uvicorn` loggers while it ran, those of every
server then running in this process), and stopped(): the numbers of its `stopped` line.
InProcessServer also has state (its ServerState), signal() (what SIGTERM does: the drain) and stop().

ServerProcess runs `specrun serve` as a child process. Use it only for what is about the process:
signals (the SIGTERM drain, Ctrl-C), its exit code and stderr, a start that must show as the
process starts (the 503 `loading` while the model loads), packaging, RPC workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai

SPECRUN = str(Path(sys.executable).parent / "specrun")
T = 30.0   # seconds: the timeout of every request
MODEL = "smollm2-135m-instruct"
START_TIMEOUT = 120.0   # seconds: a bound on a server's start (loading included), however loaded the machine is
STOP_TIMEOUT = 900.0    # seconds: a bound on a stop's drain and join
ENV_OUT = ("SPECRUN_API_KEY", "SPECRUN_MODEL", "SPECRUN_HOST", "SPECRUN_PORT")   # not the tests' to set


def wait_for(what: str, pred: Callable[[], object], timeout: float = T):
    """Poll pred() until it returns something true (returned); fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def metric_sum(m: dict[str, float], name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, v in m.items():
        base, _, lab = key.partition("{")
        if base == name and all(f'{k}="{val}"' in lab for k, val in labels.items()):
            total += v
    return total


def delta(after: dict, before: dict, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


STOPPED = re.compile(r"stopped: (\d+) requests answered; at the signal (\d+) finished within the drain and "
                     r"(\d+) were interrupted \((\d+) during the prompt\); (\d+) queued and (\d+) new requests "
                     r"answered 503\n\Z")


class Handle:
    """What the tests use of a running server: its URL and clients."""

    url: str
    api_key: str | None
    http: httpx.Client

    def _connect(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.http = httpx.Client(base_url=self.url, timeout=T, headers=headers)

    def log(self) -> str:
        raise NotImplementedError

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", timeout=T, max_retries=0,
                             **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        return self.http.post(path, json=body, **kw)

    def completion(self, prompt, n: int = 16, **extra) -> dict:
        r = self.post("/completion", {"prompt": prompt, "n_predict": n, "temperature": 0, **extra})
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict[str, float]:
        """{'name{labels}': value} of every sample."""
        r = self.http.get("/metrics")
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("text/plain")
        out = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stopped(self) -> dict[str, int]:
        """The numbers of the server's last line, `specrun serve: stopped: ...`."""
        m = STOPPED.search(self.log())
        assert m, self.log()
        keys = ("answered", "finished", "interrupted", "in_prompt", "queued", "refused")
        return dict(zip(keys, map(int, m.groups()), strict=True))


# ---- in this process -------------------------------------------------------------------------------


@contextlib.contextmanager
def _without_env(names: tuple[str, ...]) -> Iterator[None]:
    saved = {k: os.environ.pop(k) for k in names if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def serve_options(args: tuple[str, ...]):
    """ServeOptions of `specrun serve --port 0 ARGS`, parsed and checked by serve's own options."""
    from specrun.cli.serve_cmd import serve, serve_options

    with _without_env(ENV_OUT):
        ctx = serve.make_context("serve", ["--port", "0", *args])
        return serve_options(**ctx.params)


class EngineCache:
    """Engines kept open across servers: a server takes a set for its model, engine options, -np and
    batching (opened if none is free) and gives it back when it stops. A batched set is -np views of
    one batched context (kernels/batch.py: SeqEngine), closed as engines are: the first last."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[list]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(opt) -> tuple:
        return opt.model, opt.params, opt.parallel, opt.cont_batching, opt.batch_threads

    def take(self, opt) -> list:
        from specrun.cli.server.lifecycle import load_engines

        with self._lock:
            free = self._free.get(self.key(opt))
            if free:
                return free.pop()
        return load_engines(opt)

    def give_back(self, opt, engines: list) -> None:
        with self._lock:
            self._free.setdefault(self.key(opt), []).append(engines)

    def close(self) -> None:
        with self._lock:
            sets = [s for free in self._free.values() for s in free]
            self._free.clear()
        for engines in sets:
            for e in reversed(engines):   # the first engine owns the shared model: closed last
                e.close()


class _Lines(logging.Handler):
    def __init__(self, lines: list[str]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


class InProcessServer(Handle):
    """`specrun serve --port 0 ARGS [--api-key KEY]` in a thread of this process (see the module's
    docstring). `statuses`: what /health answered until the first 200."""

    LOGGERS = ("specrun", "uvicorn.error")

    def __init__(self, *args: str, api_key: str | None = None, engines: EngineCache | None = None) -> None:
        from specrun.cli.serve_cmd import listen_socket
        from specrun.cli.server.lifecycle import Loader, make_server
        from specrun.cli.server.middleware import Gate

        self.api_key = api_key
        self.options = opt = serve_options((*args, *(["--api-key", api_key] if api_key else [])))
        self.statuses: list[tuple[int, dict]] = []
        self._engines = engines if engines is not None else EngineCache()
        self._lines: list[str] = []
        self._stopped = False
        self._signals = 0
        self._sock = listen_socket(opt.host, opt.port)
        self.url = f"http://{opt.host}:{self._sock.getsockname()[1]}"
        self._handler = _Lines(self._lines)
        for name in self.LOGGERS:
            logging.getLogger(name).addHandler(self._handler)
        gate = Gate()
        self.server = make_server(opt, gate)
        self.loader = Loader(opt, self.url, gate, self.server, engines=self._engines.take)
        self._lines.append(f"specrun serve: loading {opt.model} on {self.url}")
        self.loader.start()
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]},
                                       name="specrun-serve", daemon=True)
        self.thread.start()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self._lines.append(self.loader.built.ready_line(self.url))
        self._connect()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        with httpx.Client(timeout=T) as c:
            while time.monotonic() < deadline:
                if self.loader.error is not None:
                    raise RuntimeError(f"the server did not start: {self.loader.error}") from self.loader.error
                if not self.thread.is_alive():
                    raise RuntimeError(f"uvicorn stopped:\n{self.log()}")
                r = c.get(f"{self.url}/health")
                self.statuses.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return
                time.sleep(0.02)
        raise RuntimeError(f"the server not ready after {START_TIMEOUT} s:\n{self.log()}")

    @property
    def state(self):
        return self.loader.state

    def log(self) -> str:
        return "".join(line + "\n" for line in self._lines)

    def rss_kib(self) -> int:
        """This process's resident memory (the server's and the test's)."""
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))

    def signal(self) -> None:
        """What SIGTERM / Ctrl-C does to `specrun serve` (its handle_exit): the first drains (new
        requests 503, queued ones 503 at once, those in flight get --drain-timeout), then uvicorn
        stops; a second stops the generations in flight at once. stop() waits for the end."""
        self._signals += 1
        self.server.handle_exit(signal.SIGTERM, None)

    def stop(self) -> None:
        """Drain as on SIGTERM (unless signal() was called), let uvicorn shut down, join its thread,
        and give the engines back; the last line of log() is then serve's `stopped` line. Idempotent."""
        from specrun.cli.server.lifecycle import ended

        if self._stopped:
            return
        self._stopped = True
        if getattr(self, "http", None) is not None:
            self.http.close()
        if not self._signals:
            self.signal()
        self.thread.join(STOP_TIMEOUT)
        self.loader.join(STOP_TIMEOUT)
        alive = self.thread.is_alive() or self.loader.is_alive()
        self._sock.close()
        state = self.loader.state
        if state is not None:
            pool = state.pool
            pool.cancel_all()
            for t in list(pool.threads):
                t.join(STOP_TIMEOUT)
            end = ended(self.server, state)
            self._lines.append(f"specrun serve: stopped{': ' + end.stopped.line() if end.stopped else ''}")
            if pool.lost is None and not alive and not pool.threads:
                self._engines.give_back(self.options, [s.engine for s in pool.slots])
        for name in self.LOGGERS:
            logging.getLogger(name).removeHandler(self._handler)
        assert not alive, f"the server's threads did not end within {STOP_TIMEOUT} s"

    kill = stop

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Servers:
    """The in-process servers of a pytest session (conftest's `servers`), over one EngineCache."""

    def __init__(self) -> None:
        self.engines = EngineCache()
        self._shared: dict[tuple, InProcessServer] = {}

    def shared(self, *args: str, api_key: str | None = None) -> InProcessServer:
        """The server for these arguments, started on first use and shared by every test of the
        session that asks for the same ones; stopped when the session ends."""
        key = (args, api_key)
        if key not in self._shared:
            self._shared[key] = InProcessServer(*args, api_key=api_key, engines=self.engines)
        return self._shared[key]

    def start(self, *args: str, api_key: str | None = None) -> InProcessServer:
        """A server of the caller's own (stop() it, or use it in a with block)."""
        return InProcessServer(*args, api_key=api_key, engines=self.engines)

    def close(self) -> None:
        try:
            for srv in self._shared.values():
                srv.stop()
        finally:
            self._shared.clear()
            self.engines.close()


# ---- as a process ----------------------------------------------------------------------------------


class ServerProcess(Handle):
    """`specrun serve --port 0 ARGS` as a subprocess; its stderr goes to a log file, from which the
    bound port is read. `statuses`: what /health answered while the model loaded."""

    def __init__(self, log_dir: Path, *args: str, api_key: str | None = None) -> None:
        self.log_path = log_dir / "server.log"
        self.api_key = api_key
        self.statuses: list[tuple[int, dict]] = []
        env = {k: v for k, v in os.environ.items() if k not in ("SPECRUN_API_KEY", "SPECRUN_MODEL")}
        cmd = [SPECRUN, "serve", "--port", "0", *args, *(["--api-key", api_key] if api_key else [])]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                         env=env)
        try:
            self.url = self._wait_ready(timeout=START_TIMEOUT)
        except BaseException:
            self.kill()
            raise
        self._connect()

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specrun serve exited with {self.proc.returncode}:\n{self.log()}")
            if url is None and (m := re.search(r"on (http://127\.0\.0\.1:\d+)", self.log())):
                url = m.group(1)
            if url is not None:
                r = httpx.get(f"{url}/health", timeout=T)   # bound and listening from the first line on
                self.statuses.append((r.status_code, r.json()))
                if r.status_code == 200:
                    return url
            time.sleep(0.02)
        raise RuntimeError(f"specrun serve not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rss_kib(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1))

    def terminate(self, timeout: float = 20) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
