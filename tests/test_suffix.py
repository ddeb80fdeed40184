"""--spec-type suffix: suffix decoding (kernels/drafters/suffix.py).

Hand-worked tables of the rule (longest match, counts, ties, the length caps, the own store before
the global one); the token store (moves, truncation, compaction, LRU eviction); the cache file
(round trip, bad files); the flags' errors; auto's cold probe; and (slow) output equal to `none` on
SmolLM2, greedy and seeded, where it drafts a lot, where every draft is wrong, and a repeated request
drafting from the global tree.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from drafters import ShiftedDraft

from specrun.cli.main import cli
from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.drafters import Suffix, draft_n_max, drafter_key, make_drafter
from specrun.kernels.drafters.suffix import GlobalStore, TokenStore, private_stores, read_cache, shared_store
from specrun.kernels.params import SpecParams, SuffixParams, parse_spec_types

A, B, C, D, E, X, Y, Z, W = range(10, 19)


def i32(tokens) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int32)


def draft(ctx, n_max=16, prompt=None, store=None, **kw) -> list[int]:
    """A fresh drafter's draft after ctx (its prompt: ctx unless given)."""
    s = Suffix(SuffixParams(**kw), store)
    s.begin(i32(ctx if prompt is None else prompt))
    return s.propose(i32(ctx), n_max).tokens.tolist()


# ---- the rule --------------------------------------------------------------------------------------

DOC = [A, B, C, D, X, A, B, C, E, Y, A, B, C]      # the class docstring's example


@pytest.mark.parametrize("ctx, kw, n_max, want", [
    (DOC, {"max_depth": 8}, 16, [E, Y, A]),                         # m = 3 wins: 1/3 + 1/3 + 1/3
    (DOC, {"max_depth": 8}, 2, [E, Y]),                             # n_max cuts it
    (DOC, {"max_depth": 8, "max_spec_factor": 0.5}, 16, [E]),      # floor(3 * 0.5) = 1 token
    (DOC, {"max_depth": 8, "min_token_prob": 0.34}, 16, []),       # 1/3 < 0.34: nothing
    (DOC, {"max_depth": 4}, 16, [E, Y]),                            # m + draft <= 4: m = 2's 2 tokens beat m = 3's 1
    # one earlier occurrence, followed by a long copy: the match of 4 drafts 4 (prob 1/2 each)
    ([X, A, B, C, D, E, Y, Z, W, A, B, C, D], {}, 16, [E, Y, Z, W]),
    # a count wins over a tie: after [A], B follows twice and C once
    ([A, B, X, A, B, Y, A, C, Z, A], {}, 1, [B]),
    # nothing repeats: no draft
    ([A, B, C, D, E], {}, 16, []),
])
def test_rule_table(ctx, kw, n_max, want):
    assert draft(ctx, n_max, **kw) == want


def test_tie_goes_to_the_latest_occurrence():
    assert draft([A, X, A, Y, A], 1) == [Y]        # X and Y once each after A: Y's A is later
    assert draft([A, Y, A, X, A], 1) == [X]


def test_longer_match_wins_a_tie_and_the_own_store_wins_over_the_global_one():
    # [B, C] and [C] both draft D with the same score (prob 1/2): the match of 2 is kept
    s = TokenStore()
    sid = s.new()
    s.extend(sid, i32([B, C, D, Y, B, C]))
    got = s.speculate(i32([Y, B, C]), 1, SuffixParams())
    assert got.tokens.tolist() == [D] and got.match == 2 and got.score == pytest.approx(0.5)
    # the global store must score higher: an equal score there (E: 1/2, with this request's own
    # output [B, C] in it too) does not replace the own draft (D: 1/2); a second E (2/3) does
    g = GlobalStore(10, 100)
    g.add(None, i32([B, C, E, E, E]))
    s = Suffix(SuffixParams(), g)
    s.begin(i32([B, C, D, D, Y]))
    assert s.propose(i32([B, C, D, D, Y, B, C]), 1).tokens.tolist() == [D] and s.last_source == "own"
    g.add(None, i32([B, C, E, E, E]))
    assert s.propose(i32([B, C, D, D, Y, B, C]), 1).tokens.tolist() == [E] and s.last_source == "global"


