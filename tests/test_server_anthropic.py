"""`specrun serve` speaking Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens),
as llama-server does, to the real `anthropic` client over loopback; and llama-server's chat helpers
(/apply-template, /v1/chat/completions/input_tokens) and its aliases without /v1 (/chat/completions,
/completions, /models). The answer to a conversation is the one /v1/chat/completions gives (the
same template, the same greedy text), streamed or not; stop sequences, max_tokens and a prefilled
assistant turn end and continue it as Anthropic documents; what the server cannot do is a 400 in
Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from serving import MODEL, T
from test_server import REPEAT

pytestmark = pytest.mark.slow

SYSTEM = "You are terse."
ASK = "Name three colors."
KEY = "sk-ant-test"
GREEDY = {"temperature": 0}    # the client names no sampling fields any more: they travel as extra body


@pytest.fixture(scope="module")
def server(servers):
    with servers.start("-m", MODEL, "-c", "512", "-np", "2", "-t", "1", "-n", "64", api_key=KEY) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, timeout=T, max_retries=0)


def chat(server, messages: list[dict], **kw) -> dict:
    r = server.post("/v1/chat/completions", {"messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_messages_answer_as_chat_completions(server, client):
    msg = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, system=SYSTEM,
                                 messages=[{"role": "user", "content": ASK}])
    ref = chat(server, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}], max_tokens=24)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == ref["choices"][0]["message"]["content"]
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[ref["choices"][0]["finish_reason"]]
    assert msg.stop_sequence is None
    assert msg.usage.output_tokens == ref["usage"]["completion_tokens"]
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == ref["usage"]["prompt_tokens"]
    # content blocks, and the system prompt as blocks, are the same conversation
    again = client.messages.create(model=MODEL, max_tokens=24, extra_body=GREEDY, system=[{"type": "text", "text": SYSTEM}],
                                   messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}])
    assert again.content[0].text == msg.content[0].text and again.usage.cache_read_input_tokens > 0   # reused prompt


def test_stream_events_are_anthropics_and_carry_the_same_text(server, client):
    kw = dict(model=MODEL, max_tokens=32, extra_body=GREEDY, messages=[{"role": "user", "content": ASK}])
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    # the wire: every event named by its data's type, in Anthropic's order
    body = {k: v for k, v in kw.items() if k != "extra_body"} | GREEDY | {"stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, timeout=T,
                      headers={"x-api-key": KEY}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    events = [ln.removeprefix("event: ") for ln in lines[0::2]]
    datas = [json.loads(ln.removeprefix("data: ")) for ln in lines[1::2]]
    assert events == [d["type"] for d in datas]
    assert events[:2] == ["message_start", "content_block_start"] and events[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}
    assert "".join(d["delta"]["text"] for d in datas[2:-3]) == text
    assert datas[-2]["delta"]["stop_reason"] == whole.stop_reason
    # message_start comes once the prompt is evaluated: its prompt counts are the final ones (a repeat: cached)
    start, end = datas[0]["message"]["usage"], datas[-2]["usage"]
    assert start["cache_read_input_tokens"] > 0 and start == {**end, "output_tokens": 0}


def test_stop_sequences_max_tokens_and_prefill(server, client):
    user = [{"role": "user", "content": "Repeat exactly:\n" + REPEAT}]
    full = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=user).content[0].text
    word = full.split()[3]
    cut = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, messages=user, stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == full[:full.index(word)]
    short = client.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, messages=user)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3 and full.startswith(short.content[0].text)
    # a final assistant message is continued, as /v1/chat/completions continues it
    start = {"role": "assistant", "content": "The quick"}
    msg = client.messages.create(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=[*user, start])
    assert msg.content[0].text == chat(server, [*user, start], max_tokens=12)["choices"][0]["message"]["content"]
    # per-request speculative decoding: the same text
    spec = client.messages.create(model=MODEL, max_tokens=40, messages=user,
                                  extra_body={**GREEDY, "speculative": {"type": "ngram-simple", "n_max": 8}})
    assert spec.content[0].text == full


def test_count_tokens_apply_template_and_input_tokens_agree(server, client):
    messages = [{"role": "user", "content": ASK}]
    n = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages).input_tokens
    oai = [{"role": "system", "content": SYSTEM}, *messages]
    got = server.post("/v1/chat/completions/input_tokens", {"messages": oai}).json()
    assert got == {"input_tokens": n, "object": "response.input_tokens"}
    assert server.post("/chat/completions/input_tokens", {"messages": oai}).json() == got
    prompt = server.post("/apply-template", {"messages": oai}).json()["prompt"]
    assert SYSTEM in prompt and ASK in prompt and prompt.endswith("<|im_start|>assistant\n")
    assert len(server.post("/tokenize", {"content": prompt, "add_special": True})
               .json()["tokens"]) == n == chat(server, oai, max_tokens=1)["usage"]["prompt_tokens"]
    # llama-server's paths without /v1
    assert server.post("/chat/completions", {"messages": oai, "max_tokens": 4, "temperature": 0}).json()[
        "choices"][0]["message"]["content"] == chat(server, oai, max_tokens=4)["choices"][0]["message"]["content"]
    assert server.post("/completions", {"prompt": "Hello", "n_predict": 2}).json()["tokens_predicted"] == 2
    assert server.http.get("/models").json()["data"][0]["id"] == MODEL


@pytest.mark.parametrize("body, words", [
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools: not supported by this server (it has no "
                                                                      "tool calling)"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "a content block of type 'image'"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
     "a content block of type 'tool_result'"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking: not supported"),
    ({"stop_sequences": ["x", ""]}, "stop_sequences: a stop string is empty"),
    ({"messages": []}, "messages: "),
    ({"temperature": "hot"}, "temperature: "),
])
def test_what_the_server_cannot_do_is_a_400_in_anthropics_shape(server, client, body, words):
    req = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **body}
    r = server.post("/v1/messages", req)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error" and words in err["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="invalid_request_error"):
        client.messages.create(model=MODEL, max_tokens=4, messages=req["messages"],
                               extra_body={k: v for k, v in body.items() if k != "messages"})


def test_a_wrong_key_is_a_401_in_anthropics_shape(server):
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", timeout=T, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}, timeout=T)    # elsewhere: OpenAI's
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key" and "type" not in r.json()
