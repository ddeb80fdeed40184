"""The batched engine (kernels/batch.py): each request's text equals the same request decoded alone
by the Engine with --spec-type none, whatever else shares its decodes: requests of different
lengths and spec types joining and leaving at different steps, cancellation, a prompt prefix
copied from another sequence. And the fact underneath: a sequence's logits rows are bit-identical
beside other sequences' rows when each sequence has its own KV stream."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from drafters import FirstRightDraft, FixedCost, OracleDraft, ShiftedDraft

from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.batch import BatchEngine, BatchParams, Request, draft_budget
from specrun.kernels.engine import Engine
from specrun.kernels.llama import Context, ContextParams, Model
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.prefill import MIN_PROMPT
from specrun.kernels.types import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temp=0.0)
SEEDED = SamplingParams(temp=0.9, top_k=40, seed=1234)
MATCH = SpecParams(types=(), verify="match")
TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
         "def fib(n):\n    return",
         "Once upon a time, in a land far away, there lived a",
         ", ".join(map(str, range(1, 41))) + ",",   # 64+ tokens: a prompt chunk decoded on its own
         "Hello"]
N_PREDICT = [16, 10, 12, 16, 8]
N_LONG = 24        # tokens after which Gemma's fast and exact prompt paths differ on one long prompt


class Refs:
    """Plain decoding of each prompt, alone (Engine, spec none, no fast prompt path), cached."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.engine = Engine(model.path, EngineParams(n_ctx=512, fast_prefill=False, spec=SpecParams(types=())),
                             model=model)
        self._done: dict[tuple, list[int]] = {}

    def __call__(self, prompt, n: int, sampling: SamplingParams) -> list[int]:
        key = (tuple(int(t) for t in prompt), n, sampling)
        if key not in self._done:
            self.engine.reset()
            self._done[key] = [t for chunk in self.engine.generate(prompt, n, sampling) for t in chunk]
        return self._done[key]


@pytest.fixture(scope="module")
def smol(smollm_path):
    with Model(smollm_path) as m:
        refs = Refs(m)
        yield m, refs
        refs.engine.close()


def _requests(model: Model, refs: Refs, sampling: SamplingParams, kinds: list[str]) -> list[Request]:
    """One request per kind: 'none', 'ngram-simple', 'right' (always accepted), 'wrong' (never)."""
    out = []
    for i, kind in enumerate(kinds):
        prompt = model.tokenize(TEXTS[i % len(TEXTS)])
        n = N_PREDICT[i % len(N_PREDICT)]
        spec = replace(MATCH, types=("ngram-simple",) if kind == "ngram-simple" else ())
        drafters = None
        if kind in ("right", "wrong"):
            oracle = OracleDraft(refs(prompt, n, sampling), len(prompt))
            drafters = [oracle if kind == "right" else ShiftedDraft(oracle, model.n_vocab)]
            spec = replace(spec, n_max=4)
        out.append(Request(prompt, n, sampling, spec, drafters))
    return out


def _staggered(b: BatchEngine, reqs: list[Request], joins: list[int]):
    """Submit request i at step joins[i]; step until all are done. Returns the handles."""
    hs: list = [None] * len(reqs)
    step = 0
    while any(h is None or not h.done for h in hs):
        for i, at in enumerate(joins):
            if at == step:
                hs[i] = b.submit(reqs[i])
        b.step()
        step += 1
        assert step < 500
    return hs


def _check(hs, reqs, refs, kinds) -> None:
    for h, r, kind in zip(hs, reqs, kinds, strict=True):
        assert h.tokens == refs(r.prompt, r.n_predict, r.sampling), (kind, h.stats)
        st = h.stats
        if kind == "right":     # the always-right drafter had drafts accepted, the wrong one none
            assert st.n_accepted > 0 and st.n_drafted > 0
        if kind == "wrong":
            assert st.n_accepted == 0 and st.n_drafted > 0


