"""`specrun serve` under faults on 127.0.0.1 (SmolLM2-135M), in this process (tests/serving.py) and,
for SIGTERM and the start-up's exit codes, as a process; every request with a timeout and every
wait on an event (/metrics, /health, the order of answers, the server's log):

- SIGTERM loses no answer: the requests in flight finish within the drain, the queued and the new
  ones get 503 at once, the process exits 0; past --drain-timeout, long prompts are stopped at the
  next chunk and answered with a JSON 503 / an SSE error event and [DONE];
- abandoned work is dropped: a queued request whose client leaves never runs, and a client that
  leaves during a long prompt stops it at a chunk boundary;
- the event loop stays responsive while a 5 MB prompt is tokenized; bodies above --max-body get 413,
  bodies stalled past --body-timeout get 408 and the connection closed;
- a --chat-template that does not render, or runs too long, stops the start with one line; an
  empty API key too.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import threading
import time

import httpx
import pytest
from click.testing import CliRunner
from serving import MODEL, SPECRUN, Handle, ServerProcess, T, delta, wait_for

pytestmark = pytest.mark.slow

CHUNK = 512        # a long prompt's block (kernels/prefill.BLOCK), as the exact path's chunks
LONG_IDS = [(i * 7919) % 40000 + 100 for i in range(1100)]     # a prompt of 1100 tokens: 3 chunks
GEN_TIMEOUT = 900.0   # seconds: a bound on a whole generation, however loaded the machine is


def host_port(srv: Handle) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def raw_post(srv: Handle, path: str, body: bytes, content_length: int | None = None) -> socket.socket:
    """A POST sent over a socket of its own (so the test can close it, or leave the body unfinished)."""
    host, port = host_port(srv)
    s = socket.create_connection((host, port), timeout=T)
    n = len(body) if content_length is None else content_length
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {n}\r\n\r\n".encode() + body)
    return s


def read_all(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


@pytest.fixture(scope="module")
def faults(servers):
    with servers.start("-m", MODEL, "-c", "2048", "-np", "1", "-t", "1", "--queue", "2", "-n", "400",
                       "--body-timeout", "2") as srv:
        yield srv


# ---- a responsive event loop, bounded bodies -------------------------------------------------------


@pytest.mark.full     # make test: tests/test_server_loop.py
def test_health_answers_while_a_5mb_prompt_is_tokenized(faults):
    """Tokenizing 5 MB takes seconds; it runs in a worker thread, so /health keeps answering meanwhile.
    /metrics' requests_preparing says when the server is tokenizing: only /health round trips with
    that gauge at 1 before and after count. (On the event loop, /health waited 2.8 s.)"""
    big: dict[str, object] = {}

    def send() -> None:
        r = httpx.post(faults.url + "/v1/completions", timeout=4 * T,
                       json={"prompt": "hello world " * (5_000_000 // 12), "max_tokens": 1})
        big.update(status=r.status_code, error=r.json()["error"])

    th = threading.Thread(target=send)
    th.start()
    wait_for("the 5 MB prompt being tokenized", lambda: faults.metrics()["specrun_requests_preparing"] == 1, 2 * T)
    during: list[float] = []
    with httpx.Client(base_url=faults.url, timeout=T) as c:
        while faults.metrics()["specrun_requests_preparing"] == 1:
            t = time.perf_counter()
            assert c.get("/health").status_code == 200
            took = time.perf_counter() - t
            if faults.metrics()["specrun_requests_preparing"] == 1:
                during.append(took)
    th.join(4 * T)
    assert big["status"] == 400 and big["error"]["code"] == "context_length_exceeded"
    assert "(833333 tokens, ctx 2048)" in big["error"]["message"]
    print(f"/health while tokenizing 5 MB: {len(during)} answers, median {statistics.median(during) * 1e3:.1f} ms, "
          f"max {max(during) * 1e3:.0f} ms")
    assert len(during) >= 3     # answered while the prompt was being tokenized: the loop was free


def test_body_above_max_body_is_413(faults):
    limit = 8 << 20
    r = faults.http.post("/v1/completions", content=b" " * (limit + 1), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.headers["connection"] == "close"
    assert r.json()["error"] == {"message": f"the request body is {limit + 1} bytes, above this server's limit of "
                                            f"{limit} (--max-body)", "type": "invalid_request_error",
                                 "code": "body_too_large"}

    def chunked():       # no Content-Length: counted as it arrives
        for _ in range(9):
            yield b" " * (1 << 20)

    r = faults.http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("the request body is more than ")
    assert faults.completion("The capital of France is", 2)["tokens_predicted"] == 2


def test_stalled_bodies_time_out_and_close(faults):
    """20 connections send 10 of the 1000 body bytes they announce, then nothing: each is answered 408
    after --body-timeout (2 s) and closed by the server."""
    socks = [raw_post(faults, "/v1/completions", b'{"prompt": ', content_length=1000) for _ in range(20)]
    try:
        answers = [read_all(s) for s in socks]     # returns once the server closes the connection
    finally:
        for s in socks:
            s.close()
    for a in answers:
        head, _, body = a.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 ")
        assert json.loads(body)["error"] == {"message": "the request body did not arrive within 2 s (--body-timeout): "
                                                        "got 11 of 1000 bytes", "type": "invalid_request_error",
                                             "code": "body_timeout"}
    assert faults.http.get("/health").status_code == 200


# ---- abandoned work --------------------------------------------------------------------------------


def test_queued_request_whose_client_leaves_never_runs(faults):
    before = faults.metrics()
    hold = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 400, "temperature": 0, "stream": True}
    with faults.http.stream("POST", "/v1/completions", json=hold) as stream:
        lines = stream.iter_lines()     # kept: a generator dropped would close the stream
        next(line for line in lines if line.startswith("data: "))      # the one slot is taken
        s = raw_post(faults, "/v1/completions", b'{"prompt": "The capital of France is", "max_tokens": 4}')
        wait_for("the request waiting", lambda: faults.metrics()["specrun_requests_waiting"] == 1)
        s.close()
        m = wait_for("the request gone from the queue", lambda: (m := faults.metrics())
                     and m["specrun_requests_waiting"] == 0 and m)
        assert delta(m, before, "specrun_requests_abandoned_total") == 1
        assert m["specrun_slots_busy"] == 1                      # the stream still has the slot
    m = wait_for("the stream's run over", lambda: (m := faults.metrics()) and m["specrun_slots_busy"] == 0
                 and delta(m, before, "specrun_requests_total") == 1 and m)
    assert delta(m, before, "specrun_requests_interrupted_total") == 1      # the stream; the other never ran
    assert delta(m, before, "specrun_requests_abandoned_total") == 1
    assert delta(m, before, "specrun_errors_total") == 0


def test_disconnect_mid_stream_frees_the_slot(faults):
    """A stream whose client leaves after 5 events: its run is interrupted and its slot freed (400
    tokens asked: on a loaded machine the client's close must land before the run ends)."""
    before = faults.metrics()
    with faults.http.stream("POST", "/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 400,
                                                             "temperature": 0, "stream": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 4:
                break
    m = wait_for("the stream's run interrupted and its slot free", lambda: (m := faults.metrics())
                 and m["specrun_slots_busy"] == 0 and delta(m, before, "specrun_requests_interrupted_total") == 1
                 and m)
    assert delta(m, before, "specrun_tokens_generated_total") < 400
    assert faults.completion("The capital of France is", 4)["tokens_predicted"] >= 1


@pytest.mark.full
def test_client_leaving_during_the_prompt_stops_it_at_a_chunk_boundary(faults):
    """A client leaves while its 1100-token prompt is being evaluated: the engine stops at the end of
    the chunk in progress, before any token; the chunks evaluated stay in the slot's cache, so the
    same prompt again reuses a whole number of chunks, and fewer than all of its tokens."""
    before = faults.metrics()
    s = raw_post(faults, "/completion", json.dumps({"prompt": LONG_IDS, "n_predict": 8}).encode())
    wait_for("the prompt on the slot", lambda: faults.http.get("/health").json()["slots_processing"] == 1)
    s.close()
    # the chunk in progress (512 tokens) ends first: bounded by a whole generation's time, not a request's
    m = wait_for("the run stopped", lambda: (m := faults.metrics()) and m["specrun_slots_busy"] == 0
                 and delta(m, before, "specrun_requests_interrupted_total") == 1 and m, GEN_TIMEOUT)
    assert delta(m, before, "specrun_tokens_generated_total") == 0
    r = faults.post("/completion", {"prompt": LONG_IDS, "n_predict": 1, "temperature": 0}, timeout=GEN_TIMEOUT)
    assert r.status_code == 200, r.text
    again = r.json()
    cached = again["tokens_cached"]
    print(f"the prompt stopped after {cached} of {len(LONG_IDS)} tokens")
    assert cached % CHUNK == 0 and CHUNK <= cached < len(LONG_IDS) - 1
    assert again["timings"]["prompt_n"] == len(LONG_IDS) - cached


# ---- SIGTERM -------------------------------------------------------------------------------------


class Requests:
    """Requests in threads; each answer is kept with its place in the order of answers."""

    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.out: dict[str, tuple[int, dict, str]] = {}
        self.order: list[str] = []
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def post(self, name: str, path: str, body: dict) -> None:
        def go() -> None:
            with httpx.Client(base_url=self.srv.url, timeout=GEN_TIMEOUT) as c, c.stream("POST", path, json=body) as r:
                raw = r.read().decode()
            with self._lock:
                self.out[name] = (r.status_code, dict(r.headers), raw)
                self.order.append(name)

        self.threads.append(threading.Thread(target=go))
        self.threads[-1].start()

    def join(self) -> None:
        for t in self.threads:
            t.join(GEN_TIMEOUT)
            assert not t.is_alive()


def events(raw: str) -> list[str]:
    return [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]


def test_sigterm_drains_in_flight_and_refuses_the_rest(tmp_path):
    """Two requests generating, two queued: SIGTERM. The queued get 503 at once (before the others
    finish), a new request gets 503, the two in flight finish whole (the stream and the JSON answer
    have the same text), and the process exits 0 with its count of each."""
    # a drain long enough for 400 tokens however loaded the machine is: the two in flight finish whole
    srv = ServerProcess(tmp_path, "-m", MODEL, "-c", "512", "-np", "2", "-t", "1", "--queue", "2", "-n", "400",
                        "--drain-timeout", "900")
    try:
        req = Requests(srv)
        # 400 tokens: the two in flight outlast the test's setup around them on a loaded 2-core machine
        body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 400, "temperature": 0}
        req.post("json", "/v1/completions", body)
        req.post("stream", "/v1/completions", {**body, "stream": True})
        wait_for("both on a slot", lambda: srv.metrics()["specrun_slots_busy"] == 2)
        req.post("queued-chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        req.post("queued-llama", "/completion", {"prompt": "hi", "n_predict": 4})
        wait_for("both queued", lambda: srv.metrics()["specrun_requests_waiting"] == 2)
        srv.proc.send_signal(15)
        wait_for("the drain begun", lambda: srv.http.get("/health").status_code == 503)
        new = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=T)
        req.join()
        assert srv.proc.wait(T) == 0
    finally:
        srv.kill()
    assert new.status_code == 503 and new.headers["connection"] == "close"
    assert new.json()["error"] == {"message": "the server is shutting down and takes no new requests",
                                   "type": "unavailable_error", "code": "shutting_down"}
    for name in ("queued-chat", "queued-llama"):
        status, _, raw = req.out[name]
        assert status == 503 and json.loads(raw)["error"]["code"] == "shutting_down"
        assert "waiting for a slot and was not started" in json.loads(raw)["error"]["message"]
    assert set(req.order[:2]) == {"queued-chat", "queued-llama"}       # answered before the two in flight
    status, _, raw = req.out["json"]
    answer = json.loads(raw)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 400
    status, headers, raw = req.out["stream"]
    ev = events(raw)
    assert status == 200 and ev[-1] == "[DONE]"
    chunks = [json.loads(e) for e in ev[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    assert "Traceback" not in srv.log()
    assert srv.stopped() == {"answered": 2, "finished": 2, "interrupted": 0, "in_prompt": 0, "queued": 2,
                             "refused": 1}


@pytest.mark.full
def test_sigterm_stops_long_prompts_after_the_drain_timeout(tmp_path):
    """Two long prompts being evaluated and one queued request: SIGTERM with --drain-timeout 1. The
    queued one gets 503 at once; after the drain the prompts are stopped at their chunk in progress
    (before a chunk of 512 tokens is through: seconds here) and answered with a JSON 503 and with an
    SSE error event then [DONE]; the process exits 0 without a traceback."""
    srv = ServerProcess(tmp_path, "-m", MODEL, "-c", "2048", "-np", "2", "-t", "1", "--queue", "1",
                        "--drain-timeout", "1")
    try:
        req = Requests(srv)
        req.post("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "alpha beta " * 500}],
                                                  "max_tokens": 8})
        req.post("stream", "/v1/completions", {"prompt": LONG_IDS, "max_tokens": 8, "stream": True})
        wait_for("both prompts on a slot", lambda: srv.http.get("/health").json()["slots_processing"] == 2)
        req.post("queued", "/completion", {"prompt": "hi", "n_predict": 4})
        wait_for("one queued", lambda: srv.metrics()["specrun_requests_waiting"] == 1)
        srv.proc.send_signal(15)
        req.join()
        assert srv.proc.wait(T) == 0
    finally:
        srv.kill()
    assert req.order[0] == "queued" and req.out["queued"][0] == 503
    stopped = {"message": "the server is shutting down: this generation was stopped during the prompt when the "
                          "drain timeout (--drain-timeout) expired; retry on another server",
               "type": "unavailable_error", "code": "shutting_down"}
    status, _, raw = req.out["chat"]
    assert status == 503 and json.loads(raw) == {"error": stopped}
    status, _, raw = req.out["stream"]
    assert status == 200 and events(raw) == [json.dumps({"error": stopped}), "[DONE]"]
    log = srv.log()
    assert "Traceback" not in log and "Event loop is closed" not in log
    assert srv.stopped() == {"answered": 0, "finished": 0, "interrupted": 2, "in_prompt": 2, "queued": 1,
                             "refused": 0}


# ---- start-up checks ------------------------------------------------------------------------------


@pytest.mark.parametrize("source,says", [
    ("{% for m in messages %}{{ m.content }", "is not valid Jinja"),
    ("{{ messages.__class__.__mro__ }}", "tried an unsafe operation"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "ran past its time limit of 2 s"),
], ids=["syntax", "unsafe", "endless"])
def test_a_chat_template_that_fails_stops_the_start(tmp_path, source, says):
    path = tmp_path / "t.jinja"
    path.write_text(source)
    r = subprocess.run([SPECRUN, "serve", "--port", "0", "-m", MODEL, "-c", "256", "--chat-template", str(path)],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=4 * T)
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: --chat-template {path}: the chat template ") and says in last
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args,env", [(["--api-key", ""], {}), (["--api-key", "  "], {}),
                                      ([], {"SPECRUN_API_KEY": ""})], ids=["flag", "blank", "env"])
