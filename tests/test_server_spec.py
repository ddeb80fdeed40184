"""`specrun serve` started with a server-level spec type (ngram-simple on SmolLM2, draft-mtp on the
synthetic MTP model), and with --api-key, one slot and a queue of one: the content equals plain
decoding, a draft n-max above the engine's cap is a 400 that gives the cap, requests without the
key get 401, a full queue gets 503 with Retry-After, a client that leaves mid-stream frees the slot
for the one waiting (in this process, tests/serving.py), and SIGTERM past the drain timeout ends a
stream with an error event (the process exits 0)."""

from __future__ import annotations

import json
import math
import re
import threading

import httpx
import openai
import pytest
from serving import MODEL, ServerProcess, T, delta, metric_sum, wait_for
from test_server import REPEAT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ngram_server(servers):
    with servers.start("-m", MODEL, "-c", "512", "-n", "48", "-t", "1", "--spec-type", "ngram-simple",
                       "--spec-draft-n-max", "8") as srv:
        yield srv


def test_server_level_ngram_equals_none(ngram_server):
    default = ngram_server.completion(REPEAT, 40)
    plain = ngram_server.completion(REPEAT, 40, speculative={"type": "none"})
    assert default["content"] == plain["content"] and default["tokens"] == plain["tokens"]
    assert default["generation_settings"]["speculative"] == {"type": ["ngram-simple"], "n_max": 8, "n_min": 0,
                                                             "p_min": 0.0}
    assert default["timings"]["draft_n"] > 0 and plain["timings"]["draft_n"] == 0
    c = ngram_server.client()
    msgs = [{"role": "user", "content": "Repeat exactly:\n" + REPEAT}]
    a = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0)
    b = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0,
                                  extra_body={"speculative": {"type": "none"}})
    assert a.choices[0].message.content == b.choices[0].message.content


def test_logprobs_are_the_same_with_and_without_speculation(ngram_server):
    """Each token's log-probability comes from the target's verified logits row for its position,
    bit-identical in exact mode: the numbers do not depend on the spec type, greedy or sampled."""
    c = ngram_server.client()
    for temp in (0.0, 0.8):
        kw = dict(model=MODEL, prompt="Repeat exactly:\n" + REPEAT, max_tokens=24, temperature=temp, seed=7, logprobs=3)
        spec = c.completions.create(**kw)
        plain = c.completions.create(**kw, extra_body={"speculative": {"type": "none"}})
        a, b = spec.choices[0].logprobs, plain.choices[0].logprobs
        assert spec.choices[0].text == plain.choices[0].text
        assert a.tokens == b.tokens and a.token_logprobs == b.token_logprobs and a.top_logprobs == b.top_logprobs
        assert "".join(a.tokens) == spec.choices[0].text and 0 < len(a.tokens) <= 24
        assert a.text_offset == [sum(len(t) for t in a.tokens[:i]) for i in range(len(a.tokens))]
        for lp, top in zip(a.token_logprobs, a.top_logprobs, strict=True):
            assert len(top) == 3 and lp <= 0 and lp <= max(top.values()) + 1e-12
            assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-9
        if temp == 0.0:       # greedy: every token is the likeliest one
            assert all(lp == max(top.values()) for lp, top in zip(a.token_logprobs, a.top_logprobs, strict=True))
    msgs = [{"role": "user", "content": "Repeat exactly:\n" + REPEAT}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2)
    spec = c.chat.completions.create(**kw)
    plain = c.chat.completions.create(**kw, extra_body={"speculative": {"type": "none"}})
    ca, cb = spec.choices[0].logprobs.content, plain.choices[0].logprobs.content
    assert [(x.token, x.logprob, x.bytes) for x in ca] == [(x.token, x.logprob, x.bytes) for x in cb]
    assert "".join(x.token for x in ca) == spec.choices[0].message.content
    assert all(len(x.top_logprobs) == 2 and x.top_logprobs[0].logprob == x.logprob for x in ca)