def test_global_store_drafts_a_repeated_request_and_is_lru_bounded():
    g = GlobalStore(2, 100)
    first = Suffix(SuffixParams(), g)
    prompt, answer = [X, Y], [A, B, C, D, E, W]
    first.begin(i32(prompt))
    for k in range(1, len(answer) + 1):      # the output arrives token by token
        first.propose(i32(prompt + answer[:k]), 4)
    assert [s.tolist() for s in g.sequences()] == [answer]
    second = Suffix(SuffixParams(), g)       # another slot, a new request with the same prompt
    second.begin(i32(prompt))
    # a draft is at most as long as its match (max_spec_factor 1): 1 token after [A], 3 after [A, B, C]
    assert second.propose(i32(prompt + [A]), 8).tokens.tolist() == [B] and second.last_source == "global"
    assert second.propose(i32(prompt + [A, B, C]), 8).tokens.tolist() == [D, E, W]
    third = Suffix(SuffixParams(), None)     # without the global tree: nothing to copy
    third.begin(i32(prompt))
    assert third.propose(i32(prompt + [A]), 8).tokens.tolist() == []
    for toks in ([Z, Z, Z], [W, W, W]):      # two more requests: the least recently grown leaves
        Suffix(SuffixParams(), g).propose(i32(toks), 1)
    assert len(g) == 2 and [s.tolist() for s in g.sequences()] == [[Z, Z, Z], [W, W, W]]


def test_draft_bounds_and_registry():
    spec = SpecParams(types=("suffix",), suffix=SuffixParams(max_depth=10))
    assert parse_spec_types("suffix,ngram-simple,draft") == ("ngram-simple", "suffix", "draft-simple")
    assert draft_n_max("suffix", spec) == 9
    assert drafter_key("suffix", spec) != drafter_key("suffix", SpecParams())
    assert isinstance(make_drafter("suffix", None, spec), Suffix)      # no model: no global tree
    # the longest draft is max_depth - 1 (a match of 1), whatever n_max asks
    assert len(draft([A] + list(range(30, 60)) + [A], 64, max_depth=10, max_spec_factor=100)) == 9


# ---- the store -------------------------------------------------------------------------------------


def brute_ends(seqs: list[list[int]], pattern: list[int]) -> int:
    """How many times pattern occurs in the sequences (no crossing between them)."""
    m = len(pattern)
    return sum(1 for s in seqs for i in range(len(s) - m + 1) if s[i:i + m] == pattern)


def test_store_interleaved_growth_moves_truncates_and_compacts():
    """Two sequences grown in turns (each append moves one past the other), one truncated, one
    removed: every pattern's occurrences equal a brute-force count, before and after compaction."""
    rng = np.random.default_rng(0)
    st, seqs = TokenStore(), {}
    for _ in range(3):
        seqs[st.new()] = []
    for step in range(400):
        sid = list(seqs)[step % len(seqs)]
        toks = rng.integers(0, 6, int(rng.integers(1, 9))).tolist()
        st.extend(sid, i32(toks))
        seqs[sid] += toks
    first = list(seqs)[0]
    st.truncate(first, 50)
    seqs[first] = seqs[first][:50]
    st.remove(list(seqs)[1])
    del seqs[list(seqs)[1]]

    def check():
        for sid, toks in seqs.items():
            assert st.tokens(sid).tolist() == toks
        for pattern in ([1], [2, 3], [0, 1, 2], [5, 5, 5, 5]):
            ends = st.ends(pattern[-1])
            for m in range(2, len(pattern) + 1):
                ends = ends[st.buf[ends - (m - 1)] == pattern[-m]]
            assert ends.size == brute_ends(list(seqs.values()), pattern), pattern

    check()
    assert st.n_stale > 0
    st.compact()
    assert st.n_stale == 0
    check()