def test_an_empty_api_key_is_an_error(args, env):
    from specrun.cli.main import cli

    r = CliRunner().invoke(cli, ["serve", "--port", "0", "-m", MODEL, *args], env=env)
    assert r.exit_code == 1
    assert r.output.splitlines() == ["Error: the API key is empty (--api-key or SPECRUN_API_KEY); give a key, or "
                                     "leave both out to serve without one"]


def test_chat_template_file_and_builtin_names_as_llama_server(servers, tmp_path, smollm_path):
    """serve takes llama-server's --chat-template NAME|JINJA, --chat-template-file FILE and
    --jinja; a chat request's prompt is the one that template renders (SmolLM2's own template
    would add its default system message: other token counts)."""
    from specrun.cli.runtime.chat import ChatFormat
    from specrun.kernels.llama import Model

    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    messages = [{"role": "user", "content": "hi"}]
    cases = ((["--chat-template-file", str(path), "--jinja"], None, str(path), "[user] hi\n[assistant] "),
             (["--chat-template", "chatml"], "chatml", None, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))
    with Model(str(smollm_path)) as model:
        own = len(ChatFormat.load(model).prompt(messages)[0])
        for args, name, file, text in cases:
            toks, rendered = ChatFormat.load(model, name, file).prompt(messages)
            assert rendered == text and len(toks) != own
            with servers.start("-m", MODEL, "-c", "256", *args) as srv:
                r = srv.http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1,
                                                                 "temperature": 0})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["prompt_tokens"] == len(toks), args
    r = subprocess.run([SPECRUN, "serve", "--port", "0", "-m", MODEL, "-c", "256", "--chat-template", "chatml",
                        "--chat-template-file", str(path)], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=4 * T)
    assert r.returncode == 2 and "not both" in r.stderr and "Traceback" not in r.stderr