def test_text_offsets_index_the_text_where_characters_split_over_tokens(ngram_server):
    """text_offset counts characters of the completion text: a character SmolLM2 writes as two
    byte-fallback tokens (東 = e6 9d | b1) counts once, at its start (it counted once per piece)."""
    jp = "東京は日本の首都です。"
    r = ngram_server.client().completions.create(model=MODEL, prompt=f"Repeat exactly:\n{jp}\n{jp}\n", max_tokens=16,
                                                  temperature=0, logprobs=1).choices[0]
    text, toks, offs = r.text, r.logprobs.tokens, r.logprobs.text_offset
    assert "\ufffd" in "".join(toks) and "\ufffd" not in text     # characters split over tokens, whole in the text
    assert offs == sorted(offs) and offs[0] == 0 and all(o < len(text) for o in offs)
    for tok, off in zip(toks, offs, strict=True):
        if "\ufffd" not in tok:
            assert text[off:off + len(tok)] == tok, (tok, off)


def test_logprobs_cover_the_text_a_stop_string_cut(ngram_server):
    """With a stop string, logprobs hold the tokens that begin inside the returned text, as
    llama-server drops the stop word's: one cut at a token boundary, one inside a token (which
    keeps the token it splits), and the text and numbers as the run without a stop."""
    c = ngram_server.client()
    kw = dict(model=MODEL, prompt="Repeat exactly:\n" + REPEAT, max_tokens=24, temperature=0, logprobs=1)
    full = c.completions.create(**kw).choices[0]
    toks, text = full.logprobs.tokens, full.text
    assert "".join(toks) == text and len(toks) >= 8
    for stop in (toks[5], toks[6][1:] or toks[7]):      # a whole token's text; the end of one
        cut = text.index(stop)
        want = [i for i, off in enumerate(full.logprobs.text_offset) if off < cut]
        got = c.completions.create(**kw, stop=stop).choices[0]
        assert got.text == text[:cut] and got.finish_reason == "stop"
        assert got.logprobs.tokens == [toks[i] for i in want], stop
        assert got.logprobs.token_logprobs == [full.logprobs.token_logprobs[i] for i in want]
        assert all(off < len(got.text) for off in got.logprobs.text_offset)


CONTROLS = [   # (request fields, what the text must look like), each against the same request without them
    ({"repeat_penalty": 1.5, "frequency_penalty": 0.5, "presence_penalty": 0.5, "repeat_last_n": 64}, None),
    ({"grammar": 'root ::= "The quick brown fox" [^.]*'}, r"The quick brown fox[^.]*"),   # copies, without periods
    ({"json_schema": {"type": "object", "properties": {"animal": {"type": "string", "maxLength": 10}},
                      "required": ["animal"]}}, "json"),
]


@pytest.mark.parametrize("temp", [0.0, 0.8])
@pytest.mark.parametrize("fields, shape", CONTROLS, ids=["penalties", "grammar", "json_schema"])
def test_controls_keep_spec_equal_to_none(ngram_server, fields, shape, temp):
    """Penalties, a grammar and a JSON schema through llama-server's /completion: the server's
    ngram-simple output equals speculative none's, and differs from the answer without them."""
    prompt = "Repeat exactly:\n" + REPEAT
    base = {"temperature": temp, "seed": 7}
    free = ngram_server.completion(prompt, 32, **base)
    spec = ngram_server.completion(prompt, 32, **base, **fields)
    plain = ngram_server.completion(prompt, 32, **base, **fields, speculative={"type": "none"})
    assert spec["tokens"] == plain["tokens"] and spec["content"] == plain["content"]
    assert spec["tokens"] != free["tokens"]
    if "grammar" in fields:             # the grammar starts the copy: n-gram drafts are verified under it
        assert spec["timings"]["draft_n"] > 0
    if shape == "json":
        assert spec["stop_type"] == "eos"
        assert set(json.loads(spec["content"])) == {"animal"}
    elif shape:
        assert re.fullmatch(shape, spec["content"], flags=re.S)
    settings = spec["generation_settings"]
    for k, v in fields.items():
        if k in ("repeat_penalty", "frequency_penalty", "presence_penalty", "repeat_last_n"):
            assert settings[k] == v
    assert bool(settings["grammar"]) == ("grammar" in fields or "json_schema" in fields)