@pytest.mark.parametrize("sampling", [GREEDY, pytest.param(SEEDED, marks=pytest.mark.full)], ids=["greedy", "seeded"])
def test_mixed_requests_each_equal_alone(smol, sampling):
    """Four requests of different lengths and spec types in three sequences: the fourth joins when
    the first to finish leaves; each text is the request's alone, with spec none."""
    model, refs = smol
    kinds = ["none", "right", "ngram-simple", "wrong"]
    reqs = _requests(model, refs, sampling, kinds)
    with BatchEngine(model.path, BatchParams(n_seq=3, n_ctx_seq=256), model=model) as b:
        hs = _staggered(b, reqs, [0, 0, 2, 3])
        assert max(h.seq for h in hs) <= 2
    _check(hs, reqs, refs, kinds)


def test_copy_drafters_the_best_one_drafts_in_a_batch(smol):
    """Two requests, each with three copy drafters (always wrong, right at the first token only,
    always right; in two orders), beside a plain one: every copy drafter is asked, the one whose
    cut pays most drafts, and each text equals the request alone."""
    model, refs = smol
    reqs, trios = [], []
    for i, order in ((0, "wrong first"), (2, "right first")):
        prompt, n = model.tokenize(TEXTS[i]), 32
        ref = refs(prompt, n, GREEDY)
        wrong = ShiftedDraft(OracleDraft(ref, len(prompt), spec_type="ngram-simple"), model.n_vocab)
        first = FirstRightDraft(OracleDraft(ref, len(prompt), spec_type="ngram-map-k"), model.n_vocab)
        right = OracleDraft(ref, len(prompt), spec_type="suffix")
        ds = [wrong, first, right] if order == "wrong first" else [right, wrong, first]
        trios.append([ds.index(d) for d in (wrong, first, right)])
        reqs.append(Request(prompt, n, GREEDY, replace(MATCH, n_max=8), ds))
    reqs.append(Request(model.tokenize(TEXTS[1]), 16, GREEDY, MATCH))
    with BatchEngine(model.path, BatchParams(n_seq=3, n_ctx_seq=256), model=model) as b:
        b.pass_cost, b.probed = FixedCost(), True    # the choice, not this machine's timings
        hs = b.run(reqs)
    for h, r in zip(hs, reqs, strict=True):
        assert h.tokens == refs(r.prompt, r.n_predict, GREEDY)
    for h, at in zip(hs[:2], trios, strict=True):
        w, f, r = (h.stats.drafters[i] for i in at)
        assert w.n_acc_tokens == 0 and w.n_gen_drafts <= 2, h.stats
        assert f.n_gen_drafts <= 2, h.stats
        assert r.n_acc_tokens > 16, h.stats


@pytest.mark.full
def test_draft_model_request_beside_plain_ones(smol, smollm_path):
    """draft-simple with -md (the target's own file: a draft that is always right at temperature 0)
    beside a plain and an n-gram request."""
    model, refs = smol
    reqs = _requests(model, refs, GREEDY, ["none", "none", "ngram-simple"])
    reqs[1] = replace(reqs[1], spec=replace(MATCH, types=("draft-simple",), n_max=3))
    with BatchEngine(model.path, BatchParams(n_seq=3, n_ctx_seq=256, draft_model=str(smollm_path)),
                     model=model) as b:
        hs = _staggered(b, reqs, [1, 0, 0])
    _check(hs, reqs, refs, ["none", "model", "ngram-simple"])
    assert hs[1].stats.n_accepted > 0


def test_cancel_ends_one_request_and_frees_its_sequence(smol):
    """A request cancelled mid-way comes back done ("interrupted") with what it had; a queued request
    takes its sequence; the others' texts are unchanged."""
    model, refs = smol
    reqs = _requests(model, refs, GREEDY, ["none", "ngram-simple", "none"])
    with BatchEngine(model.path, BatchParams(n_seq=2, n_ctx_seq=256), model=model) as b:
        h0, h1, h2 = (b.submit(r) for r in reqs)
        for _ in range(4):
            b.step()
        assert h2.seq == -1 and not h0.done
        n0 = len(h0.tokens)
        h0.cancel()
        done = b.step()
        assert (h0, []) in done and h0.done and h0.stats.stop == "interrupted"
        assert h2.seq == h0.seq
        while not (h1.done and h2.done):
            b.step()
    assert h0.tokens == refs(reqs[0].prompt, reqs[0].n_predict, GREEDY)[:n0]
    _check([h1, h2], reqs[1:], refs, ["ngram-simple", "none"])


