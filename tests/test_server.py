"""`specrun serve` as a real process on 127.0.0.1 (SmolLM2-135M, 2 slots), driven by the official
openai client and by httpx, every request with a timeout: OpenAI shapes, streaming, stop strings,
speculative equality, /metrics accounting, bad input, load from 8 clients with an RSS bound, and a
fuzz of request bodies from the server's own OpenAPI schema."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

SPECRUN = str(Path(sys.executable).parent / "specrun")
T = 30.0   # seconds: the timeout of every request
MODEL = "smollm2-135m-instruct"
# A period longer than ngram-simple's 12-token pattern: it drafts on this (a shorter period never
# drafts, as in llama.cpp: the last occurrence is too recent to give 12 tokens).
REPEAT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.\n" * 4


class ServerProcess:
    """`specrun serve --port 0 ARGS` as a subprocess; its stderr goes to a log file, from which the
    bound port is read."""

    def __init__(self, log_dir: Path, *args: str, api_key: str | None = None) -> None:
        self.log_path = log_dir / "server.log"
        self.api_key = api_key
        env = {k: v for k, v in os.environ.items() if k not in ("SPECRUN_API_KEY", "SPECRUN_MODEL")}
        cmd = [SPECRUN, "serve", "--port", "0", *args, *(["--api-key", api_key] if api_key else [])]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                         env=env)
        try:
            self.url = self._wait_ready(timeout=120)
        except BaseException:
            self.kill()
            raise
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, timeout=T, headers=headers)

    def _wait_ready(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        url = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"specrun serve exited with {self.proc.returncode}:\n{self.log()}")
            if url is None and (m := re.search(r"on (http://127\.0\.0\.1:\d+)", self.log())):
                url = m.group(1)
            if url is not None:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        return url
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        raise RuntimeError(f"specrun serve not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", timeout=T, max_retries=0,
                             **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        return self.http.post(path, json=body, **kw)

    def completion(self, prompt: str, n: int = 16, **extra) -> dict:
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


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("serve"), "-m", MODEL, "-c", "512", "-np", "2", "-n", "64")
    yield srv
    srv.kill()


# ---- the openai client -------------------------------------------------------------------------


def test_openai_completion(server):
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    ch = r.choices[0]
    assert r.object == "text_completion" and r.model == MODEL
    assert ch.text.strip() and ch.finish_reason in ("stop", "length")
    native = server.completion("The capital of France is", 8)
    assert ch.text == native["content"]          # the same greedy text through both endpoints
    assert r.usage.prompt_tokens == native["tokens_evaluated"]
    assert r.usage.completion_tokens == native["tokens_predicted"] == len(native["tokens"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    if ch.finish_reason == "length":
        assert r.usage.completion_tokens == 8


def test_openai_chat_stream_equals_non_stream(server):
    c = server.client()
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}]
    full = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant" and text
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_openai_completion_stream_ends_with_done(server):
    with server.http.stream("POST", "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 6,
                                                             "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    text = "".join(o["choices"][0]["text"] for o in objs)
    assert text == server.client().completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6,
                                                      temperature=0).choices[0].text
    assert objs[-1]["timings"]["predicted_n"] == 6 or objs[-1]["choices"][0]["finish_reason"] == "stop"


def test_openai_models(server):
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    meta = server.http.get("/v1/models").json()["data"][0]["meta"]
    assert meta["n_ctx"] == 512 and meta["slots"] == 2
    assert meta["spec_types_available"] == ["none", "ngram-simple"]


def test_openapi_schema_published(server):
    schema = server.http.get("/openapi.json").json()
    paths = schema["paths"]
    for p in ("/v1/completions", "/v1/chat/completions", "/completion", "/v1/models", "/health", "/metrics"):
        assert p in paths
    post = paths["/v1/completions"]["post"]
    assert "400" in post["responses"] and "422" not in post["responses"]
    assert "speculative" in schema["components"]["schemas"]["CompletionRequest"]["properties"]


def test_stop_strings(server):
    base = server.completion("Count: 1, 2, 3,", 24)["content"]
    assert " 5," in base
    cut = server.completion("Count: 1, 2, 3,", 24, stop=[" 5,", "never"])
    assert cut["content"] == base[:base.index(" 5,")]
    assert cut["stop_type"] == "word" and cut["stopping_word"] == " 5,"
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0, stop=" 5,")
    assert r.choices[0].text == cut["content"] and r.choices[0].finish_reason == "stop"
    s = c.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=24, temperature=0, stop=" 5,",
                             stream=True)
    assert "".join(ch.choices[0].text for ch in s) == cut["content"]


# ---- speculative decoding: the same text, faster ------------------------------------------------


def test_ngram_per_request_equals_none(server):
    plain = server.completion(REPEAT, 48, speculative={"type": "none"})
    spec = server.completion(REPEAT, 48, speculative={"type": "ngram-simple", "n_max": 8, "p_min": 0.0})
    assert spec["content"] == plain["content"] and spec["tokens"] == plain["tokens"]
    assert plain["timings"]["draft_n"] == 0
    assert spec["timings"]["draft_n"] > 0 and spec["timings"]["draft_n_accepted"] > 0
    assert spec["generation_settings"]["speculative"]["type"] == ["ngram-simple"]
    chat = dict(model=MODEL, messages=[{"role": "user", "content": "Repeat exactly:\n" + REPEAT}], max_tokens=40,
                temperature=0)
    c = server.client()
    a = c.chat.completions.create(**chat).choices[0].message.content
    b = c.chat.completions.create(**chat, extra_body={"speculative": {"type": "ngram-simple", "n_max": 6}})
    assert b.choices[0].message.content == a


def test_metrics_move_with_a_request(server):
    before = server.metrics()
    r = server.completion(REPEAT + "The quick brown", 40, speculative={"type": "ngram-simple", "n_max": 8})
    after = server.metrics()
    t = r["timings"]
    assert t["draft_n"] > 0
    assert delta(after, before, "specrun_requests_total", endpoint="/completion") == 1
    assert delta(after, before, "specrun_requests_total") == 1
    assert delta(after, before, "specrun_tokens_generated_total") == t["predicted_n"] == len(r["tokens"])
    assert delta(after, before, "specrun_prompt_tokens_total") == t["prompt_n"]
    assert delta(after, before, "specrun_drafts_total", spec_type="ngram-simple") == t["drafts"]
    assert delta(after, before, "specrun_draft_tokens_total", spec_type="ngram-simple") == t["draft_n"]
    assert delta(after, before, "specrun_draft_tokens_accepted_total") == t["draft_n_accepted"]
    assert delta(after, before, "specrun_draft_accepted_per_position_total") == t["draft_n_accepted"]
    assert delta(after, before, "specrun_draft_accepted_per_position_total", position="0") <= t["drafts"]
    assert delta(after, before, "specrun_errors_total") == 0
    assert delta(after, before, "specrun_prompt_seconds_total") == pytest.approx(t["prompt_ms"] / 1e3, abs=1e-5)
    assert after["specrun_slots"] == 2 and after["specrun_slots_busy"] == 0


# ---- bad input: a precise 4xx, and the server goes on --------------------------------------------

LONG = "lorem ipsum " * 400   # > 512 tokens

BAD = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, "invalid_json"),
    ("/v1/completions", b"prompt=hello", 400, "invalid_json"),
    ("/v1/completions", {"prompt": 5}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "invalid_value"),
    ("/v1/completions", {"max_tokens": 4}, 400, "missing_field"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": [1, 99999999]}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": LONG}, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "speculative": {"type": "medusa"}}, 400, "unknown_spec_type"),
    ("/v1/completions", {"prompt": "x", "speculative": {"type": "draft-mtp"}}, 400, "unavailable_spec_type"),
    ("/v1/completions", {"prompt": "x", "speculative": {"type": "draft"}}, 400, "unavailable_spec_type"),
    ("/v1/completions", {"prompt": "x", "speculative": {"n_max": 0}}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "invalid_value"),
    ("/completion", {"prompt": "x", "n_predict": -2}, 400, "invalid_value"),
    ("/completion", {"prompt": "x", "speculative": {"type": "ngram-simple,medusa"}}, 400, "unknown_spec_type"),
    ("/nowhere", {}, 404, "not_found"),
]


@pytest.mark.parametrize("path,body,status,code", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_input(server, path, body, status, code):
    if isinstance(body, bytes):
        r = server.http.post(path, content=body, headers={"Content-Type": "application/json"}
                             if body.startswith(b"{") else {"Content-Type": "application/x-www-form-urlencoded"})
    else:
        r = server.post(path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert err["message"]


def test_bad_input_messages_say_what_is_wrong(server):
    def msg(path, body):
        return server.post(path, body).json()["error"]["message"]

    assert "max_tokens" in msg("/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert re.search(r"\(\d+ tokens, ctx 512\)", msg("/v1/completions", {"prompt": LONG}))
    m = msg("/v1/completions", {"prompt": "x", "speculative": {"type": "medusa"}})
    assert "medusa" in m and "ngram-simple" in m
    assert "available: none, ngram-simple" in msg("/v1/completions", {"prompt": "x", "speculative": {"type":
                                                                                                    "draft-mtp"}})
    r = server.http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_still_serving_after_bad_input(server):
    before = server.metrics()
    server.post("/v1/completions", {"prompt": 5})
    assert delta(server.metrics(), before, "specrun_errors_total", code="400") == 1
    assert server.http.get("/health").json()["status"] == "ok"
    assert server.completion("The capital of France is", 4)["tokens_predicted"] >= 1


# ---- load ----------------------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fib(n):", "Three primary colors are", "Water boils at",
           "The quick brown fox"]


def _ask(server, i: int) -> tuple[int, str, int]:
    """Request i of the load: a mix of the three generation endpoints, streamed or not."""
    p = PROMPTS[i % len(PROMPTS)]
    kind = i % 4
    if kind == 0:
        r = server.completion(p, 12)
        return i, r["content"], r["id_slot"]
    if kind == 1:
        r = server.client().completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
        return i, r.choices[0].text, -1
    if kind == 2:
        s = server.client().completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0, stream=True)
        return i, "".join(ch.choices[0].text for ch in s), -1
    r = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                               max_tokens=12, temperature=0)
    return i, "chat:" + r.choices[0].message.content, -1


def test_load_8_clients_40_requests(server):
    # sequential greedy answers: the three completion kinds agree, so one per prompt, and one chat
    expected = {i: _ask(server, i)[1] for i in range(20) if i % 4 in (0, 3)}
    for i in range(20):
        expected.setdefault(i, expected[next(j for j in range(20) if j % 5 == i % 5 and j % 4 == 0)])
    rss0 = server.rss_kib()
    before = server.metrics()
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda i: _ask(server, i), range(40)))
    after = server.metrics()
    rss1 = server.rss_kib()
    for i, text, _ in results:
        assert text == expected[i % 20], f"request {i}"
    assert {slot for _, _, slot in results if slot >= 0} == {0, 1}      # both slots served
    assert delta(after, before, "specrun_requests_total") == 40
    assert delta(after, before, "specrun_errors_total") == 0
    assert after["specrun_slots_busy"] == 0 and after["specrun_requests_waiting"] == 0
    grown = (rss1 - rss0) / 1024
    print(f"RSS before load {rss0 / 1024:.1f} MiB, after {rss1 / 1024:.1f} MiB (+{grown:.1f} MiB)")
    assert grown < 32, f"RSS grew by {grown:.1f} MiB over 40 requests"


def test_disconnect_mid_stream_frees_the_slot(server):
    before = server.metrics()
    with server.http.stream("POST", "/v1/completions", json={"prompt": "1, 2, 3, 4,", "max_tokens": 64,
                                                             "temperature": 0, "stream": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 4:
                break
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["specrun_slots_busy"] == 0 and delta(m, before, "specrun_requests_interrupted_total") == 1:
            break
        time.sleep(0.05)
    assert m["specrun_slots_busy"] == 0
    assert delta(m, before, "specrun_requests_interrupted_total") == 1
    assert delta(m, before, "specrun_tokens_generated_total") < 64
    assert server.completion("The capital of France is", 4)["tokens_predicted"] >= 1


def test_concurrent_streams_on_two_slots(server):
    """Two streams at once, each read slowly: both progress (one slot each) and both finish."""
    out: dict[int, str] = {}

    def read(i: int) -> None:
        s = server.client().completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=12, temperature=0,
                                               stream=True)
        out[i] = "".join(ch.choices[0].text for ch in s)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(T)
    assert out == {i: server.completion(PROMPTS[i], 12)["content"] for i in range(2)}


# ---- fuzz: bodies generated from the server's own OpenAPI schema ---------------------------------


def test_fuzz_openapi_no_5xx(server):
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    raw = server.http.get("/openapi.json").json()
    schema = schemathesis.openapi.from_dict(raw)
    ops = [r.ok() for r in schema.get_all_operations()]
    strategy = st.one_of(*[op.as_strategy(mode) for op in ops
                           for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    seen: dict[int, int] = {}

    @settings(max_examples=100, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        if isinstance(case.body, dict):   # keep generations short (left out, a request gets -n 64)
            k = "n_predict" if case.path == "/completion" else "max_tokens"
            if case.body.get(k) is None or (isinstance(case.body[k], int) and case.body[k] > 4):
                case.body[k] = 4
            if isinstance(case.body.get("max_completion_tokens"), int) and case.body["max_completion_tokens"] > 4:
                case.body["max_completion_tokens"] = 4
        r = case.call(base_url=server.url, timeout=T)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, f"{case.method} {case.path} {case.body!r} -> {r.status_code} {r.text[:300]}"
        if r.status_code >= 400:
            assert "error" in r.json()

    check()
    print(f"fuzz statuses: {seen}")
    assert server.http.get("/health").json()["status"] == "ok"
    assert server.completion("The capital of France is", 4)["tokens_predicted"] >= 1
