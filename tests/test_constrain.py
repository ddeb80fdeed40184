"""The logit controls (kernels/constrain.py, sampling.penalize, kernels/grammar.py) as units: the
penalty math against hand-worked numbers, each verify row transformed with the state of the
tokens before it, drafts cut at a banned token, speculative sampling under penalties reproducing
the target's joint distribution (statistically), and llama.cpp's grammar sampler: one-line errors
for what it refuses (never an abort), clones, and the lazy top-k mask equal to the full one."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.constrain import Constraints, check_controls
from specrun.kernels.grammar import Grammar, GrammarError, check_grammar, schema_to_gbnf
from specrun.kernels.sampling import inverse_cdf, penalize, sample, transform
from specrun.kernels.types import Draft, SamplingParams
from specrun.kernels.verify import verify_match, verify_rejection

NEG = float("-inf")


class StubModel:
    """What Constraints reads of a model, without llama.cpp: V tokens, the last one end-of-generation."""

    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab
        self.eos = n_vocab - 1

    def is_eog(self, t: int) -> bool:
        return t == self.eos


# ---- the penalty math: llama_sampler_penalties, worked by hand -------------------------------

PENALTY_CASES = [
    # logits, window, repeat, frequency, presence, expected
    pytest.param([2.0, -1.0, 0.5], [0, 0, 1], 2.0, 0.5, 0.25, [-0.25, -2.75, 0.5], id="docstring-example"),
    pytest.param([3.0, -3.0, 1.0, 0.0], [0, 1, 3], 1.5, 0.0, 0.0, [2.0, -4.5, 1.0, 0.0],
                 id="repeat: divide positive, multiply negative, zero stays zero"),
    pytest.param([1.0, 1.0, 1.0], [2, 2, 2, 0], 1.0, 0.5, 0.0, [0.5, 1.0, -0.5], id="frequency: count x 0.5"),
    pytest.param([1.0, 1.0, 1.0], [2, 2, 2, 0], 1.0, 0.0, 0.75, [0.25, 1.0, 0.25], id="presence: once per token"),
    pytest.param([4.0, -2.0], [0, 1, 1], 2.0, 1.0, 1.0, [0.0, -7.0], id="all three"),
    pytest.param([4.0, -2.0], [], 2.0, 1.0, 1.0, [4.0, -2.0], id="empty window: nothing"),
    pytest.param([NEG, 1.0], [0, 1], 2.0, 1.0, 1.0, [NEG, -1.5], id="-inf stays -inf"),
]


@pytest.mark.parametrize("logits, window, repeat, freq, present, want", PENALTY_CASES)
def test_penalize_hand_worked(logits, window, repeat, freq, present, want):
    x = np.asarray(logits, dtype=np.float32)
    got = penalize(x, np.asarray(window, dtype=np.int64), repeat, freq, present)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.asarray(want, dtype=np.float32))
    np.testing.assert_array_equal(x, np.asarray(logits, dtype=np.float32))   # a copy: the row is untouched


def test_penalties_read_the_last_n_tokens_prompt_included():
    """The window is the last repeat_last_n tokens of prompt + output (llama-server and llama-cli
    accept the prompt into the sampler); 0 turns the penalties off; -1 is refused, as llama.cpp
    0.3.36 refuses it (common/arg.cpp --repeat-last-n, the server's repeat_last_n >= 0)."""
    x = np.zeros(8, dtype=np.float32) + 1.0
    prompt = np.array([1, 2, 3, 4, 5])
    s = SamplingParams(presence_penalty=1.0, repeat_last_n=3)
    c = Constraints(StubModel(8), s, n_ctx=100, prompt=prompt)
    np.testing.assert_array_equal(c.row(x), [1, 1, 1, 0, 0, 0, 1, 1])                  # 3, 4, 5
    c.accept([6])
    np.testing.assert_array_equal(c.row(x), [1, 1, 1, 1, 0, 0, 0, 1])                  # 4, 5, 6
    np.testing.assert_array_equal(c.row(x, prefix=np.array([0])), [0, 1, 1, 1, 1, 0, 0, 1])   # 5, 6, 0
    with pytest.raises(SpecrunError, match="repeat_last_n -1: invalid repeat-last-n"):
        Constraints(StubModel(8), SamplingParams(presence_penalty=1.0, repeat_last_n=-1), 100, prompt)
    assert Constraints.of(StubModel(8), SamplingParams(presence_penalty=1.0, repeat_last_n=0), 100, prompt) is None
    assert Constraints.of(StubModel(8), SamplingParams(), 100, prompt) is None           # llama.cpp's defaults


def test_logit_bias_and_ignore_eos():
    x = np.zeros(6, dtype=np.float32)
    c = Constraints(StubModel(6), SamplingParams(logit_bias=((1, 2.5), (2, NEG), (1, 0.5)), ignore_eos=True), 100,
                    np.array([0]))
    np.testing.assert_array_equal(c.row(x), [0, 3.0, NEG, 0, 0, NEG])                  # biases add up, as llama.cpp
    with pytest.raises(SpecrunError, match=r"token 6: the vocabulary has 6 tokens \(0\.\.5\)"):
        Constraints(StubModel(6), SamplingParams(logit_bias=((6, 1.0),)), 100, np.array([0]))


@pytest.mark.parametrize("kw, why", [
    (dict(repeat_penalty=0.0), "repeat_penalty 0.0: give a number greater than 0"),
    (dict(repeat_penalty=1e-300), "repeat_penalty 1e-300"),        # 0 in float32: llama.cpp refuses it too
    (dict(frequency_penalty=float("inf")), "frequency_penalty inf: give a finite number"),
    (dict(presence_penalty=-1e9), "presence_penalty -1000000000.0"),
    (dict(repeat_last_n=-1), "repeat_last_n -1: invalid repeat-last-n (llama.cpp refuses negative values too)"),
    (dict(repeat_last_n=-2), "repeat_last_n -2"),
    (dict(logit_bias=((3, float("nan")),)), "logit_bias nan for token 3"),
    (dict(logit_bias=((3, float("inf")),)), "logit_bias inf for token 3"),
])
def test_controls_that_would_break_the_math_are_refused(kw, why):
    with pytest.raises(SpecrunError, match=re.escape(why)):
        check_controls(SamplingParams(**kw))
    check_controls(SamplingParams(logit_bias=((3, NEG), (4, 1e6)), repeat_penalty=1e6, presence_penalty=-1e6))


def test_nothing_left_ends_the_text():
    """Everything banned: the row holds only the end token (the text ends as at end of generation)."""
    c = Constraints(StubModel(3), SamplingParams(logit_bias=((0, NEG), (1, NEG)), ignore_eos=True), 100,
                    np.array([0]))
    np.testing.assert_array_equal(c.row(np.zeros(3, dtype=np.float32)), [NEG, NEG, 0.0])


def test_each_verify_row_sees_the_draft_tokens_before_it():
    """Row i of a verify pass is penalized with the window after d_1..d_i, as plain decoding would
    have it once it emitted them; the verifier's tokens equal step-by-step plain decoding."""
    rng = np.random.default_rng(3)
    V = 7
    raw = (rng.standard_normal((4, V)) * 2).astype(np.float32)   # [k + 1, V]
    s = SamplingParams(temp=0.0, repeat_penalty=1.8, frequency_penalty=0.4, presence_penalty=0.3, repeat_last_n=5)
    prompt = np.array([1, 2, 2, 3])
    c = Constraints(StubModel(V), s, 100, prompt)
    draft = Draft(np.array([4, 1, 2], dtype=np.int32))
    vp = c.verify_pass(draft)
    rows = vp.rows(raw)
    assert rows.shape == (4, V) and rows.ndim == 2
    for i in range(4):
        window = np.concatenate([prompt, draft.tokens[:i]])[-5:]
        np.testing.assert_array_equal(rows[i], penalize(raw[i], window, 1.8, 0.4, 0.3))
    # the verdict equals plain decoding that feeds back its own tokens
    verdict = verify_match(draft.tokens, rows, s, pos0=10)
    plain, ctx = [], list(prompt)
    for i in range(verdict.n_accepted + 1):
        t = sample(penalize(raw[i], np.asarray(ctx[-5:]), 1.8, 0.4, 0.3), s, 10 + i)
        plain.append(t)
        ctx.append(t)
    assert verdict.tokens.tolist() == plain


def test_drafts_are_cut_at_a_banned_token():
    c = Constraints(StubModel(6), SamplingParams(logit_bias=((3, NEG),), ignore_eos=True), 100, np.array([0]))
    q = np.full((4, 6), 1 / 6, dtype=np.float32)
    for tokens, n in (([1, 2, 3, 4], 2), ([3, 1], 0), ([1, 5, 2], 1), ([1, 2, 4], 3)):
        vp = c.verify_pass(Draft(np.array(tokens, dtype=np.int32), q[:len(tokens)]))
        assert vp.draft.tokens.tolist() == tokens[:n]
        assert vp.draft.probs.shape == (n, 6)


# ---- speculative sampling under penalties: the target's joint distribution, statistically ----

V = 6
N_TRIALS = 20_000
DELTA = 1e-6
S_REJ = SamplingParams(temp=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=3.0, presence_penalty=1.5,
                       frequency_penalty=0.5, repeat_last_n=4)
HISTORY = np.array([0, 1, 1])


def _joint_setup():
    rng = np.random.default_rng(5)
    raw = (rng.standard_normal((3, V)) * 1.5).astype(np.float32)      # [k + 1, V], k = 2
    q = np.exp(rng.standard_normal((2, V)))
    q = (q / q.sum(axis=1, keepdims=True)).astype(np.float32)         # the drafter's q, not penalized
    return raw, q


def exact_joint(raw, window_update: bool) -> np.ndarray:
    """P(x1, x2) of plain decoding: p1 from the window after the history, p2 from the window after
    the history and x1 (window_update False: the wrong rule that forgets x1)."""
    def p(row, ctx):
        return transform(penalize(row, np.asarray(ctx[-4:]), 3.0, 0.5, 1.5), S_REJ)

    p1 = p(raw[0], list(HISTORY))
    joint = np.zeros((V, V))
    for x1 in range(V):
        joint[x1] = p1[x1] * p(raw[1], list(HISTORY) + ([x1] if window_update else []))
    return joint


@pytest.mark.slow
def test_rejection_sampling_under_penalties_reproduces_the_joint_distribution():
    """Draft d1, d2 from an unpenalized q; verify_rejection on the penalized rows; where the pass
    emits one token, the next comes from a plain step. The empirical joint of the first two tokens
    is within a TV bound (1/2 sqrt(V^2/N) + sqrt(ln(1/delta)/(2N)), delta = 1e-6, as
    test_verify_stats) of plain decoding's, and the wrong rule (row 1 not seeing d1) is far outside."""
    raw, q = _joint_setup()
    model = StubModel(V + 1)                        # one extra id as the end token, never drawn here
    raw_v = np.concatenate([raw, np.full((3, 1), NEG, dtype=np.float32)], axis=1)
    rng = np.random.default_rng(11)
    counts = np.zeros((V, V))
    for trial in range(N_TRIALS):
        s = dataclasses.replace(S_REJ, seed=trial)
        c = Constraints(model, s, 100, HISTORY)
        d = np.array([inverse_cdf(q[0], rng.random()), inverse_cdf(q[1], rng.random())], dtype=np.int32)
        qv = np.concatenate([q, np.zeros((2, 1), dtype=np.float32)], axis=1)
        vp = c.verify_pass(Draft(d, qv))
        toks = verify_rejection(vp.draft.tokens, vp.draft.probs, vp.rows(raw_v), s, pos0=20).tokens.tolist()
        if len(toks) == 1:                          # a plain step for the second position
            c.accept(toks)
            toks.append(sample(c.row(raw_v[1]), s, 21))
        counts[toks[0], toks[1]] += 1
    emp = counts / N_TRIALS
    bound = 0.5 * math.sqrt(V * V / N_TRIALS) + math.sqrt(math.log(1 / DELTA) / (2 * N_TRIALS))
    right, wrong = exact_joint(raw, True), exact_joint(raw, False)
    got = 0.5 * np.abs(emp - right).sum()
    print(f"TV(empirical, plain) = {got:.4f}, bound {bound:.4f}; TV(plain, wrong rule) = "
          f"{0.5 * np.abs(right - wrong).sum():.4f}")
    assert got < bound
    assert 0.5 * np.abs(right - wrong).sum() > 3 * bound      # the test would see a row with the wrong window


# ---- llama.cpp's grammar sampler ---------------------------------------------------------------

BAD_GRAMMARS = [
    ('root ::= "a', "does not parse: unexpected end of input"),
    ("root ::= foo", "Undefined rule identifier 'foo'"),
    ('rot ::= "a"', "does not contain a 'root' symbol"),
    ('root ::= root "a"', "left recursion"),
    ("", "the grammar is empty"),
    ('root ::= "a"{5,2}', r"repetition \{5,2\} whose maximum is below its minimum"),   # llama.cpp would loop forever
    ("root ::= " + '("a" ' * 2500 + ")" * 2500, "2500 levels deep"),            # llama.cpp would overflow its stack
]


@pytest.mark.parametrize("gbnf, why", BAD_GRAMMARS, ids=[w[:30] for _, w in BAD_GRAMMARS])
def test_bad_grammar_is_one_line(gbnf, why, capfd):
    with pytest.raises(GrammarError, match=why) as e:
        check_grammar(gbnf)
    msg = str(e.value)
    assert "\n" not in msg and any(fix in msg for fix in ("fix the GBNF", "write {m,n}", "give GBNF", "flatten it"))
    assert capfd.readouterr().err == ""             # llama.cpp's dump of the grammar is not shown


@pytest.mark.parametrize("schema, why", [
    ("{bad", "is not JSON"),
    ("[1, 2]", "must be a JSON object"),
    ('{"type": "foo"}', "Unrecognized schema"),
    ('{"type": "string", "pattern": "(("}', "Pattern must start"),
    ('{"type": "string", "maxLength": 100000}', "levels deep"),
])
def test_bad_schema_is_one_line(schema, why):
    with pytest.raises(GrammarError, match=why) as e:
        schema_to_gbnf(schema)
    assert "\n" not in str(e.value)


def test_schema_to_gbnf_parses():
    gbnf = schema_to_gbnf({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
    check_grammar(gbnf)
    assert "root ::=" in gbnf


@pytest.fixture(scope="module")
def smollm(smollm_path):
    from specrun.kernels.llama import Model

    with Model(str(smollm_path)) as m:
        yield m


def test_grammar_states_branch_and_refuse(smollm):
    g = Grammar(smollm, 'root ::= "ab" | "ac"')
    a, b, c = (int(smollm.tokenize(x, add_special=False)[0]) for x in ("a", "b", "c"))
    assert g.allows(a) and not g.allows(b) and not g.allows(smollm.eos)
    after_a = g.then(a)
    assert after_a is not None and after_a.allows(b) and after_a.allows(c)
    assert g.allows(a) and not g.allows(b)           # the original state is untouched
    assert g.then(b) is None
    with pytest.raises(GrammarError, match="not allowed"):
        g.accept(smollm.eos)                         # llama.cpp would abort the process here
    done = after_a.then(b)
    assert done.allows(smollm.eos) and not done.allows(a)
    for x in (g, after_a, done):
        x.close()
        x.close()                                    # idempotent


def test_token_literals_are_checked_with_a_model(smollm):
    check_grammar('root ::= <|im_start|> "a"')       # no vocabulary to read <...> with yet: left to the model
    g = Grammar(smollm, 'root ::= <|im_start|> "a" | <[15]>')
    assert g.allows(15) and not g.allows(16) and not g.allows(smollm.eos)
    assert g.allows(int(smollm.tokenize("<|im_start|>", add_special=False)[0]))
    with pytest.raises(GrammarError, match="invalid token"):
        Grammar(smollm, "root ::= <not a token at all>")


@pytest.mark.parametrize("temp, top_k", [(0.0, 40), (0.8, 40), (0.8, 5), (0.8, 1000), (0.8, 0)])
def test_lazy_grammar_mask_equals_the_full_one(smollm, temp, top_k):
    """The grammar judges only the best tokens until the top-k allowed ones are known; what the
    chain reads (the greedy token, the top-k candidates and their distribution) equals a mask of
    the whole vocabulary."""
    gbnf = "root ::= [^0-9aeiou]*"
    s = SamplingParams(temp=temp, top_k=top_k, top_p=0.95, min_p=0.05, seed=1, grammar=gbnf)
    c = Constraints(smollm, s, 512, np.array([1]))
    full = Grammar(smollm, gbnf)
    allowed = full.allowed(np.arange(smollm.n_vocab))
    rng = np.random.default_rng(0)
    for trial in range(4):
        raw = (rng.standard_normal(smollm.n_vocab) * 3).astype(np.float32)
        raw[rng.integers(0, smollm.n_vocab, 50)] = raw.max()     # ties at the top
        ref = np.where(allowed, raw, NEG).astype(np.float32)
        got = c.row(raw)
        np.testing.assert_array_equal(transform(got, s), transform(ref, s))
        assert sample(got, s, trial) == sample(ref, s, trial)


def test_a_complete_grammar_with_ignore_eos_ends_the_text(smollm):
    """Nothing may follow a complete grammar once end-of-generation is banned: the row holds only
    the end token (llama.cpp samples from an all -inf row there), and the grammar never takes it."""
    s = SamplingParams(temp=0.0, grammar='root ::= "a"', ignore_eos=True)
    c = Constraints(smollm, s, 512, np.array([1]))
    raw = np.zeros(smollm.n_vocab, dtype=np.float32)
    a = int(sample(c.row(raw), s, 0))
    assert smollm.token_text(a) == "a"
    c.accept([a])
    row = c.row(raw)
    assert int(np.argmax(row)) == smollm.eos and np.count_nonzero(row > NEG) == 1
    c.accept([smollm.eos])                          # ends the text; no abort
    c.close()
