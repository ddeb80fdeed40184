"""Slots of `specrun serve`: N engines over one shared model, each serving one request at a time.

A request takes an idle slot (the one whose KV cache shares the longest prefix with its prompt)
or waits in a bounded FIFO queue; a full queue raises `Busy`. The generation itself runs in a
worker thread (llama.cpp releases the GIL), which hands text to the event loop as it comes and
gives the slot back the moment it ends: end of generation, a stop string, max tokens, or the
client gone (`Run.cancel()`: the engine's generator is closed after the token in flight).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from specrun.kernels.engine import Engine
from specrun.kernels.params import SpecParams
from specrun.kernels.stats import GenStats
from specrun.kernels.types import SamplingParams, common_prefix

from ..runtime.text import TextRun

log = logging.getLogger(__name__)

# Completion.stop -> llama-server's stop_type
_STOP_TYPE = {"eog": "eos", "turn": "eos", "word": "word", "interrupted": "interrupted",
              "n_predict": "limit", "ctx": "limit"}


@dataclass(frozen=True, slots=True)
class Job:
    endpoint: str                # for the metrics' label
    prompt: np.ndarray           # int32 [n], 1 <= n < n_ctx (checked by the caller)
    n_predict: int               # -1: until end of generation or a full context
    sampling: SamplingParams
    spec: SpecParams | None      # None: the server's --spec-* options
    stop: tuple[str, ...] = ()
    stop_tokens: frozenset[int] = frozenset()   # a chat template's turn stops (chat requests)


@dataclass(frozen=True, slots=True)
class Outcome:
    text: str
    tokens: list[int]
    stop_type: str               # "eos" | "limit" | "word" | "interrupted"
    stopping_word: str
    n_cached: int                # prompt tokens reused from the slot's KV cache
    stats: GenStats

    @property
    def finish_reason(self) -> str | None:
        return {"eos": "stop", "word": "stop", "limit": "length"}.get(self.stop_type)


def generate(engine: Engine, job: Job, emit: Callable[[str], None], cancel: threading.Event) -> Outcome:
    """Run one job on one engine (in the slot's thread); emit(text) as it is decided."""
    run = TextRun(engine.generate(job.prompt, job.n_predict, job.sampling, spec=job.spec), engine.model,
                  stops=job.stop, stop_tokens=job.stop_tokens, cancel=cancel.is_set)
    try:
        for piece in run:
            emit(piece)
    finally:
        run.close()
    c = run.result
    st = c.stats
    cached = len(job.prompt) - st.n_prompt if st.n_gen else 0   # n_gen == 0: no prefill (n_predict 0)
    return Outcome(c.text, c.tokens, _STOP_TYPE.get(c.stop, "limit"), c.stopping_word, cached, st)


class Busy(Exception):
    """Every slot is taken and the queue is full."""


@dataclass(slots=True)
class Slot:
    id: int
    engine: Engine
    busy: bool = False


class Run:
    """One job in flight on a slot. events() yields text pieces, then the Outcome (or raises the
    engine's exception); cancel() stops it after the token in flight."""

    def __init__(self, pool: SlotPool, slot: Slot, job: Job) -> None:
        self.slot = slot
        self.job = job
        self._cancel = threading.Event()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pool = pool
        post = pool.loop.call_soon_threadsafe
        self._future = pool.executor.submit(self._work, post)

    def _work(self, post) -> None:
        result: object
        try:
            result = generate(self.slot.engine, self.job, lambda s: post(self._queue.put_nowait, s), self._cancel)
            self._pool.on_outcome(self.job, result)
        except Exception as e:  # handed to the request's task, which answers with it
            log.exception("generation failed on slot %d", self.slot.id)
            try:
                self.slot.engine.reset()
            except Exception:  # the context is unusable; the next request will say so
                log.exception("could not reset slot %d", self.slot.id)
            result = e
        finally:
            post(self._pool.release, self.slot)
        post(self._queue.put_nowait, result)

    def cancel(self) -> None:
        self._cancel.set()

    async def events(self) -> AsyncIterator[str | Outcome]:
        while True:
            ev = await self._queue.get()
            if isinstance(ev, Exception):
                raise ev
            yield ev
            if isinstance(ev, Outcome):
                return

    async def outcome(self) -> Outcome:
        async for ev in self.events():
            if isinstance(ev, Outcome):
                return ev
        raise AssertionError("a run ends with its outcome")


class SlotPool:
    """The slots and the bounded FIFO queue of requests waiting for one. Event-loop side only,
    except on_outcome (any thread) and cancel_all (signal handler)."""

    def __init__(self, engines: list[Engine], max_queue: int,
                 on_outcome: Callable[[Job, Outcome], None] = lambda job, outcome: None) -> None:
        self.slots = [Slot(i, e) for i, e in enumerate(engines)]
        self.max_queue = max_queue
        self.on_outcome = on_outcome
        self.executor = ThreadPoolExecutor(len(engines), thread_name_prefix="slot")
        self.loop: asyncio.AbstractEventLoop | None = None
        self._waiters: deque[asyncio.Future] = deque()
        self._runs: set[Run] = set()

    @property
    def n_busy(self) -> int:
        return sum(s.busy for s in self.slots)

    @property
    def n_waiting(self) -> int:
        return sum(not f.done() for f in self._waiters)

    async def start(self, job: Job) -> Run:
        """Take a slot (waiting in the queue if need be) and start the job on it."""
        self.loop = asyncio.get_running_loop()
        slot = await self._acquire(job.prompt)
        run = Run(self, slot, job)
        self._runs.add(run)
        return run

    async def _acquire(self, prompt: np.ndarray) -> Slot:
        idle = [s for s in self.slots if not s.busy]
        if idle and not self.n_waiting:
            slot = max(idle, key=lambda s: common_prefix(s.engine.kv_tokens, prompt))
            slot.busy = True
            return slot
        if self.n_waiting >= self.max_queue:
            raise Busy(f"all {len(self.slots)} slots are busy and {self.n_waiting} requests are waiting "
                       f"(--queue {self.max_queue}); retry later")
        fut = self.loop.create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():   # handed a slot just as the client left
                self.release(fut.result())
            raise
        finally:
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass

    def release(self, slot: Slot) -> None:
        self._runs = {r for r in self._runs if r.slot is not slot}
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)   # stays busy: handed over
                return
        slot.busy = False

    def cancel_all(self) -> None:
        for r in list(self._runs):
            r.cancel()

    def close(self) -> None:
        self.cancel_all()
        self.executor.shutdown(wait=True)
        for s in reversed(self.slots):   # the first engine owns the shared model: close it last
            s.engine.close()
