"""`specrun serve -np 4`: the slots share one batched decode (continuous batching, -cb, the
default; kernels/batch.py). Requests of different lengths, endpoints, spec types and logit controls
run at once, three more joining as slots free up, and each answer equals the same request served
alone by a one-slot server with --spec-type none (the Engine). The requests are started together
by holding the batch loop until they are all in (BatchRunner.pause), never by sleeping. Also: a
client that leaves mid-stream ends only its request; a common system prompt is copied between
slots; -nocb and the settings that cannot be batched keep an engine per slot."""

from __future__ import annotations

import json
import threading

import pytest
from serving import MODEL, T, delta, serve_options, wait_for
from test_server import REPEAT

pytestmark = pytest.mark.slow

BATCHED = ("-m", MODEL, "-c", "512", "-np", "4", "-n", "64")
ALONE = ("-m", MODEL, "-c", "512", "-np", "1", "-n", "64", "--spec-type", "none")
SYSTEM = "You are a careful assistant. You answer in one short sentence, and you never use lists."

# (endpoint, body): every kind of request a client may send, each with its own spec type
REQUESTS = [
    ("/completion", {"prompt": REPEAT, "n_predict": 48, "speculative": {"type": "ngram-simple"}}),
    ("/completion", {"prompt": "def fib(n):\n", "n_predict": 24}),
    ("/completion", {"prompt": REPEAT + "Once more:", "n_predict": 40, "speculative": {"type": "ngram-mod"}}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": "Repeat exactly:\n" + REPEAT}],
                              "max_tokens": 32, "temperature": 0.8, "seed": 42,
                              "speculative": {"type": "ngram-simple", "n_max": 6}}),
    ("/v1/completions", {"prompt": "Count: 1, 2, 3,", "max_tokens": 30, "stop": [", 9"], "logprobs": 2,
                         "speculative": {"type": "ngram-map-k"}}),
    ("/completion", {"prompt": "A cat as JSON:", "n_predict": 40, "repeat_penalty": 1.2,
                     "logit_bias": [[" dog", -3.0]], "speculative": {"type": "ngram-simple"},
                     "json_schema": {"type": "object", "properties": {"name": {"type": "string"}}}}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM},
                                           {"role": "user", "content": "Name a colour."}],
                              "max_tokens": 20, "stream": True, "speculative": {"type": "ngram-mod"}}),
    ("/completion", {"prompt": "Once upon a time", "n_predict": 20, "ignore_eos": True, "stream": True,
                     "presence_penalty": 0.5}),
]


@pytest.fixture(scope="module")
def batched(servers):
    return servers.shared(*BATCHED)


@pytest.fixture(scope="module")
def alone(servers):
    return servers.shared(*ALONE)


def runner_of(srv):
    return srv.state.pool.slots[0].engine.runner


