"""The server's event loop stays free, its limits, the Host check and the request log.

A heavy step (parsing and validating a body, tokenizing, detokenizing, compiling a grammar or a
schema) is held inside its worker by a hook, so that the request is provably in flight while
/health answers; the hook also records the thread it ran on, which is never the event loop's
(the server's thread). No test here measures a time: benchmarks/server_loop.py does.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
from pydantic_core import PydanticCustomError
from serving import MODEL, T, wait_for
from test_server_units import asgi, echo

from specrun.cli.server import middleware, routes_llama, schemas
from specrun.cli.server import state as state_mod
from specrun.cli.server.errors import ApiError
from specrun.cli.server.limits import (
    MAX_GRAMMAR_BYTES,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_TEXTS,
    MAX_SCHEMA_BYTES,
    PREPARE_THREADS,
)
from specrun.cli.server.metrics import Metrics
from specrun.cli.server.middleware import Guard, host_allowed, is_loopback
from specrun.cli.server.state import ServerState

ARGS = ("-m", MODEL, "-c", "512", "-np", "2", "-n", "64")   # test_server.py's: the same shared server


@pytest.fixture(scope="module")
def server(servers):
    return servers.shared(*ARGS)


class Hook:
    """fn wrapped: each call records its thread and sets `entered`; off the loop thread it then
    waits for `release` (on the loop it would freeze the server: it goes on, and the test fails on
    the thread)."""

    def __init__(self, fn, loop_thread: threading.Thread) -> None:
        self.fn, self.loop_thread = fn, loop_thread
        self.entered, self.release = threading.Event(), threading.Event()
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    @property
    def n_waiting(self) -> int:
        with self._lock:
            return sum(t is not self.loop_thread for t in self.threads)

    def __call__(self, *args, **kw):
        me = threading.current_thread()
        with self._lock:
            self.threads.append(me)
        self.entered.set()
        if me is not self.loop_thread:
            self.release.wait(T)
        return self.fn(*args, **kw)


def post(server, path: str, body) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=T) as c:
        return c.post(path, json=body)


GREEDY = {"prompt": "The capital of France is", "n_predict": 2, "temperature": 0}

# (what is hooked: the model's method or a module's function, its name, the endpoint, the body)
HEAVY = {
    "parse the body": (middleware, "_parse", "/detokenize", {"tokens": [1, 2, 3]}),
    "validate the body": (schemas, "logit_bias_pairs", "/completion", {**GREEDY, "logit_bias": {"15": 1.0}}),
    "detokenize": ("model", "piece", "/detokenize", {"tokens": [504, 3575, 282]}),
    "tokenize with pieces": ("model", "piece", "/tokenize", {"content": "Hello world", "with_pieces": True}),
    "logit_bias texts": ("model", "tokenize", "/completion", {**GREEDY, "logit_bias": {" Paris": -5}}),
    "compile a grammar": (state_mod, "Grammar", "/completion", {**GREEDY, "grammar": 'root ::= " Paris" | " Lyon"'}),
    "encode /tokenize's answer": (routes_llama, "_json", "/tokenize", {"content": "Hello", "with_pieces": True}),
    "compile a json_schema": (state_mod, "schema_to_gbnf", "/completion",
                              {**GREEDY, "json_schema": {"type": "object", "properties": {"a": {"enum": ["x"]}}}}),
}


@pytest.mark.parametrize("case", list(HEAVY))
def test_health_answers_while_a_heavy_step_runs_in_a_worker(server, monkeypatch, case):
    where, name, path, body = HEAVY[case]
    obj = server.state.model if where == "model" else where
    hook = Hook(getattr(obj, name), server.thread)
    monkeypatch.setattr(obj, name, hook)
    with ThreadPoolExecutor(1) as pool:
        heavy = pool.submit(post, server, path, body)
        try:
            assert hook.entered.wait(T), f"{case}: the hooked step never ran"
            assert hook.threads[0] is not server.thread, f"{case} ran on the event loop's thread"
            health = server.http.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert not heavy.done()          # /health answered while the heavy request was held in its worker
        finally:
            hook.release.set()
        r = heavy.result(T)
    assert r.status_code == 200, r.text
    assert server.thread not in hook.threads


def test_the_workers_are_bounded_and_the_loop_stays_free_when_all_are_busy(server, monkeypatch):
    """PREPARE_THREADS requests are held in their workers; one more waits for a worker (the
    limiter counts it), and /health still answers; once released, all three answer."""
    model = server.state.model
    hook = Hook(model.piece, server.thread)
    monkeypatch.setattr(model, "piece", hook)
    limiter = server.state.limiter
    n = PREPARE_THREADS + 1
    with ThreadPoolExecutor(n) as pool:
        futs = [pool.submit(post, server, "/detokenize", {"tokens": [504, 3575]}) for _ in range(n)]
        try:
            wait_for("the workers busy and one request waiting",
                     lambda: hook.n_waiting == PREPARE_THREADS and limiter.statistics().tasks_waiting == 1)
            assert limiter.statistics().borrowed_tokens == PREPARE_THREADS
            assert server.http.get("/health").status_code == 200
            assert not any(f.done() for f in futs)
        finally:
            hook.release.set()
        texts = {f.result(T).json()["content"] for f in futs}
    assert len(texts) == 1 and server.thread not in hook.threads


def test_large_answers_are_made_and_encoded_off_the_loop(server, monkeypatch):
    """/detokenize's and /tokenize's answers are encoded in a worker, in parts (bulk), not on the
    loop; their bytes are those JSONResponse would write."""
    from fastapi.responses import JSONResponse

    from specrun.cli.server import bulk

    seen: list[tuple[str, threading.Thread]] = []
    for name in ("json_string", "json_array"):
        real = getattr(bulk, name)
        monkeypatch.setattr(bulk, name, lambda *a, _real=real, _name=name: (
            seen.append((_name, threading.current_thread())), _real(*a))[1])
    monkeypatch.setattr(bulk, "STEP", 7)            # several parts even for these short answers
    monkeypatch.setattr(bulk, "TEXT_STEP", 5)
    r = post(server, "/detokenize", {"tokens": [504, 3575, 282, 0, 2] * 100})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.content == JSONResponse(r.json()).body and "<|im_end|>" in r.json()["content"]
    r = post(server, "/tokenize", {"content": "Hello world \u00e9\u6771<|im_end|>" * 50, "with_pieces": True})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    pieces = r.json()["tokens"]
    assert len(pieces) >= 250 and pieces[0]["piece"] == "Hello" and any(isinstance(p["piece"], list) for p in pieces)
    assert r.content == JSONResponse(r.json()).body
    plain = post(server, "/tokenize", {"content": "Hello world"})
    assert plain.content == JSONResponse({"tokens": [p["id"] for p in pieces[:2]]}).body
    assert post(server, "/tokenize", {"content": ""}).content == b'{"tokens":[]}'
    assert [n for n, _ in seen] == ["json_string", "json_array", "json_array", "json_array"]
    assert server.thread not in {t for _, t in seen}


@pytest.mark.parametrize("value", [
    {}, [], "h\u00e9\n\"x\"", {"a": [1, 2.5, None, True], "b": {"c": [[7, False]] * 40}},
    {"choices": [{"text": "x", "logprobs": {"content": [{"id": i, "logprob": -0.5} for i in range(30)]}}]},
    [[1, 2]] * 70, {1: "an int key"}, ("a", "b")])
def test_json_value_writes_jsonresponses_bytes(monkeypatch, value):
    """Any answer, in parts (JSON_STEP 7: the 40 pairs go in 6 calls), has JSONResponse's bytes."""
    from fastapi.responses import JSONResponse

    from specrun.cli.server import bulk

    monkeypatch.setattr(bulk, "JSON_STEP", 7)
    parts = bulk.json_value(value)
    assert b"".join(parts) == JSONResponse(value).body
    if isinstance(value, dict) and "b" in value:
        assert len(parts) > 6