def test_cancel_flag_of_the_request(smol):
    model, _ = smol
    flag = []
    req = Request(model.tokenize(TEXTS[0]), 50, GREEDY, cancel=lambda: bool(flag))
    with BatchEngine(model.path, BatchParams(n_seq=1, n_ctx_seq=256), model=model) as b:
        h = b.submit(req)
        b.step()
        b.step()
        flag.append(1)
        b.step()
    assert h.done and h.stats.stop == "interrupted" and 1 <= len(h.tokens) < 50


def _two_prompts(model: Model) -> list[np.ndarray]:
    """Two prompts with a common head of 16+ tokens (a system prompt)."""
    system = "Here is a short story about a cat and a dog who lived in a small house by the river. "
    return [model.tokenize(system + q) for q in ("The cat", "One morning, the dog")]


def test_shared_prefix_is_copied_and_gives_the_same_text(smol):
    """Two requests with a common system prompt submitted together: the second waits for the first
    to evaluate the prefix, copies it (seq_cp) and evaluates only its own tail; both texts equal the
    requests alone. A third, later, reuses its own sequence's KV."""
    model, refs = smol
    prompts = _two_prompts(model)
    common = int(np.flatnonzero(prompts[0][:len(prompts[1])] != prompts[1][:len(prompts[0])])[0])
    assert common >= 16
    reqs = [Request(p, 12, GREEDY, MATCH) for p in prompts]
    with BatchEngine(model.path, BatchParams(n_seq=2, n_ctx_seq=256), model=model) as b:
        hs = b.run(reqs)
        assert hs[0].stats.n_prompt == len(prompts[0])
        assert hs[1].stats.n_prompt == len(prompts[1]) - common     # the prefix came from the other sequence
        again = Request(np.concatenate([prompts[1], hs[1].tokens, model.tokenize(" Then", add_special=False)]),
                        10, GREEDY, MATCH)
        h3 = b.run([again])[0]
        held = len(prompts[1]) + len(hs[1].tokens) - 1      # its sequence's KV: all but the last token emitted
        assert h3.seq == hs[1].seq and h3.stats.n_prompt == len(again.prompt) - held
    for h, r in zip([*hs, h3], [*reqs, again], strict=True):
        assert h.tokens == refs(r.prompt, r.n_predict, GREEDY)


def test_shared_prefix_equals_evaluating_it_per_sequence(smol):
    """The same two requests with copying off (share_min above any prompt): the same texts."""
    model, _ = smol
    prompts = _two_prompts(model)
    texts = []
    for share_min in (8, 10_000):
        with BatchEngine(model.path, BatchParams(n_seq=2, n_ctx_seq=256, share_min=share_min), model=model) as b:
            hs = b.run([Request(p, 12, SEEDED, MATCH) for p in prompts])
        texts.append([h.tokens for h in hs])
        assert (hs[1].stats.n_prompt < len(prompts[1])) == (share_min == 8)
    assert texts[0] == texts[1]


def _gap_closed(model: Model, refs: Refs) -> None:
    """Three sequences, the middle one's request ends first: the last sequence moves, mid-generation
    and with drafts in flight, to the stream next to the first (llama.cpp's ubatches take
    consecutive ids only), trading streams with the idle one, KV and all. Every text equals its
    request alone, and the idle sequence then reuses its own KV from the stream it moved to."""
    prompts = [model.tokenize(t) for t in TEXTS[:3]]
    n = [20, 3, 20]
    oracle = OracleDraft(refs(prompts[2], n[2], GREEDY), len(prompts[2]))
    reqs = [Request(prompts[0], n[0], GREEDY, MATCH, seq=0), Request(prompts[1], n[1], GREEDY, MATCH, seq=1),
            Request(prompts[2], n[2], GREEDY, replace(MATCH, n_max=4), [oracle], seq=2)]
    with BatchEngine(model.path, BatchParams(n_seq=3, n_ctx_seq=256), model=model) as b:
        hs = b.run(reqs)
        assert b.n_moves == 1 and [s.stream for s in b.seqs] == [0, 2, 1]
        assert hs[2].stats.n_accepted > 0
        again = b.run([Request(prompts[1], 6, GREEDY, MATCH, seq=1)])[0]
        assert again.stats.n_prompt == 1                  # its KV came back with it
    for h, r in zip([*hs, again], [*reqs, Request(prompts[1], 6)], strict=True):
        assert h.tokens == refs(r.prompt, r.n_predict, GREEDY)