def post(srv, path: str, body: dict) -> dict:
    """The answer as one dict: a JSON body's, or a stream's events joined (text, and its last event)."""
    body = {"temperature": 0, **body}
    if not body.get("stream"):
        r = srv.http.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()
    with srv.http.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events and not any("error" in e for e in events), events
    if path == "/completion":
        return {"content": "".join(e["content"] for e in events), "tokens": events[-1]["tokens"]}
    return {"content": "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])}


def text(answer: dict) -> tuple:
    """What must be equal: the text, and the tokens and logprobs where the endpoint gives them."""
    if "content" in answer:
        return answer["content"], answer.get("tokens")
    ch = answer["choices"][0]
    if "message" in ch:
        return ch["message"]["content"], ch["finish_reason"]
    return ch["text"], ch["finish_reason"], ch["logprobs"]


def plain(body: dict) -> dict:
    return {**body, "speculative": {"type": "none"}}


def test_concurrent_requests_each_equal_alone_with_spec_none(batched, alone):
    """Eight requests at once on four slots: the first four join the same first step, the others
    take slots as they free up. Each answer equals the one-slot server's with --spec-type none."""
    runner, pool = runner_of(batched), batched.state.pool
    before = batched.metrics()
    out: dict[int, dict] = {}
    barrier = threading.Barrier(len(REQUESTS))

    def go(i: int) -> None:
        path, body = REQUESTS[i]
        barrier.wait(T)
        out[i] = post(batched, path, body)

    runner.pause()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(REQUESTS))]
    try:
        for t in threads:
            t.start()
        wait_for("four requests in the batch, four waiting for a slot",
                 lambda: runner.n_queued == 4 and pool.n_waiting == len(REQUESTS) - 4)
    finally:
        runner.resume()
    for t in threads:
        t.join(4 * T)
    assert sorted(out) == list(range(len(REQUESTS)))
    after = batched.metrics()
    for i, (path, body) in enumerate(REQUESTS):
        assert text(out[i]) == text(post(alone, path, plain(body))), (i, body)
    # the steps decoded several slots at once, and the n-gram requests drafted
    assert delta(after, before, "specrun_batch_sequences_total") > 2 * delta(after, before, "specrun_batch_steps_total")
    assert delta(after, before, "specrun_draft_tokens_total") > 0
    assert out[0]["timings"]["draft_n_accepted"] > 0
    lp = out[4]["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["top_logprobs"]) > 0 and all(len(t) == 2 for t in lp["top_logprobs"])


def test_a_long_prompt_takes_the_fast_path_beside_a_short_one(batched, alone):
    """A prompt of 256+ tokens goes through the fast prompt context, as on the one-slot server,
    while another slot starts beside it: both answers equal the one-slot server's."""
    runner = runner_of(batched)
    fast = runner.engine.prefill
    assert fast is not None
    reqs = [("/completion", {"prompt": "Long: " + REPEAT * 4 + "Once more:", "n_predict": 24,
                             "speculative": {"type": "ngram-simple"}}),
            ("/completion", {"prompt": "def fib(n):\n", "n_predict": 24})]
    out: dict[int, dict] = {}

    def go(i: int) -> None:
        out[i] = post(batched, *reqs[i])

    runner.pause()
    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(reqs))]
    try:
        for t in threads:
            t.start()
        wait_for("both requests queued", lambda: runner.n_queued == len(reqs))
    finally:
        runner.resume()
    for t in threads:
        t.join(4 * T)
    assert fast.n_evaluated >= 256 and out[0]["timings"]["prompt_n"] == fast.n_evaluated
    for i, (path, body) in enumerate(reqs):
        assert text(out[i]) == text(post(alone, path, plain(body))), (i, body)


def test_a_system_prompt_is_copied_between_slots(batched, alone):
    """Two chat requests with one system prompt, let into the same step: the second copies the
    prefix the first evaluates (seq_cp) and evaluates only its own tail; both answers are the
    one-slot server's."""
    runner = runner_of(batched)
    users = ["Name a fruit that is red.", "Name a tree that grows tall."]
    bodies = [{"messages": [{"role": "system", "content": "Today is a holiday. " + SYSTEM},   # no slot holds it
                            {"role": "user", "content": u}], "max_tokens": 12} for u in users]
    out: dict[int, dict] = {}
    runner.pause()
    threads = [threading.Thread(target=lambda i=i: out.update({i: post(batched, "/v1/chat/completions", bodies[i])}))
               for i in range(2)]
    try:
        for t in threads:
            t.start()
        wait_for("both in the batch's queue", lambda: runner.n_queued == 2)
    finally:
        runner.resume()
    for t in threads:
        t.join(4 * T)
    evaluated = sorted(out[i]["timings"]["prompt_n"] for i in range(2))
    n_prompt = out[0]["usage"]["prompt_tokens"]
    assert evaluated[0] < n_prompt // 2 < evaluated[1]     # the second: only its own tail
    for i in range(2):
        assert text(out[i]) == text(post(alone, "/v1/chat/completions", bodies[i]))


def test_a_client_that_leaves_ends_only_its_request(batched, alone):
    """Two requests in one batch; the stream's client leaves after its first event: its request is
    interrupted (its slot idle again), and the other's answer is unchanged."""
    runner = runner_of(batched)
    before = batched.metrics()
    body = {"prompt": REPEAT, "n_predict": 48, "speculative": {"type": "ngram-simple"}}
    other: dict[str, dict] = {}
    th = threading.Thread(target=lambda: other.update(a=post(batched, "/completion", body)))
    runner.pause()
    try:
        th.start()
        with batched.http.stream("POST", "/completion", json={"prompt": "1, 2, 3, 4, 5,", "n_predict": 64,
                                                                 "ignore_eos": True, "stream": True}) as s:
            lines = s.iter_lines()
            wait_for("both in the batch's queue", lambda: runner.n_queued == 2)
            runner.resume()
            assert next(line for line in lines if line.startswith("data: "))
    finally:
        runner.resume()
    th.join(4 * T)
    after = wait_for("both recorded, no slot busy", lambda: (m := batched.metrics())
                     and delta(m, before, "specrun_requests_total") == 2 and m["specrun_slots_busy"] == 0 and m)
    assert delta(after, before, "specrun_requests_interrupted_total") == 1
    assert delta(after, before, "specrun_tokens_generated_total") < 48 + 64
    assert text(other["a"]) == text(post(alone, "/completion", plain(body)))


