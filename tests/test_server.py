"""`specrun serve` on 127.0.0.1 (SmolLM2-135M, 2 slots), driven by the official openai client and by
httpx, every request with a timeout: OpenAI shapes, streaming, stop strings, speculative equality,
/metrics accounting, chat equal to the REPL's ChatSession, bad input (refused fields, unencodable
text), load from 8 clients with an RSS bound, and a fuzz of request bodies from the server's own
OpenAPI schema, against the server in this process (tests/serving.py); its start (503 `loading`)
and the same load through a SIGTERM against it as a process. Waits are on events (/metrics,
/health, the server's log), each bounded by T."""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from serving import MODEL, SPECRUN, ServerProcess, T, delta, metric_sum, wait_for

__all__ = ["MODEL", "REPEAT", "SPECRUN", "T", "ServerProcess", "delta", "metric_sum", "wait_for"]   # test_rpc
pytestmark = pytest.mark.slow

# A period longer than ngram-simple's 12-token pattern: it drafts on this (a shorter period never
# drafts, as in llama.cpp: the last occurrence is too recent to give 12 tokens).
REPEAT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.\n" * 4
ARGS = ("-m", MODEL, "-c", "512", "-np", "2", "-n", "64")


@pytest.fixture(scope="module")
def server(servers):
    """In process, shared by every module that asks for these arguments."""
    return servers.shared(*ARGS)


@pytest.fixture(scope="module")
def process(tmp_path_factory):
    """The same server as a process: for its start (503 `loading` while the model loads) and for
    SIGTERM (its drain, its exit code and its last line)."""
    srv = ServerProcess(tmp_path_factory.mktemp("serve"), *ARGS)
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


def test_completion_prompt_of_one_token_list(server):
    """OpenAI's prompt may also be a list of one list of token ids: the same answer as the ids."""
    ids = [504, 3575, 282, 4649, 314]
    one = server.post("/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    nested = server.post("/v1/completions", {"prompt": [ids], "max_tokens": 6, "temperature": 0}).json()
    assert nested["choices"] == one["choices"] and nested["usage"] == one["usage"]
    assert one["usage"]["prompt_tokens"] == len(ids)


def test_tokenize_detokenize_and_props_as_llama_server(server):
    def post(path, body):
        r = server.post(path, body)
        assert r.status_code == 200, r.text
        return r.json()

    text = "The capital of France is Paris. 東京"
    ids = post("/tokenize", {"content": text})["tokens"]
    assert ids and all(isinstance(t, int) for t in ids)
    assert post("/detokenize", {"tokens": ids}) == {"content": text}
    # the same ids as the server's own prompt: /completion of the ids and of the text agree
    assert server.completion(ids, 4)["content"] == server.completion(text, 4)["content"]
    pieces = post("/tokenize", {"content": text, "with_pieces": True})["tokens"]
    assert [p["id"] for p in pieces] == ids
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode() == text and any(isinstance(p["piece"], list) for p in pieces)   # 東 京: split bytes
    end = post("/tokenize", {"content": "<|im_end|>"})["tokens"]
    assert len(end) == 1 and post("/detokenize", {"tokens": end}) == {"content": "<|im_end|>"}
    assert len(post("/tokenize", {"content": "<|im_end|>", "parse_special": False})["tokens"]) > 1
    assert post("/tokenize", {"content": ["a", 42, "b"]})["tokens"] == [*post("/tokenize", {"content": "a"})["tokens"],
                                                                        42, *post("/tokenize", {"content": "b"})["tokens"]]
    for path, body in (("/tokenize", {"content": ["a", 10**6]}), ("/detokenize", {"tokens": [-1]})):
        r = server.post(path, body)
        assert r.status_code == 400 and "out of the vocabulary (0..49151)" in r.json()["error"]["message"], r.text

    props = server.http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] == 512 and props["total_slots"] == 2
    assert props["default_generation_settings"]["params"]["n_predict"] == 64
    assert props["model_alias"] == MODEL and props["model_path"] == MODEL   # the -m value as typed, no path of this machine
    assert "<|im_start|>" in props["chat_template"] and props["eos_token"] == "<|im_end|>"
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}