def test_openai_controls_keep_spec_equal_to_none(ngram_server):
    """OpenAI's fields: logit_bias (token-id keys; -100 is added to the logit, as llama-server does),
    frequency/presence penalties, and response_format json_object / json_schema on chat: equal with
    and without speculation."""
    c = ngram_server.client()
    prompt = "Repeat exactly:\n" + REPEAT
    free = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    first = ngram_server.post("/completion", {"prompt": prompt, "n_predict": 1, "temperature": 0}).json()["tokens"][0]
    for extra in ({"logit_bias": {str(first): -100}}, {"frequency_penalty": 1.0, "presence_penalty": 1.0}):
        a = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, **extra)
        b = c.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, **extra,
                                 extra_body={"speculative": {"type": "none"}})
        assert a.choices[0].text == b.choices[0].text != free.choices[0].text
    msgs = [{"role": "user", "content": 'Name an animal, as JSON: {"animal": ...}.'}]   # a short object: "stop"
    schema = {"type": "object", "properties": {"animal": {"type": "string", "maxLength": 10}}, "required": ["animal"]}
    for rf in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}):
        for temp in (0.0, 0.8):
            kw = dict(model=MODEL, messages=msgs, max_tokens=48, temperature=temp, seed=3, response_format=rf)
            a = c.chat.completions.create(**kw)
            b = c.chat.completions.create(**kw, extra_body={"speculative": {"type": "none"}})
            assert a.choices[0].message.content == b.choices[0].message.content
            assert a.choices[0].finish_reason == "stop"
            obj = json.loads(a.choices[0].message.content)
            assert isinstance(obj, dict)
            if rf["type"] == "json_schema":
                assert set(obj) == {"animal"}


def test_logit_bias_texts_and_false_as_llama_server(ngram_server):
    """llama-server's logit_bias on every endpoint: a key that is not a whole number is a text whose
    tokens all get the bias, `false` is never, and the object and [token, bias] pair forms are one;
    the answer is the same without speculation. generation_settings shows the ids the text gave."""
    prompt = "Repeat exactly:\n" + REPEAT
    free = ngram_server.completion(prompt, 24)
    t0, t1 = free["tokens"][:2]
    one = ngram_server.completion(prompt, 1)["content"]            # the text of t0, e.g. "The"
    two = ngram_server.completion(prompt, 2)["content"]            # of t0 t1, e.g. "The quick"
    runs = {}
    for name, bias in [("id", {str(t0): False}), ("text", {one: False}), ("pair", [[one, False]]),
                       ("id-pair", [[t0, False]])]:
        for spec in ({}, {"speculative": {"type": "none"}}):
            r = ngram_server.completion(prompt, 24, logit_bias=bias, **spec)
            runs[name, bool(spec)] = r["tokens"]
            assert r["generation_settings"]["logit_bias"] == [[t0, False]], (name, r["generation_settings"])
    assert len(set(map(tuple, runs.values()))) == 1
    banned = runs["text", False]
    assert t0 not in banned and banned != free["tokens"]
    r = ngram_server.completion(prompt, 4, logit_bias=[[two, -1.5], [t1, 0.5]])
    assert r["generation_settings"]["logit_bias"] == [[t0, -1.5], [t1, -1.5], [t1, 0.5]]
    c = ngram_server.client()
    a = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logit_bias={one: -100})
    b = c.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, logit_bias={str(t0): -100})
    assert a.choices[0].text == b.choices[0].text != free["content"][:len(a.choices[0].text)]
    msgs = [{"role": "user", "content": "Say hello."}]
    hello = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0).choices[0].message
    first = hello.content.split()[0]
    ban = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                    logit_bias={first: False}).choices[0].message
    assert not ban.content.startswith(first), (hello.content, ban.content)


