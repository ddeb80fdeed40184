"""Parts of the server without a real model: stop strings held back while undecided, the slot queue
(FIFO hand-over, bounded, a waiter that leaves, shutdown and drain), the slots' runs leaving no
threads behind (on SmolLM2), the Prometheus text, the
listening socket (TCP_NODELAY on accepted connections), the exposure warning, the chat template's
time limit, and the ASGI layers (Gate while loading; Guard: API key, body limit and timeout, UTF-8,
503 while stopping, a JSON 500 that keeps the connection)."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from types import SimpleNamespace

import numpy as np
import pytest
from pydantic import BaseModel

from specrun.cli.runtime.text import StopScanner
from specrun.cli.serve_cmd import exposure_warning, listen_socket
from specrun.cli.server.limits import TemplateTimeout, time_limited
from specrun.cli.server.metrics import Metrics
from specrun.cli.server.middleware import Gate, Guard
from specrun.cli.server.slots import STREAM_EVERY_S, Busy, Job, Outcome, Pieces, Run, ShuttingDown, SlotPool
from specrun.cli.server.state import ServerState, text_offsets
from specrun.kernels.chat_template import ChatTemplate
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams
from specrun.kernels.stats import DrafterStats, GenStats
from specrun.kernels.types import SamplingParams


@pytest.mark.parametrize("stops,pieces,sent,final,hit", [
    ((), ["ab", "cd"], ["ab", "cd"], "abcd", None),
    (("X",), ["ab", "cXd"], ["ab", "c"], "abc", "X"),
    # "</" could start "</s>": held back until decided
    (("</s>",), ["a<", "/", "b"], ["a", "", "</b"], "a</b", None),
    (("</s>",), ["a<", "/", "s>tail"], ["a", "", ""], "a", "</s>"),
    # a stop string split over three pushes, then nothing more is sent
    (("STOP",), ["xS", "TO", "P!", "more"], ["x", "", "", ""], "x", "STOP"),
    # the earliest of two stop strings wins
    (("cd", "b"), ["abcd"], ["a"], "a", "b"),
    # a longer partial match of another stop string holds back more
    (("zz", "yzq"), ["ayz"], ["a"], "ayz", None),
])
def test_stop_scanner(stops, pieces, sent, final, hit):
    s = StopScanner(stops)
    assert [s.push(p) for p in pieces] == sent
    tail = s.flush() if s.hit is None else ""
    assert "".join(sent) + tail == final
    assert s.text == final and s.hit == hit


class FakeEngine:
    def __init__(self, kv=()) -> None:
        self.kv_tokens = list(kv)
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_slot_pool_prefers_the_longest_cached_prefix_then_queues_fifo_and_bounds():
    async def scenario():
        pool = SlotPool([FakeEngine([1, 2]), FakeEngine([5, 6, 7])], max_queue=2)
        pool.loop = asyncio.get_running_loop()
        a = await pool._acquire([5, 6, 9])
        assert a.id == 1                                   # shares [5, 6]
        b = await pool._acquire([1])
        assert b.id == 0 and pool.n_busy == 2
        w1 = asyncio.ensure_future(pool._acquire([0]))
        w2 = asyncio.ensure_future(pool._acquire([0]))
        await asyncio.sleep(0)
        assert pool.n_waiting == 2
        with pytest.raises(Busy, match="2 requests are waiting"):
            await pool._acquire([0])
        w1.cancel()                                         # a waiter that leaves gives its place up
        await asyncio.sleep(0)
        assert pool.n_waiting == 1
        pool.release(a)
        assert (await w2) is a and pool.n_busy == 2         # handed over, still busy
        pool.release(a)
        pool.release(b)
        assert pool.n_busy == 0 and pool.n_waiting == 0
        pool.close()
        assert all(s.engine.closed for s in pool.slots)

    asyncio.run(scenario())


def test_id_slot_takes_that_slot_or_waits_for_it_while_others_go_on():
    """llama-server's id_slot: that slot (modulo their number) even where another caches more of
    the prompt; while it is busy the request waits for it alone, and requests for any slot take
    the others in the meantime, in their order."""
    async def scenario():
        pool = SlotPool([FakeEngine([1, 2]), FakeEngine([5, 6, 7])], max_queue=4)
        pool.loop = asyncio.get_running_loop()
        a = await pool._acquire([5, 6, 9], id_slot=0)
        assert a.id == 0                                   # slot 1 shares [5, 6]: not asked for
        w = asyncio.ensure_future(pool._acquire([0], id_slot=2))   # 2 % 2: slot 0, busy
        await asyncio.sleep(0)
        assert pool.n_waiting == 1
        b = await pool._acquire([1])                      # any: slot 1 is idle, the waiter wants 0
        assert b.id == 1
        later = asyncio.ensure_future(pool._acquire([0]))  # any: waits behind the waiter for slot 0
        await asyncio.sleep(0)
        pool.release(b)                                   # slot 1 goes to the later one, not to w
        assert (await later) is b and not w.done()
        pool.release(a)
        assert (await w) is a
        with pytest.raises(Busy, match="slot 1 is busy"):
            pool.max_queue = 0
            await pool._acquire([0], id_slot=1)
        pool.release(a)
        pool.release(b)
        assert pool.n_busy == 0 and pool.n_waiting == 0

    asyncio.run(scenario())


def test_metrics_text():
    m = Metrics(("ngram-simple",))
    st = GenStats(n_prompt=7, n_gen=20, t_prompt_s=0.5, t_gen_s=1.0, n_target_passes=9,
                  drafters=[DrafterStats("ngram-simple")])
    st.drafters[0].record(4, 3)
    st.drafters[0].record(2, 0)
    job = Job("/completion", None, 20, SamplingParams(), None)
    m.record(job, Outcome("x", [1] * 20, "limit", "", 0, st))
    m.error(400)
    text = m.render(slots=2, busy=0, waiting=0, queue=16)
    lines = set(text.splitlines())
    for want in ['specrun_requests_total{endpoint="/completion"} 1', "specrun_tokens_generated_total 20",
                 "specrun_prompt_tokens_total 7", 'specrun_drafts_total{spec_type="ngram-simple"} 2',
                 'specrun_draft_tokens_total{spec_type="ngram-simple"} 6',
                 'specrun_draft_tokens_accepted_total{spec_type="ngram-simple"} 3',
                 'specrun_draft_accepted_per_position_total{spec_type="ngram-simple",position="2"} 1',
                 'specrun_draft_accepted_per_position_total{spec_type="ngram-simple",position="3"} 0',
                 'specrun_errors_total{code="400"} 1', "specrun_slots 2", "# TYPE specrun_drafts_total counter",
                 "specrun_requests_abandoned_total 0", "specrun_requests_preparing 0"]:
        assert want in lines, want
    m.abandoned()
    m.preparing(+1)
    lines = set(m.render(slots=2, busy=0, waiting=0, queue=16).splitlines())
    assert {"specrun_requests_abandoned_total 1", "specrun_requests_preparing 1"} <= lines
    assert m.n_finished == 1



def test_timings_count_tokens_per_second_as_llama_server():
    """predicted_per_second is llama-server's: the tokens after the first (which the prompt's logits
    give) over the time from the first token to the last; so 128 tokens in 1.27 s read 100 tok/s."""
    st = GenStats(n_prompt=40, n_gen=128, t_prompt_s=0.08, t_gen_s=1.27, n_target_passes=50)
    t = ServerState.timings(Outcome("x", [1] * 128, "limit", "", 0, st))
    assert t["predicted_n"] == 128 and t["predicted_per_second"] == pytest.approx(100.0)
    assert t["predicted_per_token_ms"] == pytest.approx(10.0) and t["prompt_per_second"] == pytest.approx(500.0)
    assert st.tokens_per_pass == pytest.approx(127 / 50)
    assert GenStats(n_gen=1, t_gen_s=0.0).gen_tps == 0.0 and GenStats(n_gen=1, t_gen_s=1e-6).gen_tps == 0.0

# ---- shutdown of the slot pool -------------------------------------------------------------------


class FakeRun:
    """A Run's face to the drain: ends by itself after `seconds`, or 0.01 s after cancel()."""

    shut_down = Run.shut_down

    def __init__(self, pool: SlotPool, slot, seconds: float) -> None:
        self.pool, self.slot, self.stopped_by, self.result = pool, slot, None, None
        self.ended = pool.loop.create_future()
        pool.loop.call_later(seconds, self._end, "limit")

    def cancel(self, reason: str = "client") -> None:
        if not self.ended.done():
            self.stopped_by = self.stopped_by or reason
            self.pool.loop.call_later(0.01, self._end, "interrupted")

    def _end(self, stop: str) -> None:
        if not self.ended.done():
            self.result = Outcome("", [], stop, "", 0, GenStats(n_gen=0 if stop == "interrupted" else 3))
            self.pool.release(self.slot)
            self.ended.set_result(None)