def test_slots_show_each_slots_request_in_flight_and_last(server, servers):
    """GET /slots as llama-server's: per slot its request in flight or last one, its progress and
    settings, but not what the client typed (prompt, text, stop strings, grammar) unless
    --slots-debug; ?fail_on_no_slot=1 is a 503 while every slot is busy; --no-slots turns it off
    (501, llama-server's message)."""
    prompt = "Slots test: the capital of France is"
    done = server.completion(prompt, 12, seed=7, stop=["secret stop"])
    slots = server.http.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 512 for s in slots)
    s = slots[done["id_slot"]]
    assert s["is_processing"] is False and s["speculative"] is False
    assert "prompt" not in s and "generated" not in s and "secret" not in json.dumps(s)
    assert s["n_prompt_tokens"] == done["tokens_evaluated"]
    assert s["n_prompt_tokens_cache"] == done["tokens_cached"]
    assert s["n_prompt_tokens_processed"] == done["tokens_evaluated"] - done["tokens_cached"]
    assert s["next_token"] == [{"has_next_token": False, "has_new_line": "\n" in done["content"],
                                "n_remain": 12 - done["tokens_predicted"], "n_decoded": done["tokens_predicted"]}]
    private = ("stop", "grammar", "logit_bias")
    assert s["params"] == {k: v for k, v in {**done["generation_settings"], "stream": False}.items()
                           if k not in private}
    assert isinstance(s["id_task"], int)
    # id_slot (llama-server's): the request runs on that slot, modulo their number
    assert [server.completion(prompt, 2, id_slot=k)["id_slot"] for k in (1, 0, 3)] == [1, 0, 1]
    r = server.post("/completion", {"prompt": prompt, "n_predict": 2, "id_slot": -2})
    assert r.status_code == 400 and "id_slot" in r.json()["error"]["message"]

    # two requests at once: both slots busy, seen in flight with their text so far
    seen, busy_503 = [], []
    threads = [threading.Thread(target=server.completion, args=(f"{i}: Count to a hundred:", 64),
                                kwargs={"ignore_eos": True}) for i in range(2)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        # the plain GET for what is in flight: with both slots busy the whole time (a slow machine)
        # every ?fail_on_no_slot=1 answer is a 503
        seen += [x for x in server.http.get("/slots").json() if x["is_processing"] and x["next_token"][0]["n_decoded"]]
        r = server.http.get("/slots", params={"fail_on_no_slot": "1"})
        if r.status_code == 503:
            busy_503.append(r.json()["error"]["message"])
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert busy_503 and "no slot available" in busy_503[0]
    assert seen and all(0 < x["next_token"][0]["n_decoded"] and x["next_token"][0]["has_next_token"] for x in seen), seen
    assert server.http.get("/slots", params={"fail_on_no_slot": "1"}).status_code == 200     # idle again
    with servers.start("-m", MODEL, "-c", "256", "-n", "4", "--slots-debug") as debug:
        done = debug.completion(prompt, 4, seed=7, stop=["secret stop"])
        s = debug.http.get("/slots").json()[0]
        assert s["prompt"].endswith(prompt) and s["generated"] == done["content"]
        assert s["params"] == {**done["generation_settings"], "stream": False}
    with servers.start("-m", MODEL, "-c", "256", "-n", "4", "--no-slots") as off:
        r = off.http.get("/slots")
        assert r.status_code == 501 and r.json() == {"error": {
            "message": "This server does not support slots endpoint. Start it with `--slots`",
            "type": "not_supported_error", "code": "not_supported_error"}}, r.text


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
    assert meta["spec_types_available"] == ["none", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix"]


def test_model_by_id(server):
    r = server.http.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200
    assert r.json() == server.http.get("/v1/models").json()["data"][0]
    assert server.client().models.retrieve(MODEL).id == MODEL
    r = server.http.get("/v1/models/gpt-4o")
    assert r.status_code == 404
    assert r.json()["error"] == {"message": f"model 'gpt-4o' is not served here; this server serves '{MODEL}'",
                                 "type": "not_found_error", "code": "model_not_found"}


def test_health_head_and_v1(server):
    get = server.http.get("/health")
    assert get.status_code == 200 and get.json() == {"status": "ok", "slots_idle": 2, "slots_processing": 0}
    head = server.http.head("/health")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == "application/json"
    assert server.http.get("/v1/health").json() == get.json()
    assert server.http.head("/v1/health").status_code == 200


def test_loading_answers_503_then_ok(process):
    """The process's port answers from its first log line on: 503 `loading` until the model is loaded
    (about a second for this model on this machine, so the polls at 20 ms intervals see it), then 200."""
    loading = (503, {"error": {"message": "Loading model", "type": "unavailable_error", "code": "loading"}})
    assert len(process.statuses) >= 2
    assert process.statuses[:-1] == [loading] * (len(process.statuses) - 1)
    assert process.statuses[-1][0] == 200


def test_openapi_schema_published(server):
    schema = server.http.get("/openapi.json").json()
    paths = schema["paths"]
    for p in ("/v1/completions", "/v1/chat/completions", "/completion", "/v1/models", "/health", "/metrics"):
        assert p in paths
    post = paths["/v1/completions"]["post"]
    assert "400" in post["responses"] and "422" not in post["responses"]
    assert "speculative" in schema["components"]["schemas"]["CompletionRequest"]["properties"]
    ids = [op["operationId"] for ops in paths.values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)   # OpenAPI: unique per operation


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


def test_chat_equals_the_repl_session(server, smollm_path):
    """A one-turn chat request gives the REPL's answer: ChatSession(engine, ChatFormat.load(model))
    on an engine in this process (the server's settings: ctx 512, one thread per slot, exact mode)."""
    from specrun.cli.runtime.chat import ChatFormat, ChatSession
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams
    from specrun.kernels.types import SamplingParams

    msg = "Name three colors."
    with Engine(str(smollm_path), EngineParams(n_ctx=512, n_threads=1)) as engine:
        fmt = ChatFormat.load(engine.model)
        prompt, _ = fmt.prompt([{"role": "user", "content": msg}])
        session = ChatSession(engine, fmt, SamplingParams(temp=0.0), n_predict=64)
        text = "".join(session.send(msg))
        turn = session.last
    assert text and turn.tokens
    r = server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": msg}],
                                                max_tokens=64, temperature=0)
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == len(turn.tokens)
    assert r.choices[0].finish_reason == ("stop" if turn.stop in ("eog", "turn") else "length")
    native = server.completion(prompt, 64)      # the same prompt tokens through /completion: the same tokens
    assert native["tokens"] == turn.tokens and native["content"] == text
    assert native["tokens_evaluated"] == len(prompt)


def test_a_final_assistant_message_is_continued(server, servers, smollm_path):
    """As llama-server (prefill_assistant): the messages before it with the assistant's generation
    prompt, then its content, and the answer goes on from there; --no-prefill-assistant closes it
    as a whole turn."""
    from specrun.cli.runtime.chat import ChatFormat
    from specrun.kernels.llama import Model

    user = {"role": "user", "content": "Count from 1 to 10."}
    start = {"role": "assistant", "content": "1, 2, 3,"}
    with Model(str(smollm_path)) as model:
        fmt = ChatFormat.load(model)
        continued = fmt.tokenize(fmt.render([user]) + start["content"])
        closed, _ = fmt.prompt([user, start])
    r = server.post("/v1/chat/completions", {"messages": [user, start], "max_tokens": 12, "temperature": 0}).json()
    assert r["usage"]["prompt_tokens"] == len(continued)
    assert r["choices"][0]["message"]["content"] == server.completion(continued, 12)["content"]
    r = server.post("/v1/chat/completions", {"messages": [user, start, start]})
    assert r.status_code == 400 and "two assistant messages" in r.json()["error"]["message"]
    with servers.start("-m", MODEL, "-c", "512", "-n", "8", "--no-prefill-assistant") as off:
        r = off.post("/v1/chat/completions", {"messages": [user, start], "max_tokens": 4, "temperature": 0}).json()
        assert r["usage"]["prompt_tokens"] == len(closed) != len(continued)


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


def test_cache_prompt_false_evaluates_the_whole_prompt(server):
    prompt = REPEAT + "Once more:"
    server.completion(prompt, 4)
    reused = server.completion(prompt, 4)
    full = server.completion(prompt, 4, cache_prompt=False)
    n = full["tokens_evaluated"]
    assert reused["tokens_cached"] > n // 2 and reused["timings"]["prompt_n"] < n // 2   # the slot's cache
    assert full["tokens_cached"] == 0 and full["timings"]["prompt_n"] == n    # llama-server's cache_prompt: false
    assert full["content"] == reused["content"]


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
    ("/v1/completions", b'{"prompt": "x", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json"),
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
    # fields that would change the answer and are not implemented: refused, never ignored
    ("/v1/completions", {"prompt": "x", "logprobs": 2, "stream": True}, 400, "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "stream": True}, 400,
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400,
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"}, 400,
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
     400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"},
                                           {"role": "tool", "content": "42", "tool_call_id": "c1"}]}, 400,
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None,
                                            "tool_calls": [{"id": "c1", "type": "function"}]}]}, 400,
     "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "suffix": " and so on."}, 400, "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, 400, "unsupported_parameter"),
    ("/v1/completions", {"prompt": [[504], [505]]}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]}, 400,
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "audio": {"voice": "alloy",
                                                                                      "format": "wav"}}, 400,
     "unsupported_parameter"),
    ("/completion", {"prompt": "x", "n_probs": 5}, 400, "unsupported_parameter"),
    ("/completion", {"prompt": "x", "logprobs": 5}, 400, "unsupported_parameter"),      # llama-server: n_probs
    ("/completion", {"prompt": "x", "post_sampling_probs": True}, 400, "unsupported_parameter"),
    ("/completion", {"prompt": "x", "speculative.n_max": 1}, 400, "unsupported_parameter"),   # llama-server ignores it
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "speculative.type": "none"}, 400,
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "post_sampling_probs": True}, 400, "unsupported_parameter"),
    # the logit controls: bad values are 400s naming the field and the fix
    ("/v1/completions", {"prompt": "x", "frequency_penalty": "0.5"}, 400, "invalid_value"),
    ("/completion", {"prompt": "x", "repeat_penalty": 0}, 400, "invalid_value"),
    ("/completion", {"prompt": "x", "repeat_last_n": -2}, 400, "invalid_value"),
    ("/completion", {"prompt": "x", "repeat_last_n": -1}, 400, "invalid_value"),       # as llama-server 0.3.36
    ("/v1/completions", {"prompt": "x", "repeat_last_n": -1}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "repeat_last_n": -1}, 400,
     "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"50256": -100}}, 400, "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"15": True}}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": [[15]]}, 400,
     "invalid_value"),
    ("/completion", {"prompt": "x", "logit_bias": [[15]]}, 400, "invalid_value"),
    ("/completion", {"prompt": "x", "grammar": "root ::= \"a"}, 400, "invalid_value"),
    ("/completion", {"prompt": "x", "grammar": "root ::= \"a\"{5,2}"}, 400, "invalid_value"),
    ("/completion", {"prompt": "x", "json_schema": {"type": "foo"}}, 400, "invalid_value"),
    ("/completion", {"prompt": "x", "json_schema": {}, "grammar": "root ::= \"a\""}, 400, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"},
                              "grammar": "root ::= \"a\""}, 400, "invalid_value"),
]

