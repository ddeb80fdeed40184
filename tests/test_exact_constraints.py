"""Speculative output equals plain decoding under llama.cpp's logit controls (penalties, logit
bias, --ignore-eos, a GBNF grammar, a JSON schema), token for token, greedy and seeded at
temperature 0.8 (sample-and-match), forced through every branch: n-gram drafts on a text that
repeats, the target drafting for itself (mostly right: its drafts are not constrained), an
oracle drafter proposing the constrained plain output (always right) and that oracle shifted by
one token id (always wrong). Every control is checked to change the output (else the equality
would prove nothing), and constrained text to follow its grammar. `make test` runs every control
once on SmolLM2 (the smaller model), greedy or seeded; the other temperature and Gemma's cells are
the grid's tail (`make test-full`)."""

from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest
from drafters import OracleDraft, ShiftedDraft

from specrun.kernels.drafters import DraftModel
from specrun.kernels.engine import Engine
from specrun.kernels.grammar import schema_to_gbnf
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.types import SamplingParams

pytestmark = pytest.mark.slow

SEED = 1234
TEMPS = (0.0, 0.8)
FULL = pytest.mark.full      # the grid's tail: `make test-full`
NEG = float("-inf")
REPEAT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat.\n" * 4
FIB = ("def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
       "Rewrite the function above exactly:\n\ndef fib(n):\n")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "maximum": 150}}, "required": ["name", "age"]}