def test_a_gap_between_active_sequences_is_closed_and_each_text_equals_alone(smol):
    _gap_closed(*smol)


@pytest.mark.full
def test_a_gap_is_closed_on_a_sliding_window_model(gemma_path):
    """Gemma 3 keeps a sliding-window cache beside the full one: both move."""
    with Model(gemma_path) as model:
        refs = Refs(model)
        try:
            _gap_closed(model, refs)
        finally:
            refs.engine.close()


def test_bad_requests_are_refused_before_any_work(smol):
    model, _ = smol
    with BatchEngine(model.path, BatchParams(n_seq=1, n_ctx_seq=256), model=model) as b:
        with pytest.raises(SpecrunError, match="empty"):
            b.submit(Request([], 4))
        with pytest.raises(SpecrunError, match=r"\(300 tokens, ctx 256\)"):
            b.submit(Request([1] * 300, 4))
        with pytest.raises(SpecrunError, match="vocabulary"):
            b.submit(Request([1, 2], 4, replace(GREEDY, logit_bias=((model.n_vocab, 1.0),))))
        with pytest.raises(SpecrunError, match="hidden rows"):
            b.submit(Request([1, 2], 4, GREEDY, SpecParams(types=("draft-mtp",))))
        with pytest.raises(SpecrunError, match=r"sequence 1 does not exist \(0..0\)"):
            b.submit(Request([1, 2], 4, seq=1))
        assert not b.busy()
        h = b.run([Request([1, 2, 3], 0, GREEDY)])[0]
        assert h.done and h.tokens == [] and h.stats.stop == "n_predict"


def test_logit_controls_and_logprobs_each_equal_alone(smol):
    """Penalties, a logit bias, --ignore-eos and a grammar transform each sequence's rows with its
    own state, and logprobs come from its raw rows: beside other requests (n-gram drafts among
    them) each request's tokens and logprobs equal the Engine's alone, with spec none."""
    model, refs = smol
    eos_free = replace(GREEDY, ignore_eos=True)
    controls = [replace(GREEDY, repeat_penalty=1.3, repeat_last_n=16, logit_bias=((int(model.tokenize(" dog",
                add_special=False)[0]), -5.0),)),
                replace(SEEDED, presence_penalty=0.5, frequency_penalty=0.3),
                replace(GREEDY, grammar='root ::= "[" [0-9]+ ("," " "? [0-9]+)* "]"'),
                eos_free]
    kinds = ["ngram-simple", "none", "none", "ngram-simple"]
    reqs = _requests(model, refs, GREEDY, kinds)
    reqs = [replace(r, sampling=c, logprobs=2) for r, c in zip(reqs, controls, strict=True)]
    with BatchEngine(model.path, BatchParams(n_seq=4, n_ctx_seq=256), model=model) as b:
        hs = _staggered(b, reqs, [0, 0, 1, 2])
    for h, r in zip(hs, reqs, strict=True):
        refs.engine.reset()
        gen = refs.engine.generate(r.prompt, r.n_predict, r.sampling, logprobs=2)
        want = [t for chunk in gen for t in chunk]
        assert h.tokens == want, (r.sampling, h.stats)
        assert h.logprobs == gen.logprobs
    text = model.detokenize(hs[2].tokens)
    assert text.startswith("[") and set(text) <= set("[]0123456789, ")