def test_shutdown_answers_the_queue_then_drains_and_interrupts_the_rest():
    async def scenario():
        pool = SlotPool([FakeEngine(), FakeEngine()], max_queue=4)
        pool.loop = asyncio.get_running_loop()
        quick, slow = await pool._acquire([1]), await pool._acquire([2])
        runs = [FakeRun(pool, quick, 0.05), FakeRun(pool, slow, 3600)]
        pool._runs = set(runs)
        waiters = [asyncio.ensure_future(pool._acquire([0])) for _ in range(3)]
        await asyncio.sleep(0)
        assert pool.n_waiting == 3
        assert pool.begin_shutdown() == 3
        for w in waiters:                              # answered at once, not after the drain
            with pytest.raises(ShuttingDown) as e:
                await w
            assert e.value.queued
        with pytest.raises(ShuttingDown) as e:         # a new request
            await pool._acquire([0])
        assert not e.value.queued
        drained = await pool.drain(0.3)
        assert (drained.finished, drained.interrupted, drained.interrupted_in_prompt) == (1, 1, 1)
        assert pool.n_busy == 0
        assert [(r.stopped_by, r.result.stop_type) for r in runs] == [(None, "limit"), ("shutdown", "interrupted")]

    asyncio.run(scenario())


def test_a_second_signal_interrupts_the_drain_at_once():
    async def scenario():
        pool = SlotPool([FakeEngine()], max_queue=1)
        pool.loop = asyncio.get_running_loop()
        run = FakeRun(pool, await pool._acquire([1]), 3600)
        pool._runs = {run}
        pool.begin_shutdown()
        pool.loop.call_later(0.05, pool.cancel_all, "shutdown")
        drained = await asyncio.wait_for(pool.drain(3600), 30)
        assert (drained.finished, drained.interrupted, drained.interrupted_in_prompt) == (0, 1, 1)
        assert run.stopped_by == "shutdown"

    asyncio.run(scenario())