def chatml(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


PENALTIES = dict(repeat_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.5)
NO_DIGITS = "root ::= [^0-9]*"          # every prefix of a sentence of it is one: checked with a regex
NO_O = "root ::= [^o]*"

# (model, prompt text, control, sampling kwargs (None: a logit bias made from the plain output), tokens)
CASES = {
    "smollm-penalties": ("smollm", chatml("Repeat exactly:\n" + REPEAT), PENALTIES, 24),
    "smollm-logit-bias": ("smollm", chatml("Repeat exactly:\n" + REPEAT), None, 24),
    "smollm-ignore-eos": ("smollm", chatml("Say OK."), dict(ignore_eos=True), 24),
    "smollm-grammar": ("smollm", chatml("Repeat exactly:\n" + REPEAT), dict(grammar=NO_O), 24),
    "smollm-json-schema": ("smollm", chatml("Describe a person as JSON with a name and an age."),
                           dict(grammar=schema_to_gbnf(PERSON)), 48),
    "gemma-penalties": ("gemma", FIB, PENALTIES, 24),
    "gemma-logit-bias": ("gemma", FIB, None, 24),
    "gemma-grammar": ("gemma", FIB, dict(grammar=NO_DIGITS), 24),
}


class Target:
    """One engine per model for the module; the target as its own draft model, loaded when first
    asked for; plain outputs without a control, cached."""

    def __init__(self, path) -> None:
        self.path = str(path)
        self.engine = Engine(self.path, EngineParams(n_ctx=1024))
        self._self_draft: DraftModel | None = None
        self._free: dict = {}

    @property
    def self_draft(self) -> DraftModel:
        if self._self_draft is None:
            self._self_draft = DraftModel(self.engine.target, self.path)
        return self._self_draft

    def run(self, prompt, sampling: SamplingParams, n: int, types=(), drafters=None):
        spec = SpecParams(types=types, n_max=4, verify="match", ngram_size_n=3, ngram_size_m=8)
        gen = self.engine.generate(prompt, n, sampling, spec=spec, drafters=drafters)
        return [t for toks in gen for t in toks], gen.stats

    def free(self, prompt, temp: float, n: int) -> list[int]:
        key = (tuple(prompt), temp, n)
        if key not in self._free:
            self._free[key], _ = self.run(prompt, SamplingParams(temp=temp, seed=SEED), n)
        return self._free[key]

    def close(self) -> None:
        if self._self_draft is not None:
            self._self_draft.close()
        self.engine.close()


class Targets(dict):
    """model name -> Target, each loaded when a test first asks for it."""

    def __init__(self, paths: dict) -> None:
        super().__init__()
        self.paths = paths

    def __missing__(self, model: str) -> Target:
        self[model] = Target(self.paths[model])
        return self[model]


@pytest.fixture(scope="module")
def targets(gemma_path, smollm_path):
    t = Targets({"gemma": gemma_path, "smollm": smollm_path})
    yield t
    for x in t.values():
        x.close()


def controls(target: Target, prompt, temp: float, kw: dict | None, n: int) -> tuple[SamplingParams, list[int]]:
    """The control's sampling, and plain decoding's output without it."""
    free = target.free(prompt, temp, n)
    if kw is None:        # ban the most frequent token of the free text, push the next one down
        (a, _), (b, _) = Counter(free).most_common(2)
        kw = dict(logit_bias=((a, NEG), (b, -3.0)))
    return SamplingParams(temp=temp, seed=SEED, **kw), free


def check_text(case: str, text: str, stop: str) -> None:
    if case.endswith("-grammar"):
        pattern = r"[^0-9]*" if case.startswith("gemma") else r"[^o]*"
        assert re.fullmatch(pattern, text, flags=re.S), text
    if case.endswith("json-schema"):
        assert stop == "eog", text          # the schema's object is short: it ends well within n
        obj = json.loads(text)
        assert set(obj) == {"name", "age"} and isinstance(obj["name"], str) and isinstance(obj["age"], int)
        assert len(obj["name"]) <= 12 and obj["age"] <= 150


# make test: each control once on SmolLM2, greedy or seeded (both kinds of run among them)
IN_MAKE_TEST = {("smollm-penalties", 0.8), ("smollm-logit-bias", 0.0), ("smollm-ignore-eos", 0.0),
                ("smollm-grammar", 0.8), ("smollm-json-schema", 0.0)}


@pytest.mark.parametrize("case, temp", [
    pytest.param(case, temp, id=f"{case}-{temp}", marks=() if (case, temp) in IN_MAKE_TEST else FULL)
    for case in sorted(CASES) for temp in TEMPS])
def test_spec_equals_plain_under_the_control(targets, case, temp):
    model, text, kw, n = CASES[case]
    t = targets[model]
    prompt = t.engine.tokenize(text)
    sampling, free = controls(t, prompt, temp, kw, n)
    plain, st = t.run(prompt, sampling, n)
    assert plain != free, "the control must change the output, or this test proves nothing"
    check_text(case, t.engine.model.detokenize(plain), st.stop)
    if sampling.ignore_eos:
        assert len(plain) == n and not any(t.engine.model.is_eog(x) for x in plain)
        assert len(free) < n                # without it the answer ends
    drafters = {
        "ngram-simple": dict(types=("ngram-simple",)),
        "draft (self)": dict(drafters=[t.self_draft]),
        "oracle": dict(drafters=[OracleDraft(plain, len(prompt))]),
        # plain's own next tokens, each id shifted by one: never the token sampled there
        "always wrong": dict(drafters=[ShiftedDraft(OracleDraft(plain, len(prompt)), t.engine.model.n_vocab)]),
    }
    for name, how in drafters.items():
        got, gst = t.run(prompt, sampling, n, **how)
        assert got == plain, f"{name}: speculative output differs from plain decoding"
        if name == "oracle":
            assert gst.n_accepted == gst.n_drafted > 0
        if name == "draft (self)":
            assert gst.n_drafted > 0
        if name == "always wrong":
            assert gst.n_drafted > 0 and gst.n_accepted == 0


def test_ngram_drafts_are_cut_where_the_grammar_forbids(targets):
    """A draft copied from the prompt is cut at its first token the grammar forbids (a digit)
    before the target pass: drafts still run, and every drafted token was verified."""
    t = targets["gemma"]
    prompt = t.engine.tokenize(FIB)
    sampling = SamplingParams(temp=0.0, grammar=NO_DIGITS)
    got, st = t.run(prompt, sampling, 32, types=("ngram-simple",))
    plain, _ = t.run(prompt, sampling, 32)
    assert got == plain
    assert st.n_drafted > 0 and st.n_accepted > 0
    assert re.fullmatch(r"[^0-9]*", t.engine.model.detokenize(got))


@pytest.mark.parametrize("kw", [dict(grammar=NO_O), PENALTIES], ids=["grammar", "penalties"])
def test_rejection_sampling_keeps_the_constraint(targets, kw):
    """Speculative sampling (--spec-verify rejection) with the target drafting for itself: its q is
    not constrained, p is; the text still follows the grammar (equal in distribution to plain
    decoding, checked statistically in test_constrain.py, not token for token)."""
    t = targets["smollm"]
    prompt = t.engine.tokenize(chatml("Repeat exactly:\n" + REPEAT))
    sampling = SamplingParams(temp=0.8, seed=SEED, **kw)
    spec = SpecParams(n_max=4, verify="rejection")
    gen = t.engine.generate(prompt, 24, sampling, spec=spec, drafters=[t.self_draft])
    got = [x for toks in gen for x in toks]
    assert gen.stats.verify == "rejection" and gen.stats.n_drafted > 0
    if "grammar" in kw:
        assert re.fullmatch(r"[^o]*", t.engine.model.detokenize(got), flags=re.S)


def test_draft_mtp_equals_plain_under_controls(tmp_path_factory):
    """draft-mtp (the synthetic qwen35 with an exact MTP head, quantized: bit-exact) under the
    penalties (sampled: its greedy text repeats no token within 24), a grammar and a logit bias."""
    from specrun.gguf_spec.testmodel import Head, SynthConfig
    from specrun.kernels.testmodel import build_test_model

    path = build_test_model(tmp_path_factory.mktemp("mtp-c") / "exact.gguf", SynthConfig(head=Head.parse("exact")),
                            "q8_0")
    spec_none = SpecParams(verify="match")
    with Engine(str(path), EngineParams(n_ctx=1024, spec=SpecParams(types=("draft-mtp",)))) as e:
        prompt = e.tokenize("the quick brown fox jumps over the lazy dog " * 4)

        def run(s, spec=spec_none):
            gen = e.generate(prompt, 24, s, spec=spec)
            return [x for toks in gen for x in toks], gen.stats

        for kw, temps in ((PENALTIES, (0.8,)), (dict(grammar="root ::= [^e]*"), TEMPS), (None, TEMPS)):
            for temp in temps:
                free, _ = run(SamplingParams(temp=temp, seed=SEED))
                if kw is None:
                    kw = dict(logit_bias=((Counter(free).most_common(1)[0][0], NEG),))
                s = SamplingParams(temp=temp, seed=SEED, **kw)
                plain, _ = run(s)
                assert plain != free, (kw, temp)
                got, st = run(s, SpecParams(types=("draft-mtp",), n_max=3, verify="match"))
                assert got == plain, (kw, temp)
                assert st.n_drafted > 0
                if "grammar" in kw:
                    assert "e" not in e.model.detokenize(got)


def test_a_bad_grammar_or_bias_is_refused_before_any_work(targets):
    from specrun.gguf_spec.errors import SpecrunError

    e = targets["smollm"].engine
    prompt = e.tokenize("hi")
    with pytest.raises(SpecrunError, match="does not parse"):
        e.generate(prompt, 4, SamplingParams(grammar='root ::= "a'))
    with pytest.raises(SpecrunError, match=r"vocabulary has 49152 tokens"):
        e.generate(prompt, 4, SamplingParams(logit_bias=((10**6, 1.0),)))
    # the engine still works afterwards
    got = [x for toks in e.generate(prompt, 2, SamplingParams(temp=0.0)) for x in toks]
    assert len(got) == 2 and np.all(np.asarray(got) >= 0)


def test_logprobs_are_the_models_before_the_sampler_chain(targets):
    """The reported log-probabilities are llama-server's default ones (no post_sampling_probs): the
    raw logits at temperature 1, before the logit bias, penalties and grammar. A grammar that allows
    one text only: the first position's alternatives are the unconstrained ones, tokens the grammar
    forbids among them, and the emitted token has its raw logprob; a token banned with -inf keeps
    its place in the alternatives. The same numbers with speculation (the target drafting for itself)."""
    forced = " zebra"
    t = targets["smollm"]
    e, draft = t.engine, t.self_draft
    prompt = e.tokenize(chatml("Repeat exactly:\n" + REPEAT))

    def run(s: SamplingParams, n: int = 16, drafters=None, k: int = 5):
        gen = e.generate(prompt, n, s, spec=SpecParams(n_max=4, verify="match"), drafters=drafters, logprobs=k)
        return [x for toks in gen for x in toks], gen.logprobs

    free, free_lp = run(SamplingParams(temp=0.0))
    _, (whole,) = run(SamplingParams(temp=0.0), n=1, k=e.model.n_vocab)
    raw = dict(whole.top)                                      # the first row: every token's logprob
    for s in (SamplingParams(temp=0.0, grammar=f'root ::= "{forced}"'),
              SamplingParams(temp=0.8, seed=SEED, grammar=f'root ::= "{forced}"', repeat_penalty=1.3)):
        got, lp = run(s)
        assert e.model.is_eog(got[-1]) and e.model.detokenize(got[:-1]) == forced, got
        assert [x.token for x in lp] == got
        assert lp[0].top == free_lp[0].top                    # the unconstrained alternatives...
        assert any(not forced.startswith(e.model.piece(i).decode()) for i, _ in lp[0].top)  # ...forbidden ones
        assert lp[0].logprob == raw[got[0]] < lp[0].top[0][1]   # the emitted token: its raw logprob
        assert run(s, drafters=[draft]) == (got, lp)          # spec == none, logprobs too
    banned, lp = run(SamplingParams(temp=0.0, logit_bias=((free[0], NEG),)))
    assert banned[0] != free[0] and lp[0].top == free_lp[0].top and lp[0].top[0][0] == free[0]
    assert lp[0].logprob == raw[banned[0]]