# ---- the cache file --------------------------------------------------------------------------------


class FakeModel:
    def __init__(self, path: Path, n_vocab: int = 100, shift: int = 0) -> None:
        self.path, self.n_vocab, self.shift = str(path), n_vocab, shift

    def tokenize(self, text: str, add_special: bool = True) -> np.ndarray:
        return i32([(ord(c) + self.shift) % self.n_vocab for c in text])


class FakeTarget:
    def __init__(self, model) -> None:
        self.model = model


def test_cache_file_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "suffix.npz"
    model = FakeTarget(FakeModel(tmp_path / "m.gguf"))
    p = SuffixParams(max_cached_requests=2, cache_file=str(path))
    with private_stores():
        g = shared_store(model, p)
        assert shared_store(model, p) is g and len(g) == 0      # one per model and settings; no file yet
        for toks in ([A, B, C], [D, E], [X, Y, Z]):
            g.add(None, i32(toks))
        g.save(path)
    with private_stores():
        again = shared_store(model, p)
        assert [s.tolist() for s in again.sequences()] == [[D, E], [X, Y, Z]]
        smaller = shared_store(model, replace(p, max_cached_requests=1, cache_file=None))
        assert smaller is not again and len(smaller) == 0
    lengths, tokens = read_cache(path)
    assert lengths.tolist() == [2, 3] and tokens.tolist() == [D, E, X, Y, Z]
    # another tokenizer, garbage, another .npz: one line each, with the fix
    for target, bad, why in ((FakeTarget(FakeModel(tmp_path / "m.gguf", shift=1)), path, "made with another tokenizer"),
                             (model, tmp_path / "junk.npz", "not a specrun suffix cache"),
                             (model, tmp_path / "other.npz", "not a specrun suffix cache (no fingerprint")):
        if bad.name == "junk.npz":
            bad.write_bytes(b"not a zip at all")
        elif bad.name == "other.npz":
            np.savez(bad, format=np.asarray("x"), version=np.asarray(1))
        with private_stores(), pytest.raises(SpecrunError) as e:
            shared_store(target, replace(p, cache_file=str(bad)))
        msg = str(e.value)
        assert why in msg and "--spec-suffix-cache" in msg and "\n" not in msg, msg