# A lone UTF-16 surrogate in every text field of every endpoint (json.dumps writes it as "\ud800").
LONE = "ab\ud800cd"
UNENCODABLE = [
    ("/v1/completions", {"prompt": LONE}, "prompt"),
    ("/v1/completions", {"prompt": [LONE]}, "prompt.0"),
    ("/v1/completions", {"prompt": "x", "stop": LONE}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": ["ok", LONE]}, "stop.1"),
    ("/v1/completions", {"prompt": "x", "model": LONE}, "model"),
    ("/v1/completions", {"prompt": "x", "speculative": {"type": LONE}}, "speculative.type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": LONE}]}, "messages.0.name"),
    ("/completion", {"prompt": LONE}, "prompt"),
    ("/completion", {"prompt": "x", "stop": [LONE]}, "stop.0"),
]
BAD += [(path, json.dumps(body).encode(), 400, "unencodable_text") for path, body, _ in UNENCODABLE]


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

    one = [{"role": "user", "content": "x"}]
    assert msg("/v1/completions", {"prompt": "x", "logprobs": 1, "stream": True}) == (
        "logprobs with stream: not supported by this server (log-probabilities come with the whole answer; ask "
        "without stream); "
        "leave logprobs with stream out")
    assert "top_logprobs needs logprobs: true" in msg("/v1/chat/completions", {"messages": one, "top_logprobs": 1})
    assert msg("/v1/chat/completions", {"messages": one, "tools": [{}]}).startswith("tools: not supported")
    m = msg("/completion", {"prompt": "x", "grammar": "root ::= \"a"})
    assert m.startswith("grammar: the grammar does not parse: unexpected end of input; fix the GBNF"), m
    m = msg("/v1/chat/completions", {"messages": one, "response_format": {"type": "json_schema",
                                                                         "json_schema": {"schema": {"type": "foo"}}}})
    assert m.startswith("response_format: the response_format schema cannot be turned into a grammar"), m
    assert msg("/completion", {"prompt": "x", "repeat_last_n": -1}) == (
        "repeat_last_n: Input should be greater than or equal to 0")
    assert "out of the vocabulary (0..49151)" in msg("/v1/completions", {"prompt": "x", "logit_bias": {"50256": 5}})
    m = msg("/v1/chat/completions", {"messages": [*one, {"role": "tool", "content": "1"}]})
    assert m.startswith("messages.1.role: not supported") and "'tool' messages" in m
    assert msg("/completion", {"prompt": "x", "n_probs": 2}).startswith("n_probs: not supported")
    assert msg("/completion", {"prompt": "x", "speculative.n_max": 1, "speculative.type": "none"}) == (
        'speculative.n_max: not supported by this server (per-request speculative settings are an object: '
        '"speculative": {"n_max": ..., "type": ...}); leave speculative.n_max out')
    # logprobs false, tool_choice "none", response_format text and an empty tools list change nothing: accepted
    ok = server.post("/v1/chat/completions", {"messages": one, "max_tokens": 1, "logprobs": False, "tools": [],
                                              "tool_choice": "none", "response_format": {"type": "text"},
                                              "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}})
    assert ok.status_code == 200, ok.text

    assert msg("/v1/completions", {"prompt": "x", "echo": True}).startswith("echo: not supported")
    assert msg("/v1/completions", {"prompt": "x", "suffix": "y"}).startswith("suffix: not supported")
    assert msg("/v1/completions", {"prompt": [[1], [2]]}) == "prompt: one prompt per request (got 2)"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    assert msg("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"},
                                                                                  image]}]}) == (
        "messages.0.content.1.type: not supported by this server (the model reads text only; send the text itself); "
        "leave a content part of type 'image_url' out")
    # echo false, an empty suffix, best_of 1 and text-only modalities change nothing: accepted
    ok = server.post("/v1/completions", {"prompt": "x", "max_tokens": 1, "echo": False, "suffix": "", "best_of": 1})
    assert ok.status_code == 200, ok.text
    ok = server.post("/v1/chat/completions", {"messages": one, "max_tokens": 1, "modalities": ["text"], "audio": None})
    assert ok.status_code == 200, ok.text

    assert "max_tokens" in msg("/v1/completions", {"prompt": "x", "max_tokens": 0})
    assert re.search(r"\(\d+ tokens, ctx 512\)", msg("/v1/completions", {"prompt": LONG}))
    m = msg("/v1/completions", {"prompt": "x", "speculative": {"type": "medusa"}})
    assert "medusa" in m and "ngram-simple" in m
    assert "available: none, ngram-simple" in msg("/v1/completions", {"prompt": "x", "speculative": {"type":
                                                                                                    "draft-mtp"}})
    r = server.http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,body,where", UNENCODABLE, ids=[f"{p}-{w}" for p, _, w in UNENCODABLE])