def test_a_completion_answer_is_encoded_in_parts_off_the_loop(server, monkeypatch):
    """A /completion answer (its generation_settings echo every logit_bias pair) is encoded in a
    worker, in parts, with JSONResponse's bytes."""
    from fastapi.responses import JSONResponse

    from specrun.cli.server import bulk

    seen: list[threading.Thread] = []
    real = bulk.json_value
    monkeypatch.setattr(bulk, "json_value", lambda v: (seen.append(threading.current_thread()), real(v))[1])
    monkeypatch.setattr(bulk, "JSON_STEP", 7)
    bias = [[t, -1.0] for t in range(100, 140)]
    r = post(server, "/completion", {"prompt": "Hello", "n_predict": 2, "logit_bias": bias})
    assert r.status_code == 200, r.text
    assert r.json()["generation_settings"]["logit_bias"] == bias
    assert r.content == JSONResponse(r.json()).body
    assert seen and server.thread not in seen


def test_the_loaded_server_is_frozen_for_the_garbage_collector(server):
    import gc

    assert gc.get_freeze_count() > 0


# ---- long lists are validated in chunks -------------------------------------------------------------


@pytest.mark.parametrize("value", [
    [7] * 10, [7] * 9 + ["x"], [7, 7, True, 7, 7, 7, 1.0, 7, 7, 7, None], ["x"] * 10, "7", [],
])
def test_a_chunked_list_validates_as_the_plain_list(monkeypatch, value):
    """The same value or the same errors (each placed in the whole list) as list[int], chunks of 4."""
    from pydantic import ConfigDict, TypeAdapter, ValidationError

    monkeypatch.setattr(schemas, "LIST_CHUNK", 4)
    plain = TypeAdapter(list[int], config=ConfigDict(strict=True))
    mine = TypeAdapter(schemas.chunked(int))
    try:
        want = plain.validate_python(value)
    except ValidationError as e:
        with pytest.raises(ValidationError) as got:
            mine.validate_python(value)
        errs = e.errors(include_url=False)
        if len(value) > 4:    # a long list stops at its first chunk with errors
            errs = [err for err in errs if err["loc"][0] // 4 == errs[0]["loc"][0] // 4]
        assert got.value.errors(include_url=False) == errs
    else:
        assert mine.validate_python(value) == want


def test_the_server_places_an_error_in_a_long_list(server):
    n = schemas.LIST_CHUNK
    tokens = [504] * (3 * n)
    tokens[2 * n + 3] = "x"
    r = post(server, "/detokenize", {"tokens": tokens})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == f"tokens.{2 * n + 3}: Input should be a valid integer"
    tokens[2 * n + 3] = 504
    r = post(server, "/detokenize", {"tokens": tokens})
    assert r.status_code == 200 and r.json()["content"] == post(server, "/detokenize", {"tokens": [504]}).json()[
        "content"] * (3 * n)


# ---- size limits -------------------------------------------------------------------------------------


def _kib(n: int) -> str:
    return f"{n} bytes ({n / 1024:.0f} KiB)"


BIG_GRAMMAR = "root ::= " + " | ".join(f'"w{i:06d}"' for i in range(MAX_GRAMMAR_BYTES // 10 + 1))
BIG_ENUM = {"type": "string", "enum": [f"value-{i:07d}" for i in range(MAX_SCHEMA_BYTES // 15 + 1)]}


@pytest.mark.parametrize("field,value,message", [
    ("grammar", BIG_GRAMMAR, f"grammar: {_kib(len(BIG_GRAMMAR))}, above this server's limit of "
                             f"{_kib(MAX_GRAMMAR_BYTES)}; send a smaller grammar"),
    ("json_schema", BIG_ENUM, f"json_schema: the schema is {_kib(len(json.dumps(BIG_ENUM, separators=(',', ':'))))} "
                              f"as compact JSON, above this server's limit of {_kib(MAX_SCHEMA_BYTES)}"),
    ("response_format", {"type": "json_object", "schema": BIG_ENUM}, "response_format: the schema is "),
    ("logit_bias", [[i % 1000, 0.5] for i in range(MAX_LOGIT_BIAS + 1)],
     f"logit_bias: {MAX_LOGIT_BIAS + 1} entries, above this server's limit of {MAX_LOGIT_BIAS}; bias fewer tokens"),
    ("logit_bias", {f"w{i}": -1 for i in range(MAX_LOGIT_BIAS_TEXTS + 1)},
     f"logit_bias: {MAX_LOGIT_BIAS_TEXTS + 1} texts to tokenize, above this server's limit of {MAX_LOGIT_BIAS_TEXTS}"),
])
def test_sizes_above_the_limits_are_a_400_naming_the_limit_and_the_size(server, field, value, message):
    r = post(server, "/completion", {**GREEDY, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_value")
    assert err["message"].startswith(message), err["message"]


def test_sizes_at_the_limits_are_accepted():
    """The bounds themselves pass (unit: no model needed)."""
    ServerState.check_grammar_size("grammar", "x" * MAX_GRAMMAR_BYTES)
    with pytest.raises(ApiError, match=r"grammar: 524289 bytes \(512 KiB\), above this server's limit of 524288"):
        ServerState.check_grammar_size("grammar", "x" * (MAX_GRAMMAR_BYTES + 1))
    with pytest.raises(ApiError, match="json_schema: the schema makes a grammar of 524289 bytes"):
        ServerState.check_grammar_size("json_schema", "x" * (MAX_GRAMMAR_BYTES + 1), made=True)
    fits = {"enum": ["x" * (MAX_SCHEMA_BYTES - len('{"enum":[""]}'))]}
    assert len(ServerState.schema_text("json_schema", fits)) == MAX_SCHEMA_BYTES
    assert len(schemas.logit_bias_pairs([[7, 1.0]] * MAX_LOGIT_BIAS)) == MAX_LOGIT_BIAS
    assert len(schemas.logit_bias_pairs({f"w{i}": 1 for i in range(MAX_LOGIT_BIAS_TEXTS)})) == MAX_LOGIT_BIAS_TEXTS
    with pytest.raises(PydanticCustomError, match="entries, above"):
        schemas.logit_bias_pairs([[7, 1.0]] * (MAX_LOGIT_BIAS + 1))


# ---- the Host header -----------------------------------------------------------------------------


@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1", True), ("127.0.0.1:8080", True), ("localhost", True), ("LOCALHOST:80", True), ("localhost.", True),
    ("[::1]", True), ("[::1]:8080", True), ("127.0.0.2:1", True), ("app.localhost:3000", True),
    ("evil.example", False), ("evil.example:8080", False), ("127.0.0.1.evil.example", False), ("::1", False),
    ("[::1]x", False), ("localhost:80:80", False), ("192.168.1.7:8080", False), ("", False), ("[::1", False),
])
def test_host_allowed_names_loopback_with_or_without_a_port(host, ok):
    assert host_allowed(host, "127.0.0.1") is ok


def test_host_allowed_also_takes_the_name_the_server_was_started_with():
    assert host_allowed("myhost:8080", "myhost") and not host_allowed("other:8080", "myhost")


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("localhost", True), ("::1", True), ("[::1]", True),
                                           ("127.0.0.5", True), ("0.0.0.0", False), ("::", False),
                                           ("192.168.1.7", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def _guard(host: str, api_key: str | None = None, lines: list | None = None) -> Guard:
    cfg = SimpleNamespace(api_key=api_key, max_body=1000, body_timeout=1.0, host=host)
    return Guard(echo, SimpleNamespace(config=cfg, metrics=Metrics(()), stopping=False, n_refused=0),
                 log_line=(lines if lines is not None else []).append)


def _call(guard: Guard, host: str, path: str = "/v1/completions", method: str = "POST", extra=()):
    return asyncio.run(asgi(guard, method, path, headers=(("Host", host), *extra),
                            body_parts=(b"{}",) if method == "POST" else ()))


def test_guard_on_loopback_without_a_key_refuses_other_hosts_with_a_403_naming_the_fix():
    g = _guard("127.0.0.1")
    status, _, body = _call(g, "evil.example:8080")
    assert status == 403
    err = json.loads(body)["error"]
    assert (err["type"], err["code"]) == ("permission_error", "host_not_allowed")
    assert err["message"] == (
        "the Host header 'evil.example:8080' does not name this server: it listens on 127.0.0.1 without an API key, "
        "so it answers only Host localhost, 127.0.0.1, [::1] (any port), against DNS rebinding; reach it by one of "
        "those, or start it with --api-key KEY (or --host 0.0.0.0, which accepts any Host)")
    assert _call(g, "localhost:8080")[0] == 200
    assert _call(g, "[::1]:8080")[0] == 200
    assert _call(g, "evil.example", "/health", "GET")[0] == 200       # the health checks: any Host
    assert asyncio.run(asgi(g, headers=()))[0] == 200                  # no Host (HTTP/1.0): not a browser


@pytest.mark.parametrize("host,key,extra", [
    ("0.0.0.0", None, ()), ("::", None, ()), ("192.168.1.7", None, ()),
    ("127.0.0.1", "k", (("Authorization", "Bearer k"),)), ("", None, ()),
])
def test_guard_with_a_key_or_off_loopback_accepts_any_host(host, key, extra):
    assert _call(_guard(host, key), "evil.example:8080", extra=extra)[0] == 200


def test_guard_names_an_ipv6_or_named_host_it_was_started_with():
    msg = json.loads(_call(_guard("::1"), "evil.example")[2])["error"]["message"]
    assert "answers only Host localhost, 127.0.0.1, [::1] (any port)" in msg
    msg = json.loads(_call(_guard("127.0.0.2"), "evil.example")[2])["error"]["message"]
    assert "answers only Host localhost, 127.0.0.1, [::1], 127.0.0.2 (any port)" in msg


def test_the_server_checks_the_host_header(server):
    r = server.http.get("/v1/models", headers={"Host": "attacker.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    assert server.http.get("/v1/models", headers={"Host": "localhost"}).status_code == 200
    assert server.http.get("/health", headers={"Host": "attacker.example"}).status_code == 200


# ---- one log line per request ----------------------------------------------------------------------

LINE = re.compile(r"specrun serve: done request: (\S+) (\S+) (\S+) (\d+|-) (\d+\.\d) ms")


def test_guard_logs_one_line_per_request_without_texts():
    lines: list[str] = []
    g = _guard("127.0.0.1", lines=lines)
    asyncio.run(asgi(g, "POST", "/v1/completions", headers=(("Host", "localhost"),),
                     body_parts=(b'{"prompt": "my password is hunter2"}',)))
    _call(g, "evil.example")
    _call(g, "localhost", "/health", "GET")                         # polled paths: only when they fail
    g.state.stopping = True
    _call(g, "localhost", "/health", "GET")
    asyncio.run(asgi(g, "GET", "/v1/x\n\x1b[31mfake", headers=(("Host", "localhost"),), body_parts=()))
    got = [LINE.fullmatch(line) for line in lines]
    assert all(got), lines
    assert [m.groups()[:4] for m in got] == [("POST", "/v1/completions", "-", "200"),
                                             ("POST", "/v1/completions", "-", "403"),
                                             ("GET", "/health", "-", "503"),
                                             ("GET", r"/v1/x\n\x1b[31mfake", "-", "503")]
    assert not any("hunter2" in line for line in lines)


def test_the_server_logs_requests_on_stderr_not_stdout(server, capsys):
    capsys.readouterr()
    secret = "the launch code is 0000"
    r = server.post("/completion", {"prompt": secret, "n_predict": 1})
    assert r.status_code == 200
    assert server.http.get("/health").status_code == 200
    out, err = capsys.readouterr()
    lines = [m for m in map(LINE.fullmatch, err.splitlines()) if m]
    assert [m.groups()[:4] for m in lines] == [("POST", "/completion", "127.0.0.1", "200")], err
    assert "done request" not in out and secret not in err


def test_verbose_logs_still_one_line_per_request(servers, capsys):
    """-v: uvicorn's access log stays off (it would write a second line, on stdout)."""
    with servers.start("-m", MODEL, "-c", "256", "-n", "4", "-v") as srv:
        capsys.readouterr()
        assert srv.post("/completion", {"prompt": "Hi", "n_predict": 1}).status_code == 200
        out, err = capsys.readouterr()
    assert "/completion" not in out, out
    assert [m.groups()[:4] for m in map(LINE.fullmatch, err.splitlines()) if m] == [
        ("POST", "/completion", "127.0.0.1", "200")], err
    assert err.count("/completion") == 1, err


# ---- the body parsed in a worker answers as FastAPI's parser did -------------------------------------


@pytest.mark.parametrize("body,code,message", [
    (b'{"prompt": "x", "n_predict": ', "invalid_json", "the request body is not valid JSON (Expecting value)"),
    (b'{"prompt": "x", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "invalid_json",
     "the request body is not valid JSON here: it nests deeper than the JSON parser allows"),
    (b'{"prompt": "x", "x": ' + b"[" * 300 + b"]" * 300 + b', "n_predict": 1}', None, None),   # past pydantic's 200
    (b'{"prompt": "ab\\ud800cd", "n_predict": 1}', "unencodable_text",
     "prompt: the text holds a lone UTF-16 surrogate (U+D800 at character 2)"),
    (b'\xef\xbb\xbf{"prompt": "x", "n_predict": 1}', None, None),      # a UTF-8 BOM, as json.loads reads it
    (b'{"prompt": "x", "n_predict": 1, "temperature": NaN}', "invalid_value", "temperature: "),
    (b'{"n_predict": 1}', "missing_field", "prompt: Field required"),
    (b'null', "invalid_value", None),
    (b'[1, 2]', "invalid_value", None),
])
def test_body_errors_are_fastapis(server, body, code, message):
    r = server.http.post("/completion", content=body, headers={"Content-Type": "application/json"})
    if code is None:
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == code
    assert message is None or err["message"].startswith(message), err["message"]