def test_drain_with_nothing_in_flight_returns_at_once():
    async def scenario():
        pool = SlotPool([FakeEngine()], max_queue=1)
        pool.loop = asyncio.get_running_loop()
        assert pool.begin_shutdown() == 0
        drained = await asyncio.wait_for(pool.drain(3600), 5)
        assert (drained.finished, drained.interrupted) == (0, 0)

    asyncio.run(scenario())


# ---- the runs' threads --------------------------------------------------------------------------


def _n_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts this process's threads in /proc")
def test_runs_leave_no_threads_behind(smollm_path):
    """Two slots busy at once, then each alone: once idle, the process has the threads it had before
    any run. libgomp keeps a team of OpenMP workers for every thread that ever decoded, and with more
    of them than CPUs every barrier of every later decode sleeps (slots.py: 3x slower for good)."""
    path = str(smollm_path)
    params = EngineParams(n_ctx=256, n_threads=2)
    first = Engine(path, params)
    try:
        second = Engine(path, params, model=first.model)
    except BaseException:
        first.close()
        raise
    pool = SlotPool([first, second], max_queue=2)    # closes both
    job = Job("completion", np.array([1, 7, 8, 9], dtype=np.int32), 8, SamplingParams(temp=0.0), None, stream=False)
    threads: list = []

    async def serve(n: int) -> list[Outcome]:
        runs = [await pool.start(job) for _ in range(n)]
        threads.extend(r.thread for r in runs)
        return [await r.outcome() for r in runs]

    def settled(n0: int) -> int:
        for t in threads:
            t.join(30)
        deadline = time.monotonic() + 10    # the OpenMP workers of an ended thread exit on their own
        while _n_threads() != n0 and time.monotonic() < deadline:
            time.sleep(0.01)
        return _n_threads()

    try:
        n0 = _n_threads()
        both = asyncio.run(serve(2))
        assert both[0].stats.n_gen > 0 and both[0].tokens == both[1].tokens
        assert settled(n0) == n0
        for _ in range(2):
            (alone,) = asyncio.run(serve(1))
            assert alone.tokens == both[0].tokens
            assert settled(n0) == n0
    finally:
        pool.close()


# ---- the listening socket, the exposure warning ---------------------------------------------------