def test_unencodable_text_is_a_400_naming_the_field(server, path, body, where):
    r = server.http.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "unencodable_text"
    assert err["message"].startswith(f"{where}: the text holds a lone UTF-16 surrogate (U+D800 at character 2)")


@pytest.mark.parametrize("bad", [b'{"prompt": "ab\\ud800cd", "max_tokens": 1}', b'{"prompt": "ab\xffcd", "max_tokens": 1}'],
                         ids=["lone-surrogate", "invalid-utf8"])
def test_bad_text_keeps_the_connection_usable(server, bad):
    """The 400 comes on the same kept-alive connection as the next, valid request's 200."""
    conn = http.client.HTTPConnection("127.0.0.1", int(server.url.rsplit(":", 1)[1]), timeout=T)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", "/v1/completions", body=bad, headers=headers)
        r = conn.getresponse()
        assert r.status == 400 and json.loads(r.read())["error"]["code"] in ("unencodable_text", "invalid_json")
        assert r.getheader("connection") is None
        local = conn.sock.getsockname()
        conn.request("POST", "/v1/completions", body=b'{"prompt": "The capital of France is", "max_tokens": 2}',
                     headers=headers)
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 2
        assert conn.sock.getsockname() == local       # not a new connection
    finally:
        conn.close()


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