def test_logprobs_are_before_the_sampler_chain_as_llama_server(ngram_server):
    """llama-server's default log-probabilities (post_sampling_probs false: the raw logits at
    temperature 1): a grammar, json_object or logit bias leaves them as they are. Under a grammar
    that allows one text, the first position's alternatives are the unconstrained ones, with tokens
    the grammar forbids; a banned token keeps its logprob. post_sampling_probs: true is a 400."""
    c = ngram_server.client()
    kw = dict(model=MODEL, prompt="Repeat exactly:\n" + REPEAT, max_tokens=4, temperature=0, logprobs=5)
    free = c.completions.create(**kw).choices[0].logprobs
    first = ngram_server.completion("Repeat exactly:\n" + REPEAT, 1)["tokens"][0]
    for extra in ({"grammar": 'root ::= " zebra"'}, {"grammar": 'root ::= " zebra"', "speculative": {"type": "none"}},
                  {"logit_bias": {str(first): False}, "post_sampling_probs": False}):
        got = c.completions.create(**kw, extra_body=extra).choices[0].logprobs
        assert got.tokens[0] != free.tokens[0]
        assert got.top_logprobs[0] == free.top_logprobs[0], extra           # the unconstrained alternatives
        assert free.tokens[0] in got.top_logprobs[0]                        # ... the banned / forbidden one too
        assert got.token_logprobs[0] < free.token_logprobs[0] == max(got.top_logprobs[0].values())
        if "grammar" in extra:
            assert "".join(got.tokens) == " zebra"
            assert any(not " zebra".startswith(t) for t in got.top_logprobs[0])
    msgs = [{"role": "user", "content": "Name an animal."}]
    ckw = dict(model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
    plain = c.chat.completions.create(**ckw).choices[0].logprobs.content[0]
    obj = c.chat.completions.create(**ckw, response_format={"type": "json_object"}).choices[0].logprobs.content[0]
    assert obj.token.lstrip().startswith("{") and plain.token != obj.token
    assert [(t.token, t.logprob) for t in obj.top_logprobs] == [(t.token, t.logprob) for t in plain.top_logprobs]
    r = ngram_server.post("/v1/completions", {**kw, "post_sampling_probs": True})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("post_sampling_probs: not supported")


@pytest.fixture(scope="module")
def mtp_server(servers, tmp_path_factory):
    from specrun.gguf_spec.testmodel import Head, SynthConfig
    from specrun.kernels.testmodel import build_test_model

    # Q8_0: exact equality is asserted below, and F16 weights are not batch-invariant (README)
    d = tmp_path_factory.mktemp("serve-mtp")
    path = build_test_model(d / "mtp.gguf", SynthConfig(head=Head.parse("exact")), "q8_0")
    with servers.start("-m", str(path), "-c", "256", "-n", "24", "-t", "1", "--spec-type", "draft-mtp",
                       "--spec-ngram-mod-n-max", "40") as srv:   # a cap under exact mode's 62
        yield srv


def test_draft_mtp_equals_none(mtp_server):
    prompt = "hello world, this is"
    mtp = mtp_server.completion(prompt, 24)
    plain = mtp_server.completion(prompt, 24, speculative={"type": "none"})
    assert mtp["tokens"] == plain["tokens"] and mtp["content"] == plain["content"]
    assert len(mtp["tokens"]) == 24
    t = mtp["timings"]
    assert t["draft_n"] > 0 and t["draft_n_accepted"] == t["draft_n"]    # the exact head drafts the target
    assert plain["timings"]["draft_n"] == 0
    oai = mtp_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0}).json()
    assert oai["choices"][0]["text"] == mtp["content"] and oai["timings"]["draft_n"] > 0
    models = mtp_server.http.get("/v1/models").json()["data"][0]["meta"]
    assert models["spec_types_available"] == ["none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix", "draft-mtp"]
    assert models["chat_template"] is False


