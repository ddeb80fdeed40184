"""Slots of `specrun serve`: N engines over one shared model, each serving one request at a time.

A slot's engine is an Engine of its own (-np 1, --no-cont-batching), or one sequence of the
batched context (kernels/batch.py: SeqEngine, the same generate() over one decode loop for every
slot). A request takes an idle slot (the one whose KV cache shares the longest prefix with its
prompt) or waits in a bounded FIFO queue; a full queue raises `Busy`, a stopping server `ShuttingDown`.
The generation itself runs in a thread of its own, which hands text to the event loop as it comes
and gives the slot back the moment it ends: end of generation, a stop string, max tokens, or
`Run.cancel()` (the client gone, or the server stopping), which the engine sees between two prompt
chunks (n_ubatch tokens) or two target passes. An Engine decodes in that thread (llama.cpp releases
the GIL); a batched slot's thread only turns the loop's tokens into text.

One thread per run, ended with it, never a pool of long-lived slot threads: llama.cpp's CPU
backend runs its graphs with OpenMP, and libgomp keeps a team of worker threads for every thread
that ever started a parallel region, for that thread's lifetime. Once it manages more threads than
there are CPUs, it stops spinning at its barriers and sleeps on a futex at each of them (hundreds
per decode), and every later decode is slower (docs/server.md has the numbers). A thread that ends
takes its team with it; the batched loop's thread ends too once no request is left.

Shutdown (`begin_shutdown`, then `drain`): the waiting requests fail with ShuttingDown at once, the
runs in flight get up to the drain timeout to finish, then are cancelled and awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np

from specrun.kernels.batch import SeqEngine
from specrun.kernels.engine import Engine
from specrun.kernels.params import SpecParams
from specrun.kernels.stats import GenStats
from specrun.kernels.types import SamplingParams, Stops, TokenLogprob, common_prefix

from ..runtime.text import TextRun

log = logging.getLogger(__name__)

# a streamed job's text goes to the event loop at most this often (its first piece at once): every
# piece wakes the loop, and its event's work takes CPU from the decode's threads (docs/server.md)
STREAM_EVERY_S = 0.025

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
    logprobs: int | None = None  # None: none; n: each token's log-probability and its n likeliest alternatives
    cache_prompt: bool = True    # False: the slot forgets its cached prompt first (the whole prompt is evaluated)
    stream: bool = True          # False: the text comes with the Outcome only, no event per piece (a
                                 # wake-up of the event loop per target pass costs the decode threads CPU)
    id_slot: int = -1            # llama-server's id_slot: this slot (modulo their number), waiting for it; -1: any


@dataclass(frozen=True, slots=True)
class Outcome:
    text: str
    tokens: list[int]
    stop_type: str               # "eos" | "limit" | "word" | "interrupted"
    stopping_word: str
    n_cached: int                # prompt tokens reused from the slot's KV cache
    stats: GenStats
    logprobs: list[TokenLogprob] | None = None   # one per token of `tokens`, when the job asked

    @property
    def finish_reason(self) -> str | None:
        return {"eos": "stop", "word": "stop", "limit": "length"}.get(self.stop_type)


def generate(engine: Engine | SeqEngine, job: Job, emit: Callable[[str], None], cancel: threading.Event,
             started: Callable[[GenStats], None] = lambda stats: None) -> Outcome:
    """Run one job on one engine (in the slot's thread); emit(text) as it is decided. cancel stops
    it between two prompt chunks or two target passes (stop_type "interrupted"). started(stats):
    the generation's live statistics, once it has begun."""
    if not job.cache_prompt:
        engine.reset()
    gen = engine.generate(job.prompt, job.n_predict, job.sampling, spec=job.spec, cancel=cancel.is_set,
                          logprobs=job.logprobs, stops=Stops.of(job.stop, job.stop_tokens))
    started(gen.stats)
    run = TextRun(gen, engine.model, stops=job.stop, stop_tokens=job.stop_tokens, cancel=cancel.is_set)
    try:
        for piece in run:
            emit(piece)
    finally:
        run.close()
    c = run.result
    st = c.stats
    cached = len(job.prompt) - st.n_prompt if st.n_gen else 0   # n_gen == 0: no prefill (n_predict 0)
    lp = None
    if gen.logprobs is not None:   # a stop string's tokens past the returned text are not part of it
        lp = gen.logprobs[:text_tokens(engine.model, c.tokens, c.text) if c.stop == "word" else len(c.tokens)]
    return Outcome(c.text, c.tokens, _STOP_TYPE.get(c.stop, "limit"), c.stopping_word, cached, st, lp)


def text_tokens(model, tokens: list[int], text: str) -> int:
    """How many of `tokens` begin inside `text` (the text they decode to, cut short): a token that
    a cut splits counts, the ones after it do not. By bytes, so a character split across tokens
    is handled: " Paris" + "." cut at "." -> 1; cut at "aris" (text " P") -> 1; at the start -> 0."""
    n_bytes, at = len(text.encode("utf-8")), 0
    for i, t in enumerate(tokens):
        if at >= n_bytes:
            return i
        at += len(model.piece(t))
    return len(tokens)


class Busy(Exception):
    """Every slot is taken and the queue is full."""


class ShuttingDown(Exception):
    """The server is stopping: it takes no new work. queued: the request had been waiting for a slot."""

    def __init__(self, message: str, queued: bool = False) -> None:
        super().__init__(message)
        self.queued = queued


@dataclass(slots=True)
class Slot:
    id: int
    engine: Engine | SeqEngine
    busy: bool = False
    last: Run | None = None      # the run in flight, or the last one (GET /slots)


@dataclass(frozen=True, slots=True)
class Drained:
    """What a drain did with the runs in flight when the server was told to stop."""

    finished: int              # ended on their own within the drain timeout
    interrupted: int           # cancelled when it expired
    interrupted_in_prompt: int  # ...of which before their first token (prompt processing stopped)


class Pieces:
    """A streamed job's text pieces, handed to post() joined, at most every STREAM_EVERY_S: a piece
    that comes sooner waits for the next one (so for at most one target pass), or for flush()."""

    def __init__(self, post: Callable[[str], None], clock: Callable[[], float] = time.perf_counter) -> None:
        self.post, self.clock = post, clock
        self.held: list[str] = []
        self.t_last = float("-inf")

    def __call__(self, piece: str) -> None:
        self.held.append(piece)
        if self.clock() - self.t_last >= STREAM_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.held:
            self.post("".join(self.held))
            self.held.clear()
            self.t_last = self.clock()


class Run:
    """One job in flight on a slot. events() yields text pieces (a streamed job's), then the Outcome
    (or raises the engine's exception); cancel(reason) stops it between two chunks or passes. `ended` is done
    once the slot is given back; `stopped_by` says who cancelled it ("client" | "shutdown")."""

    def __init__(self, pool: SlotPool, slot: Slot, job: Job, id_task: int = 0) -> None:
        self.slot = slot
        self.job = job
        self.id_task = id_task
        self.text: list[str] = []              # the pieces so far (GET /slots' "generated")
        self.stats: GenStats | None = None     # the generation's live statistics, once it has begun
        self.stopped_by: str | None = None
        self.result: Outcome | Exception | None = None
        self.ended: asyncio.Future = pool.loop.create_future()
        self._cancel = threading.Event()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pool = pool
        self._loop = pool.loop
        self.thread = threading.Thread(target=self._work, name=f"slot-{slot.id}", daemon=True)
        pool.threads.add(self.thread)
        self.thread.start()

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:   # the loop is closed (a forced exit): nobody waits for this run any more
            pass

    def _work(self) -> None:
        result: Outcome | Exception
        pieces = Pieces(lambda s: self._post(self._queue.put_nowait, s))

        def emit(piece: str) -> None:
            self.text.append(piece)
            if self.job.stream:
                pieces(piece)

        try:
            result = generate(self.slot.engine, self.job, emit, self._cancel,
                              lambda stats: setattr(self, "stats", stats))
            pieces.flush()
            self._pool.on_outcome(self.job, result)
        except Exception as e:  # handed to the request's task, which answers with it
            log.exception("generation failed on slot %d", self.slot.id)
            try:
                self.slot.engine.reset()
            except Exception:  # the context is unusable; the next request will say so
                log.exception("could not reset slot %d", self.slot.id)
            result = e
        # the result and the slot's release in one step on the loop: /slots never shows a busy slot
        # whose run has its result (has_next_token false while is_processing)
        self._post(self._end, result)
        self._post(self._queue.put_nowait, result)
        self._pool.threads.discard(self.thread)

    def _end(self, result: Outcome | Exception) -> None:
        self.result = result
        self._pool.release(self.slot)
        if not self.ended.done():
            self.ended.set_result(None)

    def fail(self, err: Exception) -> None:
        """End the run now with err (its slot thread is blocked for good: an RPC worker lost); the
        slot is not given back."""
        if not self.ended.done():
            self.result = err
            self._queue.put_nowait(err)
            self.ended.set_result(None)

    def cancel(self, reason: str = "client") -> None:
        """Stop the run at the next prompt chunk or target pass; no-op once it has ended."""
        if self.ended.done():
            return
        if self.stopped_by is None:
            self.stopped_by = reason
        self._cancel.set()

    @property
    def shut_down(self) -> bool:
        """The server's shutdown stopped this run before its end."""
        return self.stopped_by == "shutdown" and isinstance(self.result, Outcome) \
            and self.result.stop_type == "interrupted"

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
    except on_outcome (any thread)."""

    def __init__(self, engines: list[Engine | SeqEngine], max_queue: int,
                 on_outcome: Callable[[Job, Outcome], None] = lambda job, outcome: None) -> None:
        self.slots = [Slot(i, e) for i, e in enumerate(engines)]
        self.max_queue = max_queue
        self.on_outcome = on_outcome
        self.threads: set[threading.Thread] = set()   # the runs' threads still going (any thread may discard)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        self._waiters: deque[tuple[asyncio.Future, int | None]] = deque()   # (future, the slot id it waits for)
        self._runs: set[Run] = set()
        self.n_tasks = 0                     # runs started (their id_task)
        self.lost: Exception | None = None   # an RPC worker lost (worker_lost): nothing more runs

    # -- an RPC worker lost ----------------------------------------------------------------------
    def worker_lost(self, err: Exception) -> None:
        """Called on llama.cpp's RPC thread (kernels/rpc.py) when a worker stopped answering: the runs
        in flight and the waiting requests fail with err, and so does every later request. Their
        slot threads stay blocked inside llama.cpp for good, so close() does not wait for them."""
        self.lost = err
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):   # the loop is closed: nobody waits any more
                self.loop.call_soon_threadsafe(self._fail_all, err)

    def _fail_all(self, err: Exception) -> None:
        for r in list(self._runs):
            r.fail(err)
        while self._waiters:
            fut, _ = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(err)

    @property
    def n_busy(self) -> int:
        return sum(s.busy for s in self.slots)

    @property
    def n_waiting(self) -> int:
        return sum(not f.done() for f, _ in self._waiters)

    async def start(self, job: Job) -> Run:
        """Take a slot (waiting in the queue if need be) and start the job on it. Cancelling the
        caller while it waits gives its place in the queue up."""
        self.loop = asyncio.get_running_loop()
        slot = await self._acquire(job.prompt, job.id_slot)
        run = Run(self, slot, job, self.n_tasks)
        self.n_tasks += 1
        slot.last = run
        self._runs.add(run)
        return run

    async def _acquire(self, prompt: np.ndarray, id_slot: int = -1) -> Slot:
        """An idle slot (the one whose cache shares the longest prefix with prompt; id_slot >= 0: that
        slot, modulo their number, as llama-server), or a place in the queue until one is handed over.
        An idle slot never has a waiter that could take it (release hands a slot over at once)."""
        if self.lost is not None:
            raise self.lost
        if self.closing:
            raise ShuttingDown("the server is shutting down and takes no new requests")
        want = None if id_slot < 0 else id_slot % len(self.slots)
        idle = [s for s in self.slots if not s.busy and want in (None, s.id)]
        if idle:
            slot = max(idle, key=lambda s: common_prefix(s.engine.kv_tokens, prompt))
            slot.busy = True
            return slot
        if self.n_waiting >= self.max_queue:
            which = f"slot {want} is busy" if want is not None else f"all {len(self.slots)} slots are busy"
            raise Busy(f"{which} and {self.n_waiting} requests are waiting (--queue {self.max_queue}); retry later")
        fut = self.loop.create_future()
        entry = (fut, want)
        self._waiters.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:   # handed a slot as the client left
                self.release(fut.result())
            raise
        finally:
            try:
                self._waiters.remove(entry)
            except ValueError:
                pass

    def release(self, slot: Slot) -> None:
        """Hand slot to the first waiter that can take it (it stays busy), else make it idle."""
        self._runs = {r for r in self._runs if r.slot is not slot}
        for entry in list(self._waiters):
            fut, want = entry
            if fut.done():
                self._waiters.remove(entry)
            elif want in (None, slot.id):
                self._waiters.remove(entry)
                fut.set_result(slot)   # stays busy: handed over
                return
        slot.busy = False

    # -- shutdown ------------------------------------------------------------------------------
    def begin_shutdown(self) -> int:
        """Take no new work; every waiting request fails with ShuttingDown now. Returns how many waited."""
        self.closing = True
        n = 0
        while self._waiters:
            fut, _ = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(ShuttingDown("the server is shutting down; this request was waiting for "
                                               "a slot and was not started", queued=True))
                n += 1
        return n

    async def drain(self, timeout: float) -> Drained:
        """Wait up to timeout seconds for the runs in flight to end, then cancel the rest and wait
        for them (each stops at its next prompt chunk or target pass). Call after begin_shutdown;
        cancel_all("shutdown") meanwhile (a second signal) ends it early."""
        end = self.loop.time() + timeout if self.loop else 0.0
        seen: set[Run] = set()
        while self.n_busy and self.lost is None:   # a lost worker's slots stay busy for good
            runs = [r for r in self._runs if not r.ended.done()]
            seen.update(runs)
            if not runs:   # a slot handed to a waiter whose task has not started its run yet
                await asyncio.sleep(0.01)
                continue
            left = end - self.loop.time()
            if left > 0:
                await asyncio.wait([r.ended for r in runs], timeout=left, return_when=asyncio.FIRST_COMPLETED)
                continue
            for r in runs:
                r.cancel("shutdown")
            await asyncio.wait([r.ended for r in runs])
        stopped = [r for r in seen if r.shut_down]     # a run may have ended just as it was cancelled
        in_prompt = sum(1 for r in stopped if r.result.stats.n_gen == 0)
        return Drained(len(seen) - len(stopped), len(stopped), in_prompt)

    def cancel_all(self, reason: str = "shutdown") -> None:
        for r in list(self._runs):
            r.cancel(reason)

    def close(self) -> None:
        if self.lost is not None:   # slot threads blocked in llama.cpp: neither wait nor free under them
            return
        self.cancel_all()
        for t in list(self.threads):
            t.join()
        for s in reversed(self.slots):   # the first engine owns the shared model: close it last
            s.engine.close()