@pytest.fixture(scope="module")
def load_expected(server) -> dict[int, str]:
    """The greedy answer of load request i (i mod 20), asked one at a time: the three completion
    kinds agree, so one per prompt, and one chat."""
    expected = {i: _ask(server, i)[1] for i in range(20) if i % 4 in (0, 3)}
    for i in range(20):
        expected.setdefault(i, expected[next(j for j in range(20) if j % 5 == i % 5 and j % 4 == 0)])
    return expected


@pytest.mark.full
def test_load_8_clients_40_requests(server, load_expected):
    rss0 = server.rss_kib()
    before = server.metrics()
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda i: _ask(server, i), range(40)))
    after = server.metrics()
    rss1 = server.rss_kib()
    for i, text, _ in results:
        assert text == load_expected[i % 20], f"request {i}"
    assert {slot for _, _, slot in results if slot >= 0} == {0, 1}      # both slots served
    assert delta(after, before, "specrun_requests_total") == 40
    assert delta(after, before, "specrun_errors_total") == 0
    assert after["specrun_slots_busy"] == 0 and after["specrun_requests_waiting"] == 0
    grown = (rss1 - rss0) / 1024
    print(f"RSS before load {rss0 / 1024:.1f} MiB, after {rss1 / 1024:.1f} MiB (+{grown:.1f} MiB)")
    assert grown < 32, f"RSS grew by {grown:.1f} MiB over 40 requests"