def test_batched_slots_are_said_and_counted(batched):
    line = batched.loader.built.ready_line(batched.url)
    assert "(4 slots in one batched decode, ctx 512," in line
    assert {s.engine.n_ctx for s in batched.state.pool.slots} == {512}
    r = batched.http.get("/props").json()
    assert r["total_slots"] == 4 and r["default_generation_settings"]["n_ctx"] == 512
    m = batched.metrics()
    assert "specrun_batch_steps_total" in m and m["specrun_slots"] == 4


def test_no_cont_batching_keeps_an_engine_per_slot(servers):
    from specrun.kernels.engine import Engine

    with servers.start("-m", MODEL, "-c", "256", "-np", "2", "-n", "8", "-nocb") as srv:
        assert all(isinstance(s.engine, Engine) for s in srv.state.pool.slots)
        assert "batched" not in srv.loader.built.ready_line(srv.url)
        assert "specrun_batch_steps_total" not in srv.metrics()
        assert srv.completion("The capital of France is", 6)["content"]


def test_threads_go_to_the_one_context():
    from specrun.kernels.llama import default_threads

    opt = serve_options(("-m", MODEL, "-np", "4"))
    assert opt.cont_batching and opt.batch_threads == default_threads()
    assert opt.params.n_threads == max(1, default_threads() // 4)     # an engine per slot: divided
    opt = serve_options(("-m", MODEL, "-np", "2", "-t", "3", "--no-cont-batching"))
    assert not opt.cont_batching and opt.batch_threads == 3 and opt.params.n_threads == 3


def test_what_cannot_be_batched_says_why():
    from specrun.kernels.batch import not_batchable
    from specrun.kernels.params import EngineParams, SpecParams

    assert not_batchable(EngineParams(spec=SpecParams(types=("ngram-simple", "draft-simple")))) == ""
    assert "hidden rows" in not_batchable(EngineParams(spec=SpecParams(types=("draft-mtp",))))
    assert "hidden rows" in not_batchable(EngineParams(spec=SpecParams(types=("draft-eagle3",))))
    assert "--no-exact" in not_batchable(EngineParams(exact=False))
    assert "recurrent" in not_batchable(EngineParams(), recurrent=True)


def test_settings_that_cannot_be_batched_load_an_engine_per_slot(tmp_path, monkeypatch, capsys):
    """draft-mtp reads hidden rows: one line says why, and each slot gets an engine of its own with
    its share of the threads (-nocb's), over one model loaded once."""
    from specrun.cli.server.lifecycle import load_engines
    from specrun.gguf_spec.testmodel import Head, SynthConfig
    from specrun.kernels.engine import Engine
    from specrun.kernels.testmodel import build_test_model

    path = build_test_model(tmp_path / "mtp.gguf", SynthConfig(head=Head.parse("exact")), "q8_0")
    monkeypatch.setenv("LLAMA_ARG_THREADS", "2")
    opt = serve_options(("-m", str(path), "-c", "256", "-np", "2", "--spec-type", "draft-mtp"))
    engines = load_engines(opt)
    try:
        assert all(type(e) is Engine for e in engines) and len(engines) == 2
        assert [e.params.n_threads for e in engines] == [1, 1] and engines[1].model is engines[0].model
        assert "each slot decodes with an engine of its own, not in one batch (--spec-type draft-mtp reads" \
            in capsys.readouterr().err
    finally:
        for e in reversed(engines):
            e.close()


def test_bad_request_on_a_batched_slot_is_a_400(batched):
    r = batched.post("/completion", {"prompt": "x", "n_predict": 4, "logit_bias": [[10**7, 1.0]]})
    assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
    assert batched.completion("The capital of France is", 4)["content"]