def test_draft_n_max_above_the_cap_is_a_400_with_the_cap(mtp_server):
    cap = mtp_server.http.get("/v1/models").json()["data"][0]["meta"]["spec_n_max_cap"]
    assert cap == 48     # the largest of 16, --spec-draft-n-max (3) and the n-gram bounds (size-m 48, ngram-mod 40)
    before = mtp_server.metrics()
    r = mtp_server.post("/completion", {"prompt": "hello", "n_predict": 4, "speculative": {"n_max": cap + 1}})
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": f"speculative.n_max: draft n-max {cap + 1} is above this server's cap of {cap} for draft-simple, "
                   f"draft-eagle3 and draft-mtp (set when the server started); ask for at most {cap}, "
                   "or restart the server with a larger --spec-draft-n-max", "type": "invalid_request_error",
        "code": "invalid_value"}
    # beyond exact mode's 62 too: the cap is the server's, not the request schema's
    assert mtp_server.post("/completion", {"prompt": "hello", "n_predict": 4, "speculative": {"n_max": 100}}
                           ).json()["error"]["message"].startswith("speculative.n_max: draft n-max 100 is above this "
                                                                   "server's cap of 48 for draft-simple, draft-eagle3")
    # refused before it took a slot: no generation ran (the engine's own check comes after one)
    assert delta(mtp_server.metrics(), before, "specrun_requests_total") == 0
    ok = mtp_server.completion("hello", 4, speculative={"n_max": cap})
    assert ok["generation_settings"]["speculative"]["n_max"] == cap and ok["tokens_predicted"] == 4
    # n-gram drafts are bounded by their size_m, not by the cap: accepted as the engine does
    for t in ("ngram-simple", "ngram-mod", "ngram-map-k"):   # every n-gram type, as the engine
        assert mtp_server.completion("hello", 4, speculative={"type": t, "n_max": 62})["tokens"] == ok["tokens"], t


def test_chat_without_template_is_400(mtp_server):
    r = mtp_server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_chat_template"
    assert "--chat-template" in r.json()["error"]["message"]


# ---- --api-key, one slot, a queue of one ---------------------------------------------------------

KEY = "sk-test-123"


GUARDED = ("-m", MODEL, "-c", "512", "-np", "1", "-t", "1", "--queue", "1", "--drain-timeout", "1")


@pytest.fixture(scope="module")
def guarded(servers):
    with servers.start(*GUARDED, api_key=KEY) as srv:
        yield srv


@pytest.fixture
def guarded_process(tmp_path):
    """The guarded server as a process: for SIGTERM, its exit code and its last line."""
    srv = ServerProcess(tmp_path, *GUARDED, api_key=KEY)
    yield srv
    srv.kill()


@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"),
                                         ("POST", "/v1/chat/completions"), ("POST", "/completion"),
                                         ("GET", "/metrics"), ("GET", "/openapi.json")])
@pytest.mark.parametrize("auth", [None, "Bearer wrong", KEY, "Basic c2stdGVzdC0xMjM="])
def test_api_key_required(guarded, method, path, auth):
    headers = {"Authorization": auth} if auth else {}
    r = httpx.request(method, guarded.url + path, headers=headers, timeout=T,
                      json={"prompt": "x", "max_tokens": 1} if method == "POST" else None)
    assert r.status_code == 401
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "authentication_error",
                                 "code": "invalid_api_key"}
    assert r.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("headers,status", [({"X-Api-Key": KEY}, 200), ({"x-api-key": KEY}, 200),
                                            ({"Authorization": f"bearer {KEY}"}, 200),
                                            ({"X-Api-Key": "wrong"}, 401), ({"X-Api-Key": ""}, 401),
                                            ({"Authorization": "Bearer wrong", "X-Api-Key": KEY}, 401)])
def test_api_key_headers(guarded, headers, status):
    r = httpx.get(guarded.url + "/v1/models", headers=headers, timeout=T)
    assert r.status_code == status, r.text


