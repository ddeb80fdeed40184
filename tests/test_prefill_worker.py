"""The fast prompt context in a child process (kernels/prefill_worker.py), on Gemma 3 270M (Q4_K_M:
its Q6_K matrices take llama.cpp's tiled kernel there).

What must hold, as in this process (tests/test_prefill.py): a prompt's result is a function of its
tokens alone; speculative output equals plain decoding through the hand-over; cancel stops between
blocks and a retry gives the fresh result. And the process's own faults: a worker that dies or
cannot start leaves one warning and the work in this process; close() ends the worker.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import numpy as np
import pytest

from specrun.kernels import prefill_worker
from specrun.kernels.drafters import DraftModel
from specrun.kernels.engine import Engine
from specrun.kernels.llama import Model
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.prefill import MIN_PROMPT, FastPrefill, fast_len
from specrun.kernels.prefill_worker import PrefillWorker, uses_worker
from specrun.kernels.types import SamplingParams

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"),
                                 reason="ggml's tiled kernel is x86's: elsewhere the fast context stays here")]

_CODE = (Path(__file__).parent / "data" / "copy_source.txt").read_text()
GREEDY = SamplingParams(temp=0.0)
SEEDED = SamplingParams(temp=0.8, seed=77)
PARAMS = EngineParams(n_ctx=2048)


def _run(e: Engine, prompt, n=24, sampling=GREEDY, **kw):
    gen = e.generate(prompt, n, sampling, logprobs=0, **kw)
    toks = [t for c in gen for t in c]
    return toks, [lp.logprob for lp in gen.logprobs], gen.stats


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def gemma(gemma_path):
    with Model(str(gemma_path)) as m:
        yield m


@pytest.fixture(scope="module")
def engine(gemma):
    with Engine(gemma.path, PARAMS, model=gemma) as e:
        toks = e.tokenize("Copy this file verbatim.\n\n" + _CODE + "\n\nCopy:\n\n" + _CODE)
        # the shortest prompts that show each property: "short" (256 + 44) crosses MIN_PROMPT,
        # "block_and_more" (512 + 64 + 24) shares its first BLOCK with "one_block" (512 + 128 + 60),
        # "copy" (about 300) is a copy task
        P = {"two_blocks": toks[:1100], "one_block": toks[:700], "block_and_more": toks[:600], "short": toks[:300],
             "copy": e.tokenize("Copy this file verbatim.\n\n" + _CODE[:800] + "\n\nCopy:\n\n" + _CODE[:150])}
        assert len(P["copy"]) >= MIN_PROMPT
        yield e, P


@pytest.fixture(scope="module")
def refs(engine):
    """refs(name) -> (tokens, log-probabilities) of 24 greedy tokens after that prompt, fresh,
    through the worker (a result is a function of the tokens: one computation serves every test)."""
    e, P = engine
    done: dict[str, tuple] = {}

    def get(name: str) -> tuple:
        if name not in done:
            e.reset()
            done[name] = _run(e, P[name])[:2]
        return done[name]

    return get


def test_the_file_decides(gemma, smollm_path):
    assert gemma.tensor_types.get("Q6_K", 0) > 0 and uses_worker(gemma)
    with Model(str(smollm_path)) as smol:            # Q4_1 / Q8_0: nothing the tiled kernel takes
        assert not uses_worker(smol)
        with Engine(smol.path, PARAMS, model=smol) as e:
            assert type(e.fast) is FastPrefill
    with Engine(gemma.path, PARAMS, model=gemma) as e:
        assert type(e.fast) is PrefillWorker and e.fast.pid is None     # started at the first long prompt
    with Engine(gemma.path, EngineParams(n_ctx=2048, prefill_worker=False), model=gemma) as e:
        assert type(e.fast) is FastPrefill


@pytest.mark.full          # a dozen long prompts through the worker: `make test-full`
def test_result_depends_on_the_tokens_only(engine):
    e, P = engine
    prompt = P["two_blocks"]
    e.reset()
    ref = _run(e, prompt)
    pid = e.fast.pid
    assert pid is not None and _alive(pid)
    assert ref[2].n_prompt_fast == len(prompt) and ref[2].fast_kv_mib > 0 and ref[2].fast_weights_mib > 0
    # its private memory holds at least its repacked weights and KV cache, and the stats line says it
    assert ref[2].fast_process_mib > ref[2].fast_kv_mib + ref[2].fast_weights_mib
    assert "a child process of" in ref[2].lines()[0]
    again = _run(e, prompt)
    assert again[:2] == ref[:2] and again[2].n_prompt == 0            # the same prompt again: all reused
    for other in (P["one_block"], P["short"]):                         # after another prompt
        e.reset()
        _run(e, other, 4)
        got = _run(e, prompt)
        assert got[:2] == ref[:2], len(other)
    # after a longer prompt with the same first blocks: only the blocks past them and the tail
    e.reset()
    _run(e, P["two_blocks"][:1100], 4)
    other_tail = np.concatenate([prompt[:-1], prompt[-2:-1]])
    got = _run(e, other_tail)
    assert got[2].n_prompt == e.fast.n_evaluated == len(prompt) - fast_len(len(prompt))
    e.reset()                                                          # forgets the worker's blocks too
    assert _run(e, prompt)[:2] == ref[:2] and e.fast.n_evaluated == len(prompt)
    assert e.fast.pid == pid                                           # one worker for the engine's life


@pytest.mark.full     # make test: the same hand-over in-process (test_prefill.py)
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_spec_equals_none_through_the_worker(engine, sampling):
    """Both branches: the target as its own draft (always right at temp 0 on this prompt, whose
    top tokens the worker's tiled kernels do not change) and n-grams from the prompt's text."""
    e, P = engine
    prompt = P["short"]
    e.reset()
    plain = _run(e, prompt, 40, sampling, spec=SpecParams(verify="match"))[0]
    ngram = _run(e, prompt, 40, sampling, spec=SpecParams(types=("ngram-simple",), ngram_size_n=3,
                                                          ngram_size_m=16, verify="match"))
    assert ngram[0] == plain
    selfdraft = DraftModel(e.target, e.model.path)
    try:
        e.reset()
        out, _, st = _run(e, prompt, 40, sampling, spec=SpecParams(types=("draft-simple",), n_max=8, verify="match"),
                          drafters=[selfdraft])
    finally:
        selfdraft.close()
    assert out == plain
    if sampling.greedy:
        assert st.drafters[0].n_acc_tokens == st.drafters[0].n_gen_tokens > 0


@pytest.mark.full
def test_cancel_then_retry(engine, refs):
    """The parent asks cancel() every POLL_S while the worker evaluates: the first ask comes long
    before a 256-token block is done."""
    e, P = engine
    prompt = P["short"]
    ref = refs("short")
    e.reset()
    gen = e.generate(prompt, 8, GREEDY, cancel=lambda: True)
    assert [t for c in gen for t in c] == [] and gen.stats.stop == "interrupted"
    assert e.kv_tokens == []                                           # nothing handed over
    assert _run(e, prompt)[:2] == ref


@pytest.mark.full          # three prompts and a second load of the weights here: `make test-full`
def test_a_worker_that_dies_leaves_the_work_here(gemma, engine, caplog):
    """Killed by a signal: one warning, the prompt in flight evaluated in this process, whose
    results are then those of an engine that never had a worker."""
    _, P = engine
    prompt = P["copy"]                   # another prompt than the one before the kill (not reused)
    with Engine(gemma.path, EngineParams(n_ctx=2048, prefill_worker=False), model=gemma) as local:
        want = _run(local, prompt)[:2]
    with Engine(gemma.path, PARAMS, model=gemma) as e:
        _run(e, P["short"], 2)
        pid = e.fast.pid
        os.kill(pid, 9)
        with caplog.at_level(logging.WARNING, logger="specrun.kernels.prefill_worker"):
            got = _run(e, prompt)
            e.reset()
            again = _run(e, prompt)
        assert got[:2] == want == again[:2] and got[2].n_prompt_fast == len(prompt)
        assert got[2].fast_process_mib == 0 and "child process" not in got[2].lines()[0]
        assert e.fast.local is not None and e.fast.pid is None and not _alive(pid)
        msgs = [r.message for r in caplog.records if "worker stopped" in r.message]
        assert len(msgs) == 1 and "fast prompts go on in this process" in msgs[0]


def test_a_worker_that_cannot_start_leaves_the_work_here(gemma, engine, monkeypatch, caplog):
    _, P = engine
    monkeypatch.setattr(prefill_worker.sys, "executable", "/bin/false")
    with Engine(gemma.path, PARAMS, model=gemma) as e:
        with caplog.at_level(logging.WARNING, logger="specrun.kernels.prefill_worker"):
            toks, _, st = _run(e, P["short"], 4)
        assert len(toks) == 4 and st.n_prompt_fast == len(P["short"]) and e.fast.local is not None
        assert sum("worker stopped" in r.message for r in caplog.records) == 1


def test_close_ends_the_worker(gemma, engine):
    _, P = engine
    e = Engine(gemma.path, PARAMS, model=gemma)
    _run(e, P["short"], 2)
    proc = e.fast.proc
    assert proc is not None and proc.poll() is None
    e.close()
    assert proc.poll() is not None
    assert e.fast is None or e.fast.proc is None


@pytest.mark.full
def test_an_interrupt_mid_prompt_starts_another_worker(gemma, engine, refs):
    """Ctrl-C while the worker evaluates (here raised from cancel(), which the parent polls): its
    answer may still come, so that worker is ended and the next prompt starts another, whose
    result is the same."""
    _, P = engine
    prompt = P["short"]
    ref = refs("short")
    with Engine(gemma.path, PARAMS, model=gemma) as e:
        e.start_prefill()
        pid = e.fast.pid
        assert pid is not None

        def interrupt() -> bool:
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            list(e.generate(prompt, 4, GREEDY, cancel=interrupt))
        assert e.fast.pid is None and not _alive(pid) and e.fast.local is None
        assert _run(e, prompt)[:2] == ref and e.fast.pid not in (None, pid)


@pytest.mark.full
def test_server_slots_share_one_worker_started_at_load(gemma_path, engine, refs):
    """-np 2: the slots share one worker (one repacked copy of the weights), which a server starts
    with the model; each slot's results are those of an engine of its own, also when both slots
    evaluate prompts at once; closing one slot leaves it to the other, closing both ends it."""
    import threading

    from specrun.cli.runtime.loading import open_engines
    _, P = engine
    want = {k: refs(k) for k in ("short", "copy")}
    engines = open_engines(str(gemma_path), PARAMS, 2, start_prefill=True)
    try:
        a, b = engines
        assert type(a.fast) is type(b.fast) is prefill_worker.PrefillHandle and a.fast.shared is b.fast.shared
        pid = a.fast.pid
        assert pid is not None and _alive(pid)                        # started at load
        assert _run(b, P["short"])[:2] == want["short"]
        got: dict[str, tuple] = {}

        def work(e: Engine, k: str) -> None:
            e.reset()
            got[k] = _run(e, P[k])

        threads = [threading.Thread(target=work, args=(a, "copy")),
                   threading.Thread(target=work, args=(b, "short"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert {k: v[:2] for k, v in got.items()} == want
        # the blocks one slot evaluated serve the other (a first BLOCK in common)
        a.reset()
        b.reset()
        assert _run(a, P["block_and_more"])[2].n_prompt_fast == len(P["block_and_more"])
        st = _run(b, P["one_block"])[2]
        assert 0 < st.n_prompt_fast < len(P["one_block"]) - 256
        # a slot waiting for the worker still stops when asked
        b.reset()
        with a.fast.shared.lock:
            gen = b.generate(P["one_block"], 4, GREEDY, cancel=lambda: True)
            assert [t for c in gen for t in c] == [] and gen.stats.stop == "interrupted"
        b.close()                                                      # (a owns the model: closed last)
        a.reset()
        assert _alive(pid) and _run(a, P["copy"])[:2] == want["copy"] and a.fast.pid == pid
    finally:
        for e in reversed(engines):
            e.close()
    assert not _alive(pid)


def test_one_shot_engines_start_the_worker_at_the_first_long_prompt(gemma_path):
    """Without start_prefill (run, chat): a short prompt never pays the worker's start."""
    from specrun.cli.runtime.loading import open_engines
    (e,) = open_engines(str(gemma_path), PARAMS, 1)
    try:
        assert type(e.fast) is PrefillWorker and e.fast.pid is None
        _run(e, e.tokenize("Hello there"), 2)
        assert e.fast.pid is None
    finally:
        e.close()


def test_batched_slots_run_on_the_batch_threads(gemma_path, monkeypatch):
    """serve -np 2 without -t divides the default threads between the slots' engines (-nocb).
    Batched, one context steps every slot and a long prompt holds them all: the model's owner
    and its prompt worker get the batch's threads, not one slot's share."""
    from serving import serve_options

    from specrun.cli.server.lifecycle import load_engines

    def child_threads(w: PrefillWorker) -> int:
        argv = open(f"/proc/{w.pid}/cmdline", "rb").read().split(b"\0")
        return int(argv[argv.index(b"specrun.kernels.prefill_worker") + 3])

    monkeypatch.setenv("LLAMA_ARG_THREADS", "2")
    opt = serve_options(("-m", str(gemma_path), "-c", "512", "-np", "2"))
    assert opt.params.n_threads == 1 and opt.batch_threads == 2          # -nocb's share, the batch's
    slots = load_engines(opt)
    try:
        owner = slots[0].owner
        w = owner.fast.worker
        assert owner.params.n_threads == 2 and w.pid is not None and child_threads(w) == 2
        assert slots[0].runner.engine.params.n_threads == 2
    finally:
        for s in reversed(slots):
            s.close()