def _attempt(client: httpx.Client, i: int) -> tuple[str, str]:
    """Load request i (the mix of _ask) sent raw through client, and what came of it: ("ok", text) for a whole answer;
    ("503", code) for a JSON error or an SSE error event (then [DONE]); ("gone", why) when no response
    began (the server had stopped listening); ("broken", why) for anything else: a 5xx, a cut body or
    stream, a 200 without a finish reason."""
    p = PROMPTS[i % len(PROMPTS)]
    kind = i % 4
    path, body = [("/completion", {"prompt": p, "n_predict": 12, "temperature": 0}),
                  ("/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0}),
                  ("/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0, "stream": True}),
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": p}], "max_tokens": 12,
                                            "temperature": 0})][kind]
    try:
        cm = client.stream("POST", path, json=body)
        r = cm.__enter__()
    except httpx.TransportError as e:
        return "gone", repr(e)
    try:
        raw = r.read().decode()
    except httpx.TransportError as e:
        return "broken", f"cut after the headers: {e!r}"
    finally:
        cm.__exit__(None, None, None)
    if r.status_code == 503:
        return "503", r.json()["error"]["code"]
    if r.status_code != 200:
        return "broken", f"{r.status_code} {raw[:200]}"
    if kind == 2:
        events = [line[len("data: "):] for line in raw.split("\n\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return "broken", f"a stream without [DONE]: {raw[-200:]!r}"
        objs = [json.loads(e) for e in events[:-1]]
        if "error" in objs[-1]:
            return "503", objs[-1]["error"]["code"]
        if objs[-1]["choices"][0]["finish_reason"] not in ("stop", "length"):
            return "broken", f"a stream without a finish reason: {raw[-200:]!r}"
        return "ok", "".join(o["choices"][0]["text"] for o in objs)
    out = json.loads(raw)
    if kind == 0:
        return ("ok", out["content"]) if out["stop_type"] in ("eos", "limit", "word") else ("broken", raw[-200:])
    choice = out["choices"][0]
    if choice["finish_reason"] not in ("stop", "length"):
        return "broken", f"a 200 without a finish reason: {raw[-200:]}"
    return "ok", choice["text"] if kind == 1 else "chat:" + choice["message"]["content"]


def test_load_through_sigterm(process, load_expected):
    """The load of test_load_8_clients_40_requests against the server's process, which gets SIGTERM
    once 12 answers are in. Every request ends in a whole, correct answer or a well-formed 503 (or
    finds the server gone once it has exited); the process exits 0, and its own count, in its last
    line, agrees exactly."""
    srv = process
    lock = threading.Lock()
    seq = iter(range(10**6))
    n_ok = 0
    twelve = threading.Event()

    def one(i: int) -> tuple[int, int, str, str, int]:
        nonlocal n_ok
        # the client is built first (its SSL context takes tens of ms on a loaded machine): between
        # `start` and the server seeing the request there is only the connect
        with httpx.Client(base_url=srv.url, timeout=T) as client:
            with lock:
                start = next(seq)
            kind, what = _attempt(client, i)
            with lock:
                end = next(seq)
                n_ok += kind == "ok"
                if n_ok == 12:
                    twelve.set()
        return i, start, kind, what, end

    try:
        with ThreadPoolExecutor(8) as ex:
            futures = [ex.submit(one, i) for i in range(40)]
            assert twelve.wait(4 * T), "12 answers"
            with lock:
                signalled = next(seq)
                srv.proc.send_signal(signal.SIGTERM)
            results = [f.result() for f in futures]
        assert srv.proc.wait(T) == 0
    finally:
        srv.kill()
    log = srv.log()
    assert "Traceback" not in log and "Error" not in log, log
    kinds = {"ok": 0, "503": 0, "gone": 0, "broken": 0}
    for i, start, kind, what, end in results:
        kinds[kind] += 1
        assert kind != "broken", f"request {i}: {what}"
        if kind == "ok":
            assert what == load_expected[i % 20], f"request {i}"
        if end < signalled:
            assert kind == "ok", f"request {i} ended before the signal: {kind} {what}"
        if kind == "503":
            assert what == "shutting_down" and end > signalled, f"request {i}"
        if kind == "gone":
            assert start > signalled, f"request {i}, begun before the signal, found the server gone: {what}"
    stopped = srv.stopped()
    print(f"outcomes {kinds}; the server says {stopped}")
    assert stopped["answered"] == kinds["ok"]
    assert stopped["queued"] + stopped["refused"] == kinds["503"]
    assert stopped["interrupted"] == 0 and kinds["ok"] >= 12


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