def test_listen_socket_sets_tcp_nodelay_on_accepted_connections():
    """asyncio sets TCP_NODELAY on an accepted socket only when its protocol is IPPROTO_TCP."""
    async def scenario():
        with listen_socket("127.0.0.1", 0) as sock:
            assert sock.proto == socket.IPPROTO_TCP
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            accepted: asyncio.Future = asyncio.get_running_loop().create_future()

            class Proto(asyncio.Protocol):
                def connection_made(self, transport) -> None:
                    s = transport.get_extra_info("socket")
                    accepted.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                    transport.close()

            server = await asyncio.get_running_loop().create_server(Proto, sock=sock)
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            assert await asyncio.wait_for(accepted, 30) == 1
            writer.close()
            server.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("address,key,warns", [
    ("127.0.0.1", None, False), ("127.0.0.2", None, False), ("::1", None, False),
    ("0.0.0.0", None, True), ("::", None, True), ("192.168.1.7", None, True), ("0.0.0.0", "k", False),
])
def test_exposure_warning(address, key, warns):
    w = exposure_warning(address, key)
    assert (w is not None) == warns
    if warns:
        assert w == (f"specrun serve: warning: listening on {address} without --api-key: anyone who can reach this "
                     "address can use the model; give --api-key KEY, or bind 127.0.0.1")


# ---- the chat template's time limit -------------------------------------------------------------


def test_template_time_limit_stops_a_looping_template():
    loop = ChatTemplate("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x")
    with pytest.raises(TemplateTimeout, match="time limit of 0.2 s"):
        time_limited(lambda: loop.render([{"role": "user", "content": "hi"}]), 0.2)
    ok = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert time_limited(lambda: ok.render(msgs)) == ok.render(msgs) == "<user>hi<assistant>yo<assistant>"


# ---- ASGI layers -----------------------------------------------------------------------------------


async def asgi(app, method="POST", path="/v1/completions", headers=(), body_parts=(b"{}",), hang=False):
    """Call an ASGI app once; returns (status, headers, body) of its response (status None: none)."""
    parts = list(body_parts)
    sent: list[dict] = []

    async def receive():
        if parts:
            chunk = parts.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(parts) or hang}
        if hang:
            await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers]}
    await asyncio.wait_for(app(scope, receive, send), 30)
    start = next((m for m in sent if m["type"] == "http.response.start"), None)
    if start is None:
        return None, {}, b""
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


async def echo(scope, receive, send):
    """The app behind Guard in these tests: 200 with the body it received."""
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def guard(app=echo, **config) -> Guard:
    cfg = SimpleNamespace(**{"api_key": None, "max_body": 100, "body_timeout": 0.2, **config})
    return Guard(app, SimpleNamespace(config=cfg, metrics=Metrics(()), stopping=False, n_refused=0))


def test_gate_answers_loading_then_the_app():
    gate = Gate()
    status, headers, body = asyncio.run(asgi(gate, "GET", "/health"))
    assert status == 503 and headers["retry-after"] == "1"
    assert json.loads(body) == {"error": {"message": "Loading model", "type": "unavailable_error", "code": "loading"}}
    gate.app = echo
    assert asyncio.run(asgi(gate, body_parts=(b"hi",)))[::2] == (200, b"hi")


@pytest.mark.parametrize("headers,parts,hang,status,code", [
    ((), (b'{"a": 1}',), False, 200, None),
    ((), (b"x" * 60, b"x" * 40), False, 200, None),                  # exactly the limit, in two parts
    ((("Content-Length", "101"),), (), True, 413, "body_too_large"),  # refused before reading anything
    ((), (b"x" * 60, b"x" * 41), False, 413, "body_too_large"),       # chunked: counted as it comes
    ((("Content-Length", "50"),), (b"x" * 10,), True, 408, "body_timeout"),
    ((), (b'{"prompt": "\xff"}',), False, 400, "invalid_json"),
])
def test_guard_body(headers, parts, hang, status, code):
    got, resp_headers, body = asyncio.run(asgi(guard(), headers=headers, body_parts=parts, hang=hang))
    assert got == status
    if code is None:
        assert body == b"".join(parts)
    else:
        assert json.loads(body)["error"]["code"] == code
        assert resp_headers.get("connection") == ("close" if status in (408, 413) else None)