def test_runner_and_seq_engines_serve_like_engines(smol):
    """BatchRunner's loop thread and SeqEngine.generate(): a Generation per request, as the Engine's,
    from threads of their own; the loop thread ends once no request is left; closing a Generation
    early cancels its request."""
    import threading

    from specrun.kernels.batch import BatchRunner, SeqEngine

    model, refs = smol
    reqs = _requests(model, refs, GREEDY, ["none", "ngram-simple", "none"])
    b = BatchEngine(model.path, BatchParams(n_seq=3, n_ctx_seq=256), model=model)
    runner = BatchRunner(b)
    slots = [SeqEngine(runner, i, refs.engine) for i in range(3)]
    got: list = [None] * 3
    runner.pause()                           # all three join the first step

    def go(i: int) -> None:
        r = reqs[i]
        gen = slots[i].generate(r.prompt, r.n_predict, r.sampling, spec=r.spec, logprobs=1)
        got[i] = ([t for chunk in gen for t in chunk], gen.stats, gen.logprobs)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: runner.n_queued == 3)
        runner.resume()
        for t in threads:
            t.join(60)
        _wait(lambda: runner._thread is None)
        for (toks, st, lps), r in zip(got, reqs, strict=True):
            assert toks == refs(r.prompt, r.n_predict, r.sampling) and st.n_gen == len(toks) == len(lps)
            assert st.stop in ("eog", "n_predict")
        assert runner.n_seq_steps > runner.n_steps           # some steps decoded several sequences
        gen = slots[0].generate(reqs[0].prompt, 200, GREEDY)
        first = next(gen)
        gen.close()                               # a client gone: the request ends at the next step
        assert gen.stats.stop == "interrupted" and gen.stats.n_gen == len(first)
        _wait(lambda: runner._thread is None and not b.busy())
    finally:
        runner.resume()
        runner.close()


def _wait(pred, timeout: float = 60.0) -> None:
    """Poll pred() (every 10 ms) until true; fail after timeout seconds (a bound, not a timing)."""
    import time

    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "not within the bound"
        time.sleep(0.01)


def test_draft_budget_shrinks_as_the_batch_grows():
    assert [draft_budget(n, 16) for n in (1, 2, 4, 8, 16, 17, 32)] == [16, 8, 4, 2, 1, 0, 0]


def _rows_alone_and_beside(model: Model, unified: bool) -> tuple[np.ndarray, np.ndarray]:
    """Sequence 0's logits for a prompt then 6 one-token steps: alone, and in a 3-sequence context
    beside other sequences' rows (one of which leaves, its cells then taken by a new one)."""
    prompt = model.tokenize(TEXTS[0])
    steps = model.tokenize(" and then the dog woke up", add_special=False)[:6]
    with Context(model, ContextParams(n_ctx=256, n_batch=256)) as c:
        c.decode(prompt, 0, "last")
        alone = [c.logits_rows()[-1].copy()]
        for i, t in enumerate(steps):
            c.decode([t], len(prompt) + i, "last")
            alone.append(c.logits_rows()[-1].copy())
    with Context(model, ContextParams(n_ctx=3 * 256, n_batch=256, n_seq_max=3, kv_unified=unified)) as c:
        other = model.tokenize(TEXTS[2])
        c.decode_seqs(other, range(len(other)), [1] * len(other), [0] * len(other))
        n = len(prompt)
        c.decode_seqs([*prompt, *other[:5]], [*range(n), *range(5)], [0] * n + [2] * 5, [0] * (n - 1) + [1] + [0] * 5)
        beside = [c.outputs_rows()[0].copy()]
        c.decode_seqs(other[5:], range(5, len(other)), [2] * (len(other) - 5), [0] * (len(other) - 5))
        for i, t in enumerate(steps):
            if i == 2:        # sequence 1 leaves; sequence 2 takes more cells
                c.seq_rm_of(1, -1, -1)
                c.seq_rm_of(2, -1, -1)
                c.decode_seqs(other, range(len(other)), [2] * len(other), [0] * len(other))
            extra = [7, 8, 9] if i % 2 else [7]          # another sequence's verify rows, rolled back
            c.decode_seqs([t, *extra], [n + i, *range(len(other), len(other) + len(extra))],
                          [0] + [2] * len(extra), [1] * (1 + len(extra)))
            beside.append(c.outputs_rows()[0].copy())
            c.seq_rm_of(2, len(other), -1)
    return np.stack(alone), np.stack(beside)


def test_a_sequences_rows_are_bit_identical_beside_others_with_a_stream_each(smol):
    model, _ = smol
    alone, beside = _rows_alone_and_beside(model, unified=False)
    assert np.array_equal(alone, beside)