def test_api_key_health_open_and_key_works(guarded):
    assert httpx.get(guarded.url + "/health", timeout=T).status_code == 200
    assert httpx.head(guarded.url + "/v1/health", timeout=T).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url + "/v1", api_key="wrong", timeout=T, max_retries=0).models.list()
    c = guarded.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    r = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].text
    assert guarded.http.get("/openapi.json").json()["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"


def test_full_queue_503_and_disconnect_frees_the_slot(guarded):
    """Slot taken by a long stream, one request waiting (the queue's one place): a third gets 503 with
    Retry-After. The stream's client then leaves: the waiting request gets the slot at once (it is
    answered while the stream's 400 tokens are far from generated)."""
    before = guarded.metrics()
    waiting: dict[str, object] = {}
    long_body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 400, "temperature": 0, "stream": True}
    with guarded.http.stream("POST", "/v1/completions", json=long_body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))   # generating: the slot is taken

        def wait_in_queue() -> None:
            r = guarded.post("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4,
                                                 "temperature": 0})
            waiting.update(status=r.status_code, text=r.json()["choices"][0]["text"])

        th = threading.Thread(target=wait_in_queue)
        th.start()
        m = wait_for("a request waiting", lambda: (m := guarded.metrics()) and m["specrun_requests_waiting"] == 1
                     and m)
        assert m["specrun_slots_busy"] == 1
        busy = guarded.post("/v1/completions", {"prompt": "x", "max_tokens": 1})
        assert busy.status_code == 503, busy.text
        assert busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["code"] == "server_busy"
        for _ in range(3):
            next(lines)
    th.join(T)
    assert waiting["status"] == 200 and waiting["text"]
    after = wait_for("both requests recorded", lambda: (m := guarded.metrics())
                     and delta(m, before, "specrun_requests_total") == 2 and m)
    assert delta(after, before, "specrun_requests_interrupted_total") == 1
    assert delta(after, before, "specrun_tokens_generated_total") < 400 + 4
    assert delta(after, before, "specrun_errors_total", code="503") == 1
    assert after["specrun_slots_busy"] == 0 and after["specrun_requests_waiting"] == 0


def test_disconnect_non_streamed_frees_the_slot(guarded):
    """A client that gives up on a long non-streamed request (read timeout) stops its generation."""
    before = guarded.metrics()
    with pytest.raises(httpx.ReadTimeout):
        guarded.post("/v1/completions", {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 400,
                                         "temperature": 0}, timeout=1.0)
    after = wait_for("the run interrupted", lambda: (m := guarded.metrics())
                     and delta(m, before, "specrun_requests_interrupted_total") == 1 and m["specrun_slots_busy"] == 0
                     and m)
    assert delta(after, before, "specrun_tokens_generated_total") < 400


def test_sigterm_past_the_drain_timeout_ends_the_stream_with_an_error(guarded_process):
    """SIGTERM while a 400-token stream is generating, with --drain-timeout 1: the stream is stopped
    after the drain and ends with an error event, then [DONE] (never a final chunk that looks
    complete); the process exits 0, and its last line counts that one interrupted run."""
    srv = guarded_process
    body = {"prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "max_tokens": 400, "temperature": 0, "stream": True}
    m = srv.metrics()
    answered = metric_sum(m, "specrun_requests_total") - m["specrun_requests_interrupted_total"]
    with srv.http.stream("POST", "/v1/completions", json=body) as stream:
        lines = stream.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        srv.proc.send_signal(15)
        rest = [line[len("data: "):] for line in lines if line]
    assert rest[-1] == "[DONE]"
    error = json.loads(rest[-2])
    assert error["error"]["code"] == "shutting_down" and error["error"]["type"] == "unavailable_error"
    assert "after" in error["error"]["message"] and "tokens" in error["error"]["message"]
    pieces = [json.loads(e) for e in rest[:-2]]
    assert all(p["choices"][0]["finish_reason"] is None and "timings" not in p for p in pieces)
    assert srv.proc.wait(T) == 0
    assert "Traceback" not in srv.log()
    assert srv.stopped() == {"answered": answered, "finished": 0, "interrupted": 1, "in_prompt": 0,
                             "queued": 0, "refused": 0}
