"""The engine's contracts, seen from outside: the drafter lifecycle it drives (begin, then every
target pass through accept() with what the target kept), cancellation between prompt chunks,
the draft-length cap, and llama.cpp's log under -v."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams, NgramMapParams, NgramModParams, SpecParams, SuffixParams
from specrun.kernels.prefill import BLOCK
from specrun.kernels.types import Draft, DraftOptions, SamplingParams, Stops, TargetPass, draft_end

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temp=0.0)


class Recorder:
    """Proposes the target's own greedy continuation from a reference (right for `n_right`
    tokens, then wrong), and records every call the engine makes."""

    spec_type = "recorder"
    needs_hidden = False

    def __init__(self, reference: list[int], n_prompt: int, n_right: int) -> None:
        self.reference, self.n_prompt, self.n_right = reference, n_prompt, n_right
        self.calls: list[tuple] = []

    def begin(self, prompt: np.ndarray, n_keep: int, opts: DraftOptions) -> int:
        self.calls.append(("begin", len(prompt), n_keep))
        return n_keep

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        i = len(ctx) - self.n_prompt
        toks = list(self.reference[i:i + n_max])
        for j in range(self.n_right, len(toks)):
            toks[j] = (toks[j] + 1) % 1000
        self.calls.append(("propose", len(ctx), n_max, len(toks)))
        return Draft(np.asarray(toks, dtype=np.int32), None)

    def accept(self, tp: TargetPass) -> None:
        self.calls.append(("accept", tp.pos0, len(tp.tokens), tp.n_keep))

    def close(self) -> None:
        self.calls.append(("close",))


@pytest.fixture(scope="module")
def engine(smollm_path):
    with Engine(str(smollm_path), EngineParams(n_ctx=2048, n_batch=2048)) as e:
        yield e


def test_lifecycle_begin_then_every_pass_through_accept(engine):
    prompt = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    engine.reset()
    plain = [t for ch in engine.generate(prompt, 12, GREEDY, spec=SpecParams()) for t in ch]
    engine.reset()
    rec = Recorder(plain, len(prompt), n_right=2)
    gen = engine.generate(prompt, 12, GREEDY, spec=SpecParams(n_max=3), drafters=[rec])
    out = [t for ch in gen for t in ch]
    assert out == plain
    n = len(prompt)
    assert rec.calls[0] == ("begin", n, 0)                 # an empty cache: nothing to keep
    assert rec.calls[1] == ("accept", 0, n, n)             # the prompt, one chunk, all kept
    # then: propose 3 (2 right, 1 wrong) -> a 4-row pass that keeps id_last + 2 accepted + nothing more
    assert rec.calls[2] == ("propose", n + 1, 3, 3)
    assert rec.calls[3] == ("accept", n, 4, 3)
    passes = [c for c in rec.calls if c[0] == "accept"][1:]
    assert len(passes) == gen.stats.n_target_passes
    assert all(keep == 3 for _, _, rows, keep in passes if rows == 4)   # 2 accepted + the recovered token
    pos = [p for _, p, _, _ in passes]
    proposed = [k for c in rec.calls if c[0] == "propose" for k in c[3:]]
    assert pos == sorted(pos) and gen.stats.n_accepted == sum(min(2, k) for k in proposed)


def test_second_generation_reuses_the_cache_and_says_so_to_begin(engine):
    prompt = engine.tokenize("One two three four five six seven eight nine ten")
    engine.reset()
    first = [t for ch in engine.generate(prompt, 4, GREEDY, spec=SpecParams()) for t in ch]
    rec = Recorder(first, len(prompt), n_right=0)
    longer = np.concatenate([prompt, np.asarray(first[:3], dtype=np.int32)])
    gen = engine.generate(longer, 2, GREEDY, spec=SpecParams(n_max=1), drafters=[rec])
    list(gen)
    assert rec.calls[0] == ("begin", len(longer), len(prompt) + 2)   # the KV held prompt + 3 emitted - 1 decoded
    assert gen.stats.n_prompt == 1


def test_cancel_stops_a_long_prompt_between_chunks(engine):
    """The exact path (--no-fast-prefill) polls after every chunk of n_ubatch tokens (512, or -b
    when smaller: 128 here, so that a short prompt has three chunks); the fast prompt path between
    its blocks and then after each chunk of the rest (tests/test_prefill.py)."""
    prompt = engine.tokenize("alpha beta gamma delta " * 400)[:600]
    assert len(prompt) > BLOCK
    with Engine(engine.model.path, EngineParams(n_ctx=2048, n_batch=128, fast_prefill=False),
                model=engine.model) as exact:
        assert exact.ctx.n_ubatch == 128
        polls = []

        def cancel() -> bool:
            polls.append(len(exact.kv_tokens))
            return len(polls) >= 2

        gen = exact.generate(prompt[:300], 8, GREEDY, cancel=cancel)
        assert list(gen) == []
        assert gen.stats.stop == "interrupted" and gen.stats.n_gen == 0
        assert polls == [128, 256] and len(exact.kv_tokens) == 256       # stopped after the 2nd of 3 chunks
        # the chunks evaluated stay in the cache: the retry evaluates only the rest
        gen = exact.generate(prompt[:300], 2, GREEDY)
        list(gen)
        assert gen.stats.n_prompt == 300 - 256
    # the fast path: the first poll is between its two blocks (512 and 64; nothing in the exact context yet)
    engine.reset()
    engine.fast.close()
    polls = []
    gen = engine.generate(prompt, 8, GREEDY, cancel=lambda: polls.append(len(engine.kv_tokens)) or True)
    assert list(gen) == [] and gen.stats.stop == "interrupted"
    assert polls == [0] and engine.fast.tokens == prompt[:BLOCK].tolist()  # its first block


def test_draft_length_above_the_cap_is_refused_with_the_cap(engine):
    assert engine.n_max_cap == 62            # --spec-ngram-mod-n-max 64, within exact mode's 63 verify rows
    rec = Recorder([], 0, 0)
    with pytest.raises(SpecrunError, match=r"draft n-max 63 is above this engine's cap of 62 \(exact mode verifies at most 63 rows\); "
                       r"ask for at most 62, or --no-exact, whose verify passes have no such bound$"):
        engine.generate(engine.tokenize("hi"), 4, GREEDY, spec=SpecParams(n_max=63), drafters=[rec])


@pytest.mark.parametrize("spec, exact, cap", [
    (SpecParams(ngram_size_m=8, ngram_mod=NgramModParams(n_max=20)), False, 48),         # map-k / k4v size-m 48
    (SpecParams(ngram_size_m=8, ngram_mod=NgramModParams(n_max=100)), False, 100),
    (SpecParams(ngram_size_m=8, ngram_map_k4v=NgramMapParams(size_m=80), ngram_mod=NgramModParams(n_max=20)), False, 80),
    (SpecParams(n_max=5, ngram_size_m=8, ngram_map_k=NgramMapParams(size_m=4), ngram_map_k4v=NgramMapParams(size_m=4),
                ngram_mod=NgramModParams(n_max=4), suffix=SuffixParams(max_depth=4)), False, 16),
    (SpecParams(n_max=5, ngram_size_m=8, ngram_map_k=NgramMapParams(size_m=4), ngram_map_k4v=NgramMapParams(size_m=4),
                ngram_mod=NgramModParams(n_max=4)), False, 23),                       # suffix: max-depth 24 - 1
    (SpecParams(ngram_mod=NgramModParams(n_max=100)), True, 62),
])
def test_the_cap_is_the_longest_bound_of_any_drafter(engine, spec, exact, cap):
    """Each n-gram type's own flag (and suffix's max-depth) bounds its drafts (a request may switch to any type), so the
    engine's cap is the largest of them and --spec-draft-n-max (at least 16), within exact mode's 62."""
    with Engine(engine.model.path, EngineParams(n_ctx=256, exact=exact, spec=spec), model=engine.model) as e:
        assert e.n_max_cap == cap


def test_ngram_mod_drafts_reach_its_n_max_within_the_exact_cap(engine):
    """llama.cpp's ngram-mod chains up to --spec-ngram-mod-n-max (64) tokens: exact mode cuts that at
    62, nothing shorter (ngram-simple's size-m 48 once bounded every n-gram type). Its pool outlives
    a generation, so the second one drafts the first one's text."""
    prompt = engine.tokenize("The history of the lighthouse at the edge of the old harbour town began")
    spec = SpecParams(types=("ngram-mod",))
    engine.reset()
    first = engine.generate(prompt, 140, GREEDY, spec=spec)
    text = [t for step in first for t in step]
    engine.reset()
    again = engine.generate(prompt, 100, GREEDY, spec=spec)
    assert [t for step in again for t in step] == text[:100]
    d = again.stats.drafters[0]
    # a 62-token draft, accepted past the 48 that once bounded it (to its end where the text does not
    # loop: on an AMD EPYC; on an Intel Xeon, whose kernels write another text, to its 60th token)
    assert len(d.acc_per_pos) == 62 and d.acc_per_pos[48] > 0


def test_ngram_drafts_are_bounded_by_size_m_not_n_max(engine):
    """llama.cpp's semantics: --spec-draft-n-max bounds model drafters; an n-gram draft is a copy of
    up to --spec-ngram-simple-size-m tokens. Here a copy drafts (and is accepted) past n-max 3."""
    code = (Path(__file__).parent / "data" / "copy_source.txt").read_text()[:700]
    prompt = engine.tokenize("Copy this text exactly.\n\n" + code + "\n\nCopy:\n\n" + code[:120])
    engine.reset()
    gen = engine.generate(prompt, 40, GREEDY, spec=SpecParams(types=("ngram-simple",), n_max=3,
                                                              ngram_size_n=3, ngram_size_m=10))
    list(gen)
    d = gen.stats.drafters[0]
    assert d.n_gen_drafts > 0 and len(d.acc_per_pos) == 10 and d.acc_per_pos[3] > 0   # accepted past n-max
    assert gen.stats.n_target_passes < gen.stats.n_gen - 1


def test_verbose_shows_llama_cpp_log(smollm_path):
    base = [sys.executable, "-m", "specrun.cli.main", "-m", str(smollm_path), "-p", "Hi", "-n", "2", "--temp", "0", "-no-cnv"]
    quiet = subprocess.run(base, capture_output=True, text=True, timeout=120)
    loud = subprocess.run([*base, "-v"], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == loud.returncode == 0
    assert "llama.cpp:" not in quiet.stderr
    assert "INFO llama.cpp: llama_model_loader" in loud.stderr or "INFO llama.cpp: llama_context" in loud.stderr
    assert quiet.stdout == loud.stdout


PIECES = {1: b"Hello", 2: b",", 3: b" wor", 4: b"ld", 5: b"\n", 6: b"Us", 7: b"er:", 8: b" hi", 9: b""}


@pytest.mark.parametrize(("text", "draft", "stops", "want"), [
    ([1, 2], [3, 4, 5, 6], Stops(), 4),                          # nothing ends it
    ([1, 2], [3, 9, 4], Stops(), 2),                             # an end-of-generation token: kept, then cut
    ([1, 2], [3, 4, 8], Stops(tokens=frozenset({4})), 2),        # a stop token
    ([1, 2], [3, 4, 5, 6, 7, 8], Stops((b"\nUser:",)), 5),       # "\nUser:" completes with "er:"
    ([1, 5, 6], [7, 8, 3], Stops((b"\nUser:",)), 1),             # ... across the text's tail
    ([5, 6, 7], [8, 3], Stops((b"\nUser:",)), 2),                # one already in the text does not count
    ([1], [2, 3], Stops((b"or", b",")), 1),                      # the first of several
    ([], [3, 4], Stops((b"rld",)), 2),
    ([1], [], Stops((b"x",)), 0),
])
def test_draft_end_cuts_after_the_token_where_the_text_ends(text, draft, stops, want):
    got = draft_end(np.asarray(draft, dtype=np.int32), np.asarray(text, dtype=np.int32), stops,
                    PIECES.__getitem__, lambda t: t == 9)
    assert got == want


def test_no_draft_token_past_a_stop_is_verified(engine):
    """With stops, a draft that runs past where the text ends is cut there; the output is the same."""
    prompt = engine.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    engine.reset()
    plain = [t for ch in engine.generate(prompt, 12, GREEDY, spec=SpecParams()) for t in ch]
    stop = engine.model.detokenize(plain[4:6])
    seen = []
    for stops in (Stops(), Stops.of([stop])):
        rec = Recorder(plain, len(prompt), n_right=12)
        gen = engine.generate(prompt, 12, GREEDY, spec=SpecParams(n_max=8), drafters=[rec], stops=stops)
        assert [t for ch in gen for t in ch] == plain
        seen.append([c[2] for c in rec.calls if c[0] == "accept"][1:])   # each pass's rows: id_last + draft
    assert seen[0][0] == 9                  # id_last (plain[0]) + plain[1..8]
    assert seen[1][0] == 6                  # id_last + plain[1..5]: plain[5] completes the stop
