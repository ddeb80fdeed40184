"""Pure parts of the server, without a model: stop strings held back while undecided, the slot
queue (FIFO hand-over, bounded, a waiter that leaves), the Prometheus text."""

from __future__ import annotations

import asyncio

import pytest

from specrun.cli.runtime.text import StopScanner
from specrun.cli.server.metrics import Metrics
from specrun.cli.server.slots import Busy, Job, Outcome, SlotPool
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
                 'specrun_errors_total{code="400"} 1', "specrun_slots 2", "# TYPE specrun_drafts_total counter"]:
        assert want in lines, want