def test_guard_messages_carry_the_numbers():
    g = guard()
    _, _, body = asyncio.run(asgi(g, headers=(("Content-Length", "101"),), body_parts=(), hang=True))
    assert json.loads(body)["error"]["message"] == ("the request body is 101 bytes, above this server's limit of 100 "
                                                    "(--max-body)")
    _, _, body = asyncio.run(asgi(g, headers=(("Content-Length", "50"),), body_parts=(b"x" * 10,), hang=True))
    assert json.loads(body)["error"]["message"] == ("the request body did not arrive within 0.2 s (--body-timeout): "
                                                    "got 10 of 50 bytes")
    assert g.state.metrics.errors == {"413": 1, "408": 1}


@pytest.mark.parametrize("headers,status", [
    ((), 401), ((("Authorization", "Bearer k"),), 200), ((("Authorization", "bearer k"),), 200),
    ((("X-Api-Key", "k"),), 200), ((("X-Api-Key", "K"),), 401), ((("Authorization", "k"),), 401),
])
def test_guard_api_key(headers, status):
    assert asyncio.run(asgi(guard(api_key="k"), headers=headers))[0] == status
    assert asyncio.run(asgi(guard(api_key="k"), "GET", "/health", body_parts=()))[0] == 200     # open


def test_guard_while_stopping_refuses_all_but_metrics():
    g = guard()
    g.state.stopping = True
    status, headers, body = asyncio.run(asgi(g))
    assert status == 503 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "shutting_down"
    assert asyncio.run(asgi(g, "GET", "/health"))[0] == 503
    assert asyncio.run(asgi(g, "GET", "/metrics", body_parts=()))[0] == 200
    assert g.state.n_refused == 1      # the health check is not a refused request


def test_guard_turns_an_exception_into_a_json_500():
    async def broken(scope, receive, send):
        raise UnicodeEncodeError("utf-8", "ab\ud800", 2, 3, "surrogates not allowed")

    status, headers, body = asyncio.run(asgi(guard(broken)))
    assert status == 500 and "connection" not in headers
    assert json.loads(body)["error"]["code"] == "internal_error"


def test_streamed_pieces_go_out_at_once_then_at_most_every_interval_and_none_is_lost():
    now = [100.0]
    sent: list[str] = []
    p = Pieces(sent.append, clock=lambda: now[0])
    p("Once")                              # the first piece: at once
    assert sent == ["Once"]
    for piece in (" upon", " a"):          # sooner than the interval: held
        now[0] += STREAM_EVERY_S / 4
        p(piece)
    assert sent == ["Once"]
    now[0] += STREAM_EVERY_S               # the interval is over: the held pieces go with this one
    p(" time")
    assert sent == ["Once", " upon a time"]
    now[0] += STREAM_EVERY_S / 10
    p(",")
    p.flush()                              # the run's end: what is held goes out
    p.flush()                              # nothing held: nothing sent
    assert sent == ["Once", " upon a time", ","]


def test_text_offsets_count_characters_not_pieces():
    """A character split over byte-fallback pieces counts once, at its start; an invalid byte as
    the U+FFFD the text shows."""
    assert text_offsets([b"a", b"\xe6\x9d", b"\xb1", b"b"]) == [0, 1, 1, 2]          # a東b
    assert text_offsets([b"\xe9", b"\xa6", b"\x96", b"x"]) == [0, 0, 0, 1]            # 首x
    assert text_offsets([b"\xff", b"ab", b"\xf0\x9f", b"\x98\x80", b"!"]) == [0, 1, 3, 3, 4]   # ?ab😀!
    assert text_offsets([]) == []


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain",
                                          "application/json", "application/json; charset=utf-8"])
def test_guard_reads_every_body_as_json_as_llama_server(content_type):
    """`curl -d '{...}'` sends application/x-www-form-urlencoded; llama-server parses the body as
    JSON whatever the Content-Type, and so does a FastAPI route behind Guard."""
    from fastapi import FastAPI

    app = FastAPI()
    app.add_api_route("/v1/completions", _completions, methods=["POST"])

    headers = () if content_type is None else (("Content-Type", content_type),)
    status, _, body = asyncio.run(asgi(guard(app, max_body=1000), headers=headers, body_parts=(b'{"prompt": "hi"}',)))
    assert (status, json.loads(body)) == (200, {"prompt": "hi"})


class _Prompt(BaseModel):
    prompt: str


async def _completions(body: _Prompt) -> dict:
    return {"prompt": body.prompt}