# ---- the flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag, value, shown", [
    ("--spec-suffix-max-depth", "1", "1 is not in the range 2<=x<=1024."),
    ("--spec-suffix-max-spec-factor", "0", "0.0 is not in the range x>0."),
    ("--spec-suffix-min-token-prob", "1.5", "1.5 is not in the range 0<=x<=1."),
    ("--spec-suffix-max-cached-requests", "-1", "-1 is not in the range x>=0."),
    ("--spec-suffix-cache", "/nonexistent-folder/c.npz",
     "cannot write /nonexistent-folder/c.npz: No such file or directory (create the folder first)"),
])
def test_flag_errors_are_one_line(flag, value, shown):
    r = CliRunner().invoke(cli, ["-m", "smollm2-135m-instruct", "--spec-type", "suffix", flag, value, "-p", "hi",
                                 "-n", "1"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert r.output.strip().splitlines()[-1] == f"Error: Invalid value for '{flag}': {shown}", r.output


def test_bad_cache_file_flag(tmp_path):
    bad = tmp_path / "c.npz"
    bad.write_text("hello")
    r = CliRunner().invoke(cli, ["-m", "smollm2-135m-instruct", "--spec-type", "suffix", "--spec-suffix-cache",
                                 str(bad), "-p", "hi", "-n", "1"])
    assert r.exit_code == 2 and "Traceback" not in r.output
    last = r.output.strip().splitlines()[-1]
    assert "not a specrun suffix cache" in last and "delete it, or give --spec-suffix-cache another file" in last


@pytest.mark.parametrize("types, flag, want", [
    (("suffix",), None, True), (("suffix",), False, False), (("ngram-simple", "suffix"), None, True),
    (("ngram-simple",), None, False), (("ngram-simple",), True, True), ((), None, False), (("auto",), None, False),
])
def test_suffix_drafts_adaptive_unless_told_not_to(types, flag, want):
    """--spec-draft-adaptive is suffix's default (fixed lengths draft below none on fresh text);
    --no-spec-draft-adaptive turns it off; the other types keep fixed lengths."""
    from specrun.cli.runtime.options import spec_params

    assert spec_params({"spec_type": types, "adaptive": flag}).adaptive is want


def test_a_request_that_names_suffix_drafts_adaptive():
    from types import SimpleNamespace

    from specrun.cli.server.state import ServerState

    state = SimpleNamespace(config=SimpleNamespace(spec=SpecParams(types=("ngram-simple",)),
                                                   spec_types=("none", "ngram-simple", "suffix")))
    spec = ServerState.spec.__get__(state)
    assert spec(SimpleNamespace(type="suffix", n_max=None, n_min=None, p_min=None)).adaptive
    assert not spec(SimpleNamespace(type="ngram-simple", n_max=None, n_min=None, p_min=None)).adaptive


def test_export(smollm_path):
    run = CliRunner().invoke
    r = run(cli, ["export", "--to", "vllm", "-m", str(smollm_path), "--spec-type", "suffix",
                  "--spec-suffix-max-depth", "32", "--spec-suffix-min-token-prob", "0.2"])
    assert r.exit_code == 0, r.output
    assert ('"method": "suffix", "num_speculative_tokens": 32, "suffix_decoding_max_tree_depth": 32, '
            '"suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0, '
            '"suffix_decoding_min_token_prob": 0.2') in r.stdout
    r = run(cli, ["export", "--to", "sglang", "-m", str(smollm_path), "--spec-type", "suffix"])
    assert r.exit_code == 0 and "--speculative-algorithm SUFFIX" in r.stdout, r.output
    r = run(cli, ["export", "--to", "llama-server", "-m", str(smollm_path), "--spec-type", "suffix"])
    assert r.exit_code == 1 and "llama-server has no suffix decoding" in r.output


def test_auto_probes_suffix_cold_and_runs_it_with_the_global_tree():
    from specrun.cli.runtime.auto import AUTO_NGRAM_TYPES, _cold_suffix

    assert "suffix" in AUTO_NGRAM_TYPES
    base = SpecParams(suffix=SuffixParams(max_cached_requests=7))
    probe = _cold_suffix(base)
    assert probe.types == ("suffix",) and probe.suffix.max_cached_requests == 0
    assert make_drafter("suffix", None, probe).store is None


# ---- the cost of a draft (reported, never asserted) --------------------------------------------------


def test_cost_per_token_is_reported(capsys):
    """A drafter following a 4,000-token text token by token, with a global store of 200 earlier
    outputs of 500 tokens (vocabulary 2,000): the time per propose() is printed (pytest -s)."""
    rng = np.random.default_rng(1)
    g = GlobalStore(1000, 2000)
    for _ in range(200):
        g.add(None, i32(rng.integers(0, 2000, 500)))
    text = np.concatenate([rng.integers(0, 2000, 2000), np.tile(rng.integers(0, 2000, 100), 20)]).astype(np.int32)
    s = Suffix(SuffixParams(), g)
    s.begin(text[:1000])
    t = time.perf_counter()
    drafted = 0
    for n in range(1001, len(text) + 1):
        drafted += len(s.propose(text[:n], 24))
    dt = (time.perf_counter() - t) / (len(text) - 1000)
    with capsys.disabled():
        print(f"\nsuffix: {dt * 1e6:.0f} us per propose() over 3000 tokens (own text 4000, global 100000 tokens), "
              f"{drafted} tokens drafted")
    assert drafted > 0


# ---- on a real model (slow) ------------------------------------------------------------------------

_CODE = (Path(__file__).parent / "data" / "copy_source.txt").read_text()
COPY = "Copy this file verbatim.\n\n" + _CODE[:700] + "\n\nCopy:\n\n" + _CODE[:120]
FREE = "Once upon a time, in a small village by the sea, there lived an old lighthouse keeper named"


@pytest.fixture(scope="module")
def engine(smollm_path):
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams

    with Engine(str(smollm_path), EngineParams(n_ctx=2048, n_threads=1)) as e:
        yield e


def gen(engine, prompt, temp, n, **kw):
    from specrun.kernels.types import SamplingParams

    g = engine.generate(prompt, n, SamplingParams(temp=temp, seed=1234), **kw)
    return [t for toks in g for t in toks], g.stats


SUFFIX = SpecParams(types=("suffix",), verify="match")


@pytest.mark.slow
@pytest.mark.parametrize("temp", [0.0, pytest.param(0.8, marks=pytest.mark.full)])
def test_equals_plain_where_it_drafts_a_lot_and_where_every_draft_is_wrong(engine, temp):
    with private_stores():
        prompt = engine.tokenize(COPY)
        plain, st0 = gen(engine, prompt, temp, 48, spec=SpecParams())
        got, st = gen(engine, prompt, temp, 48, spec=SUFFIX)
        assert got == plain
        assert st.n_drafted > 10 and st.n_accepted > 0 and st.n_target_passes < st0.n_target_passes
        wrong = [ShiftedDraft(Suffix(SuffixParams()), engine.model.n_vocab)]
        got, st = gen(engine, prompt, temp, 48, spec=SUFFIX, drafters=wrong)
        assert got == plain and st.n_drafted > 0 and st.n_accepted == 0


@pytest.mark.slow
@pytest.mark.full     # make test: test_exactness.py's suffix cells run each prompt twice
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_repeated_request_drafts_from_the_global_tree(engine, smollm_path, temp):
    """The same free-text request twice: the first drafts from its own text only, the second copies
    the first's output from the global tree (another engine over the same file: another slot).
    Both equal plain decoding; the second needs far fewer target passes."""
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams

    # settings of this test's own (the module's engine caches a drafter, and its store, per settings)
    spec = replace(SUFFIX, suffix=SuffixParams(max_cached_requests=1000 + int(temp * 10)))
    with private_stores():
        prompt = engine.tokenize(FREE)
        plain, _ = gen(engine, prompt, temp, 64, spec=SpecParams())
        first, st1 = gen(engine, prompt, temp, 64, spec=spec)
        with Engine(str(smollm_path), EngineParams(n_ctx=2048, n_threads=1)) as other:
            second, st2 = gen(other, prompt, temp, 64, spec=spec)
        assert first == second == plain
        assert st2.n_accepted > st1.n_accepted + 20 and st2.n_target_passes < st1.n_target_passes / 2
        # without the global tree a repeat drafts from its own text only
        cold = replace(SUFFIX, suffix=SuffixParams(max_cached_requests=0))
        third, st3 = gen(engine, prompt, temp, 64, spec=cold)
        assert third == plain and st3.n_accepted < st2.n_accepted - 20


@pytest.mark.slow
def test_engine_reset_with_drafters_forgets_the_global_tree(engine):
    """Engine.reset(drafters=True) is a fresh process to the drafters: a repeated request drafts from
    its own text only, as the first did, where without it the cached drafter's global tree holds
    the first request's output."""
    spec = replace(SUFFIX, suffix=SuffixParams(max_cached_requests=77))   # this test's own drafter
    with private_stores():
        prompt = engine.tokenize(FREE)
        first, st1 = gen(engine, prompt, 0.0, 48, spec=spec)
        engine.reset()
        again, st2 = gen(engine, prompt, 0.0, 48, spec=spec)
        engine.reset(drafters=True)
    with private_stores():
        fresh, st3 = gen(engine, prompt, 0.0, 48, spec=spec)
    assert first == again == fresh
    assert st2.n_accepted > st1.n_accepted + 20
    assert (st3.n_drafted, st3.n_accepted) == (st1.n_drafted, st1.n_accepted)