@pytest.mark.full
def test_a_unified_kv_buffer_is_not_invariant_once_cells_are_reused(smol):
    """Why the batched engine keeps a stream per sequence: with one buffer, sequence 0's later
    positions go into the cells sequence 1 left, before its earlier ones, and the attention sums
    them in another order."""
    model, _ = smol
    alone, beside = _rows_alone_and_beside(model, unified=True)
    assert np.array_equal(alone[:3], beside[:3])
    assert not np.array_equal(alone, beside)


@pytest.mark.full
@pytest.mark.parametrize("which", ["gemma", "smollm"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED, replace(SEEDED, seed=7, temp=1.2)], ids=["greedy", "s1234", "s7"])
def test_grid_each_equal_alone(request, which, sampling):
    """The larger grid: both models, more seeds, five requests through two sequences and four."""
    path = request.getfixturevalue("gemma_path" if which == "gemma" else "smollm_path")
    with Model(path) as model:
        refs = Refs(model)
        try:
            kinds = ["ngram-simple", "wrong", "none", "right", "ngram-simple"]
            reqs = _requests(model, refs, sampling, kinds)
            for n_seq, joins in ((2, [0, 0, 1, 5, 9]), (4, [0, 3, 3, 0, 6])):
                with BatchEngine(str(path), BatchParams(n_seq=n_seq, n_ctx_seq=256, draft_rows=8), model=model) as b:
                    hs = _staggered(b, reqs, joins)
                _check(hs, reqs, refs, kinds)
        finally:
            refs.engine.close()


def test_long_prompts_take_the_fast_path_as_the_engine_does(gemma_path):
    """With fast_prefill, a prompt of MIN_PROMPT+ tokens goes through the fast prompt context and its
    state into the sequence's stream: each text equals the Engine's alone with its fast prompt path,
    which differs from the exact path's on one of these prompts (so the test can tell). A fast prompt
    loaded before is reused; a short prompt after a long one is evaluated from its start; a short
    prompt is not copied from a sequence whose KV came from the fast context."""
    with Model(gemma_path) as model:
        long1 = model.tokenize(", ".join(map(str, range(1, 200))) + ",")
        long2 = model.tokenize("The history of the old city, told by its people. " * 30 + "In conclusion,")
        short = model.tokenize(TEXTS[2])
        head = long2[:120]
        assert min(len(long1), len(long2)) >= MIN_PROMPT > len(head)
        fast, exact = {}, {}
        for want, fp, names in ((fast, True, ("long1", "long2")), (exact, False, ("long2", "short", "head"))):
            with Engine(model.path, EngineParams(n_ctx=1024, fast_prefill=fp, spec=SpecParams(types=())),
                        model=model) as e:
                for name in names:
                    p = {"long1": long1, "long2": long2, "short": short, "head": head}[name]
                    e.reset()
                    want[name] = [t for c in e.generate(p, N_LONG, GREEDY) for t in c]
        assert fast["long2"] != exact["long2"]
        ng = SpecParams(types=("ngram-simple",))
        with BatchEngine(model.path, BatchParams(n_seq=3, n_ctx_seq=1024, fast_prefill=True), model=model) as b:
            hs = b.run([Request(long1, N_LONG, GREEDY, ng, seq=0), Request(long2, N_LONG, GREEDY, seq=1),
                        Request(short, N_LONG, GREEDY, ng, seq=2)])
            assert [h.tokens for h in hs] == [fast["long1"], fast["long2"], exact["short"]]   # short: one path
            assert [h.stats.n_prompt_fast for h in hs] == [len(long1), len(long2), 0]
            hs = b.run([Request(short, N_LONG, GREEDY, seq=0), Request(long2, N_LONG, GREEDY, ng, seq=1),
                        Request(head, N_LONG, GREEDY, seq=2)])
            assert [h.tokens for h in hs] == [exact["short"], fast["long2"], exact["head"]]
            # short: from its start, though BOS was held; head: all but the BOS its sequence held (copied: 1)
            assert [h.stats.n_prompt for h in hs] == [len(short), 0, len(head) - 1]
            # cache_prompt false: nothing reused, neither the sequence's KV nor the fast context's blocks
            [h] = b.run([Request(long2, N_LONG, GREEDY, seq=1, fresh=True)])
            assert h.tokens == fast["long2"] and h.stats.n_prompt == len(long2)
