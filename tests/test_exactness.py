"""The core property: speculative output equals plain decoding token for token (exact mode).

For every spec type, greedy and seeded sampling at temperature 0.8 (sample-and-match
verification), n-max in {1, 3, 8, 15}, prompts shorter and longer than 256 tokens, forced through
both branches: a drafter that is always right (the target itself / an exact MTP head / an oracle)
and one that is always wrong (shifted ids / a random MTP head).

`make test` runs a few cells of each grid on the real models, together covering both models, both
prompts, both temperatures and n-max 3 and 15; the rest of the grid is its tail (`make test-full`).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from drafters import FirstRightDraft, FixedCost, OracleDraft, ShiftedDraft

from specrun.kernels.drafters import DraftModel
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.stats import GenStats
from specrun.kernels.types import SamplingParams

pytestmark = pytest.mark.slow

N_MAX = (1, 3, 8, 15)
TEMPS = (0.0, 0.8)
MODELS = ("gemma", "smollm")
FULL = pytest.mark.full      # the grid's tail: `make test-full`
N_GEN = 32
SEED = 1234

_CODE = (Path(__file__).parent / "data" / "copy_source.txt").read_text()   # 2,400 characters of Python
PROMPTS = {
    # under 256 tokens: grounded rewriting, so n-grams repeat
    "short": "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
             "Rewrite the function above exactly:\n\ndef fib(n):\n",
    # over 256 tokens: flash attention's split-KV path would differ without exact mode
    "long": "Copy this file verbatim.\n\n" + _CODE[:800] + "\n\nCopy:\n\n" + _CODE[:300],
}


def grid(*axes, keep) -> list:
    """Every combination of the axes (the first: the model, for the `target` fixture), those for
    which keep(*cell) is false marked `full`."""
    return [pytest.param(*cell, id="-".join(map(str, cell)), marks=() if keep(*cell) else FULL)
            for cell in itertools.product(*axes)]


def sampling(temp: float) -> SamplingParams:
    return SamplingParams(temp=temp, seed=SEED)


def spec(types=(), n_max=3, **kw) -> SpecParams:
    return SpecParams(types=types, n_max=n_max, verify="match", **kw)


def run(engine: Engine, prompt: np.ndarray, temp: float, n_gen: int = N_GEN, **kw) -> tuple[list[int], GenStats]:
    gen = engine.generate(prompt, n_gen, sampling(temp), **kw)
    return [t for toks in gen for t in toks], gen.stats


class Target:
    """One engine per model for the module, its plain outputs cached."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.engine = Engine(self.path, EngineParams(n_ctx=2048))
        self.prompts = {k: self.engine.tokenize(v) for k, v in PROMPTS.items()}
        self._plain: dict = {}
        self._self_draft: DraftModel | None = None

    def plain(self, prompt: str, temp: float) -> list[int]:
        key = (prompt, temp)
        if key not in self._plain:
            self._plain[key], st = run(self.engine, self.prompts[prompt], temp, spec=spec())
            assert st.n_target_passes == len(self._plain[key]) - 1   # one pass per token
        return self._plain[key]

    def self_draft(self) -> DraftModel:
        if self._self_draft is None:
            self._self_draft = DraftModel(self.engine.target, self.path)
        return self._self_draft


@pytest.fixture(scope="module")
def targets(gemma_path, smollm_path):
    """model name -> Target, each loaded once for the module when a test first names it."""
    paths, loaded = {"gemma": gemma_path, "smollm": smollm_path}, {}

    def get(model: str) -> Target:
        if model not in loaded:
            loaded[model] = Target(paths[model])
        return loaded[model]

    yield get
    for t in loaded.values():
        if t._self_draft is not None:
            t._self_draft.close()
        t.engine.close()


@pytest.fixture
def target(request, targets) -> Target:
    """The model named by the test's `target` parameter (indirect)."""
    return targets(request.param)


@pytest.mark.parametrize("target", MODELS, indirect=True)
def test_prompts_cover_both_sides_of_256(target):
    assert len(target.prompts["short"]) < 256 < len(target.prompts["long"])


# make test: llama.cpp's rule (the last occurrence) on SmolLM2, auto's (the longest match) on Gemma,
# on the long copy task (where n-grams draft most), greedy and seeded
@pytest.mark.parametrize("target, size_n, size_m, match, prompt, temp", [
    pytest.param(model, n, m, match, prompt, temp, id=f"{model}-{n}-{m}-{match}-{prompt}-{temp}",
                 marks=() if prompt == "long" and (model, n, m, match) in (("smollm", 2, 5, "last"),
                                                                           ("gemma", 2, 16, "longest")) else FULL)
    for model in MODELS for n, m, match in ((2, 2, "last"), (2, 5, "last"), (2, 16, "last"), (3, 48, "last"),
                                            (2, 16, "longest"), (3, 16, "longest"))
    for prompt in sorted(PROMPTS) for temp in TEMPS], indirect=["target"])
def test_ngram_simple_equals_plain(target, size_n, size_m, match, prompt, temp):
    """n-gram drafts are copies of size_n..size_m tokens (llama.cpp: --spec-draft-n-max does not bound them),
    from the last earlier occurrence (llama.cpp's) or the longest-matching one (auto's)."""
    got, _ = run(target.engine, target.prompts[prompt], temp,
                 spec=spec(("ngram-simple",), 3, ngram_size_n=size_n, ngram_size_m=size_m, ngram_match=match))
    assert got == target.plain(prompt, temp)


@pytest.mark.parametrize("target", ["gemma", pytest.param("smollm", marks=FULL)], indirect=True)
def test_ngram_simple_drafts_and_accepts_on_copying(target):
    """The branch that accepts is really taken (greedy copy of a long file), with drafts longer
    than --spec-draft-n-max: size_m bounds an n-gram draft, as in llama.cpp."""
    _, st = run(target.engine, target.prompts["long"], 0.0, n_gen=64,
                spec=spec(("ngram-simple",), 3, ngram_size_n=2, ngram_size_m=16))
    assert st.n_drafted > 0 and st.n_accepted > 0
    assert st.n_target_passes < st.n_gen - 1
    assert len(st.drafters[0].acc_per_pos) > 3 and st.drafters[0].acc_per_pos[3] > 0


# make test: SmolLM2 greedy on the long copy and Gemma seeded on the short prompt; the rest: full
@pytest.mark.parametrize("target, prompt, temp",
                         grid(MODELS, sorted(PROMPTS), TEMPS,
                              keep=lambda *c: c in {("smollm", "long", 0.0), ("gemma", "short", 0.8)}),
                         indirect=["target"])
def test_suffix_equals_plain(target, prompt, temp):
    """suffix (specrun's own type): drafts from the text's own suffixes and, from the second run of a
    prompt on, from the global tree of earlier outputs; both branches of the verifier are taken."""
    for _ in range(2):             # the second run copies the first one's output from the global tree
        got, st = run(target.engine, target.prompts[prompt], temp, spec=spec(("suffix",)))
        assert got == target.plain(prompt, temp)
        assert st.n_drafted > 0


@pytest.mark.parametrize("target, right_first, temp",
                         grid(MODELS, (False, True), TEMPS, keep=lambda m, r, t: (m, r, t) in {("smollm", False, 0.0),
                                                                                              ("gemma", False, 0.8)}),
                         indirect=["target"])
def test_adaptive_copy_drafters_the_best_one_drafts(target, right_first, temp):
    """Three copy drafters, adaptive: one always wrong, one right at its first token only, one always
    right. All are asked every step and the one whose cut pays most drafts, whatever their order:
    the wrong one stops after its first misses, the one-token copies lose to the long ones. The
    text stays plain decoding's."""
    ref, n_prompt, n_vocab = target.plain("long", temp), len(target.prompts["long"]), target.engine.model.n_vocab
    wrong = ShiftedDraft(OracleDraft(ref, n_prompt, spec_type="ngram-simple"), n_vocab)
    first = FirstRightDraft(OracleDraft(ref, n_prompt, spec_type="ngram-map-k"), n_vocab)
    right = OracleDraft(ref, n_prompt, spec_type="suffix")
    drafters = [right, wrong, first] if right_first else [wrong, first, right]
    measured, target.engine.pass_cost = target.engine.pass_cost, FixedCost()   # the choice, not this machine's timings
    try:
        got, st = run(target.engine, target.prompts["long"], temp, spec=spec(n_max=8, adaptive=True), drafters=drafters)
    finally:
        target.engine.pass_cost = measured
    assert got == ref
    w, f, r = (st.drafters[drafters.index(d)] for d in (wrong, first, right))
    assert w.n_acc_tokens == 0 and w.n_gen_tokens <= N_GEN // 4
    assert f.n_gen_tokens <= N_GEN // 4
    assert r.n_acc_tokens > N_GEN // 2
    assert st.n_target_passes <= N_GEN * 2 // 5


# make test: Gemma (sliding-window layers; one draft model loaded), both prompts, both temperatures,
# n-max 3 and 15, in three cells
SELF_CELLS = {("gemma", 15, "long", 0.0), ("gemma", 3, "short", 0.0), ("gemma", 15, "short", 0.8)}


@pytest.mark.parametrize("target, n_max, prompt, temp",
                         grid(MODELS, N_MAX, sorted(PROMPTS), TEMPS, keep=lambda *c: c in SELF_CELLS),
                         indirect=["target"])
def test_draft_self_equals_plain(target, n_max, prompt, temp):
    """The target as its own draft model: greedy accepts every draft token."""
    got, st = run(target.engine, target.prompts[prompt], temp, spec=spec(n_max=n_max),
                  drafters=[target.self_draft()])
    assert got == target.plain(prompt, temp)
    assert st.n_drafted > 0
    if temp == 0.0:
        assert st.n_accepted == st.n_drafted
        assert st.drafters[0].n_acc_drafts == st.drafters[0].n_gen_drafts


# make test: plain's own text shifted (no draft decodes) on both models, Gemma on the long prompt
# and SmolLM2 on the short one, greedy and seeded; Gemma drafting for itself, shifted, once
WRONG_CELLS = {("oracle", "gemma", 3, "long", 0.0), ("oracle", "gemma", 3, "long", 0.8),
               ("oracle", "smollm", 3, "short", 0.0), ("oracle", "smollm", 3, "short", 0.8),
               ("self", "gemma", 3, "short", 0.0)}


@pytest.mark.parametrize("inner, target, n_max, prompt, temp",
                         grid(("oracle", "self"), MODELS, N_MAX, sorted(PROMPTS), TEMPS,
                              keep=lambda *c: c in WRONG_CELLS), indirect=["target"])
def test_draft_always_wrong_equals_plain(target, inner, n_max, prompt, temp):
    """Every draft token shifted by one id: plain decoding's own next tokens (never the token
    sampled there, at any temperature) or the target's own drafts (a draft model's state rolled
    back after every pass)."""
    ref, n_prompt = target.plain(prompt, temp), len(target.prompts[prompt])
    inside = OracleDraft(ref, n_prompt) if inner == "oracle" else target.self_draft()
    wrong = ShiftedDraft(inside, target.engine.model.n_vocab)
    # every token costs n_max draft decodes with the target's drafts: a shorter run keeps the suite within CI's time
    got, st = run(target.engine, target.prompts[prompt], temp, n_gen=16, spec=spec(n_max=n_max), drafters=[wrong])
    assert got == ref[:16]
    assert st.n_drafted > 0
    if temp == 0.0 or inner == "oracle":
        assert st.n_accepted == 0
        assert st.n_target_passes == len(got) - 1


@pytest.mark.parametrize("target, n_max, temp", grid(MODELS, N_MAX, TEMPS, keep=lambda m, n, t: n == 15),
                         indirect=["target"])
def test_oracle_accepts_everything_when_sampling(target, n_max, temp):
    """A drafter that proposes plain decoding's own seeded output is accepted in full at any
    temperature: position-keyed draws make the verifier's samples equal plain sampling."""
    ref = target.plain("long", temp)
    n_prompt = len(target.prompts["long"])
    got, st = run(target.engine, target.prompts["long"], temp, spec=spec(n_max=n_max),
                  drafters=[OracleDraft(ref, n_prompt)])
    assert got == ref
    assert st.n_accepted == st.n_drafted > 0


@pytest.mark.parametrize("target, n_max", grid(MODELS, (3, 15), keep=lambda m, n: (m, n) == ("gemma", 15)),
                         indirect=["target"])
def test_default_verify_auto_greedy_equals_plain(target, n_max):
    """The defaults a user gets (--spec-verify auto) at temperature 0: drafts from a model with a
    distribution are verified by sample-and-match, so the text equals plain decoding."""
    auto = SpecParams(n_max=n_max)                  # verify="auto", the CLI's default
    assert auto.verify == "auto"
    got, st = run(target.engine, target.prompts["long"], 0.0, spec=auto, drafters=[target.self_draft()])
    assert got == target.plain("long", 0.0)
    assert st.verify == "match" and st.n_accepted == st.n_drafted > 0


# ---- draft-mtp on tiny qwen35 models (bit-exact with quantized weights) ----------------------


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    from specrun.gguf_spec.testmodel import Head, SynthConfig
    from specrun.kernels.testmodel import build_test_model

    d = tmp_path_factory.mktemp("mtp")
    return {head: build_test_model(d / f"{head}.gguf", SynthConfig(head=Head.parse(head)), "q8_0")
            for head in ("exact", "random", "noisy:0.3")}


# make test: n-max 3 and 15 for both heads; 1 and 8 in the tail
@pytest.mark.parametrize("head, n_maxes", [
    pytest.param(head, n_maxes, id=f"{head}-{'-'.join(map(str, n_maxes))}", marks=() if 15 in n_maxes else FULL)
    for head in ("exact", "random") for n_maxes in ((3, 15), (1, 8))])
def test_draft_mtp_equals_plain(mtp_models, head, n_maxes):
    path = str(mtp_models[head])
    prompts = {"short": "Hello world, this is a test.", "long": "the quick brown fox jumps over the lazy dog " * 40}
    with Engine(path, EngineParams(n_ctx=2048, spec=spec(("draft-mtp",)))) as e:
        toks = {k: e.tokenize(v) for k, v in prompts.items()}
        assert len(toks["short"]) < 256 < len(toks["long"])
        for name, prompt in toks.items():
            for temp in TEMPS:
                plain, _ = run(e, prompt, temp, spec=spec())
                for n_max in n_maxes:
                    got, st = run(e, prompt, temp, spec=spec(("draft-mtp",), n_max))
                    assert got == plain, (name, temp, n_max)
                    assert st.n_drafted > 0
                    if head == "exact" and temp == 0.0:
                        assert st.n_accepted == st.n_drafted, (name, n_max)
                    if head == "random" and temp == 0.0:
                        assert st.acceptance_rate < 0.2, (name, n_max)


def test_draft_mtp_kv_equals_a_fresh_heads(mtp_models):
    """After generations that reuse, cut and skip its rows (a new prompt, partial accepts, passes
    an n-gram drafter drafted), the MTP KV holds what fresh heads fed the same text in one prompt
    hold: the next draft's logits are bit-identical. The noisy head's attention reads that KV (the
    exact head's adds nothing, so the acceptance checks cannot show a stale row), and its second
    step reads the first one's own hidden row (the exact head's prediction reads only the token)."""
    def next_logits(d, text: list[int]) -> np.ndarray:
        assert d.toks == text[:-1]
        assert len(d.propose(np.asarray(text, dtype=np.int32), 2)) == 2
        return d.ctx.logits_rows()[0].copy()

    both = spec(("ngram-simple", "draft-mtp"), 3, ngram_size_n=2, ngram_size_m=3)
    params = EngineParams(n_ctx=2048, n_threads=1, spec=both)
    with Engine(str(mtp_models["noisy:0.3"]), params) as a, Engine(str(mtp_models["noisy:0.3"]), params) as b:
        short, long = (a.tokenize(t) for t in ("Hello world, this is a test.", "the quick brown fox " * 6))
        run(a, short, 0.0, spec=spec(("draft-mtp",)))
        run(a, np.concatenate([short, long]), 0.0, 96)
        _, st = run(a, long, 0.0, 96)
        assert st.drafters[0].n_gen_drafts > 0 and 0 < st.drafters[1].n_acc_tokens < st.drafters[1].n_gen_tokens
        d = a.drafters_for(both)[1]
        text = [*d.toks, 7]
        list(b.generate(d.toks, 1, sampling(0.0), spec=spec(("draft-mtp",))))   # b's heads: the text as one prompt
        assert np.array_equal(next_logits(d, text), next_logits(b.drafters_for(both)[1], text))


HYBRID_PROMPT = "the quick brown fox jumps over the lazy dog " * 40      # past 256 tokens


def run_lp(engine: Engine, prompt: np.ndarray, temp: float, n_gen: int, **kw):
    """run() with each emitted token's log-probability and top 2 (the verify rows, compared bit for bit)."""
    gen = engine.generate(prompt, n_gen, sampling(temp), logprobs=2, **kw)
    toks = [t for x in gen for t in x]
    return toks, gen.stats, [(lp.token, lp.logprob, tuple(lp.top)) for lp in gen.logprobs]


@pytest.mark.parametrize("temp", (0.0, pytest.param(0.8, marks=FULL)))
def test_hybrid_rollback_depth_follows_the_drafts_and_the_text_stays_plain(mtp_models, temp):
    """A hybrid model's context keeps recurrent-state snapshots only for the drafters that read its
    rows (MTP: as many as their longest draft), since every decode writes them: none and the n-gram
    types keep 0, their drafts verified behind a checkpoint. A request whose MTP drafts are longer
    makes the context again, deeper, once; set_spec makes it again at the new types' depth. Text =
    plain throughout."""
    with Engine(str(mtp_models["exact"]), EngineParams(n_ctx=2048)) as e:
        assert e.model.recurrent and e.ctx.params.n_rs_seq == 0
        prompt = e.tokenize(HYBRID_PROMPT)
        plain, _ = run(e, prompt, temp, 96, spec=spec())
        ngram = spec(("ngram-simple",), ngram_size_n=3, ngram_size_m=12)
        got, st = run(e, prompt, temp, 96, spec=ngram)
        assert e.ctx.params.n_rs_seq == 0 and got == plain and st.n_accepted > (0 if temp else 40)   # a bigram cycle
        e.set_spec(ngram)
        assert e.ctx.params.n_rs_seq == 0 and len(e.drafters) == 1
    with Engine(str(mtp_models["exact"]), EngineParams(n_ctx=2048, spec=spec(("draft-mtp",), 3))) as e:
        assert e.ctx.params.n_rs_seq == 3
        prompt = e.tokenize(HYBRID_PROMPT)
        got, st = run(e, prompt, temp, 96, spec=spec(("draft-mtp",), 5))
        assert e.ctx.params.n_rs_seq == 5 and got == plain and st.n_drafted > 0
        assert run(e, prompt, temp, 96)[0] == plain                  # its own drafters, made again with it
        assert run(e, prompt, temp, 96, spec=spec())[0] == plain     # a shallower request keeps the depth
        assert e.ctx.params.n_rs_seq == 5
        e.set_spec(spec())
        assert e.ctx.params.n_rs_seq == 0 and e.drafters == []
        assert run(e, prompt, temp, 96)[0] == plain


@pytest.mark.parametrize("depth, temp", [(0, 0.8), (3, 0.0), pytest.param(0, 0.0, marks=FULL),
                                         pytest.param(3, 0.8, marks=FULL)])
def test_hybrid_checkpoint_restore_replays_to_plain(mtp_models, temp, depth):
    """n-gram drafts longer than a hybrid model's snapshots (0, or 3 left by draft-mtp) are verified
    behind a checkpoint of its recurrent state; a partial accept past the snapshots restores it and
    replays the kept tokens in front of the next pass. Forced through both branches (n-gram drafts
    of the cycle: right; shifted: always wrong, restored past the snapshots), the tokens and every emitted
    token's log-probability and top 2 equal plain decoding's, bit for bit, past 256 tokens."""
    from specrun.kernels.drafters import NgramSimple

    types = ("draft-mtp",) if depth else ()
    with Engine(str(mtp_models["exact"]), EngineParams(n_ctx=2048, spec=spec(types, depth))) as e:
        assert e.ctx.params.n_rs_seq == depth
        prompt = e.tokenize(HYBRID_PROMPT)
        plain, _, lp_plain = run_lp(e, prompt, temp, 96, spec=spec())
        ngram = spec(("ngram-simple",), ngram_size_n=3, ngram_size_m=12)
        got, st, lp = run_lp(e, prompt, temp, 96, spec=ngram)
        assert (got, lp) == (plain, lp_plain) and st.n_accepted > 0
        wrong = [ShiftedDraft(NgramSimple(3, 12, 1), e.model.n_vocab)]
        got, st, lp = run_lp(e, prompt, temp, 96, spec=ngram, drafters=wrong)
        assert (got, lp) == (plain, lp_plain)
        assert st.n_drafted > 0 and st.n_accepted == 0
        if depth == 0:                       # every rejection goes past the snapshots
            assert st.n_restores == st.drafters[0].n_gen_drafts
        else:                                # drafts of <= 3 roll back through them (replay steps' too)
            assert 0 < st.n_restores < st.drafters[0].n_gen_drafts
        assert e.ctx.params.n_rs_seq == depth


@pytest.mark.parametrize("temp", (0.0, pytest.param(0.8, marks=FULL)))
def test_hybrid_draft_model_rolls_back_through_its_checkpoint(mtp_models, temp, caplog):
    """draft-simple with a hybrid draft model (the target itself) on a hybrid target: both roll their
    rejected tokens back through checkpoints, never by starting over. Always right (the target as its
    own draft) and always wrong (shifted): text = plain past 256 tokens."""
    import logging

    path = str(mtp_models["exact"])
    with Engine(path, EngineParams(n_ctx=2048, draft_model=path, spec=spec(("draft-simple",), 5))) as e:
        assert e.ctx.params.n_rs_seq == 0 and e.drafters[0].model.recurrent
        prompt = e.tokenize(HYBRID_PROMPT)
        plain, _ = run(e, prompt, temp, 96, spec=spec())
        with caplog.at_level(logging.INFO, logger="specrun.kernels.llama"):
            got, st = run(e, prompt, temp, 96)
            assert got == plain and st.n_drafted > 0
            if temp == 0.0:
                assert st.n_accepted == st.n_drafted and st.n_restores == 0
            wrong = [ShiftedDraft(e.drafters[0], e.model.n_vocab)]
            got, st = run(e, prompt, temp, 96, drafters=wrong)
            assert got == plain and st.n_accepted == 0 and st.n_restores == st.drafters[0].n_gen_drafts > 0
        # a context starts over only where a generation starts (the prompt's cache past its end),
        # never for a rejected draft
        starts = [r.args[0] for r in caplog.records if "cannot roll the memory back" in r.msg]
        assert starts and all(keep <= len(prompt) for keep in starts)


@pytest.mark.parametrize("types", [(), ("ngram-simple",)])
def test_hybrid_prompt_checkpoint_is_reused_and_exact(mtp_models, types):
    """A hybrid model cannot roll back into a prompt, so its context keeps a checkpoint before each
    prompt's last token (the last N_PROMPT_CKPTS): the same prompt again evaluates one token, and a
    prompt that leaves the last reply part-way (a chat template re-rendering it) starts at the
    checkpoint, not from zero. Tokens and log-probabilities equal a fresh engine's, bit for bit."""
    from specrun.kernels.llama import N_PROMPT_CKPTS

    path, sp = str(mtp_models["exact"]), spec(types, ngram_size_n=3, ngram_size_m=12)
    with Engine(path, EngineParams(n_ctx=2048, spec=sp)) as e, Engine(path, EngineParams(n_ctx=2048, spec=sp)) as fresh:
        a = e.tokenize(HYBRID_PROMPT)
        first, st1, lp1 = run_lp(e, a, 0.8, 48)
        again, st2, lp2 = run_lp(e, a, 0.8, 48)
        assert (again, lp2) == (first, lp1) and st1.n_prompt == len(a) and st2.n_prompt == 1
        b = np.concatenate([a, np.asarray(first[:20], dtype=np.int32), e.tokenize(" and then the fox", False)])
        got, st3, lp3 = run_lp(e, b, 0.8, 48)
        assert st3.n_prompt == len(b) - (len(a) - 1)            # from the first prompt's checkpoint
        fresh_b = run_lp(fresh, b, 0.8, 48)
        assert (got, lp3) == fresh_b[::2] and fresh_b[1].n_prompt == len(b)
        for i in range(N_PROMPT_CKPTS + 2):                      # a bounded number of them
            b = np.concatenate([b, e.tokenize(f" {i}", False)])      # each turn extends the last
            run(e, b, 0.0, 1)
        assert [c.pos for c in e.ctx._prompt_ckpts][-1] == len(b) - 2
        assert len(e.ctx._prompt_ckpts) == N_PROMPT_CKPTS


@pytest.mark.parametrize("cached", [False, True])
def test_hybrid_adaptive_length_measures_its_passes_and_stays_plain(mtp_models, cached):
    """--spec-draft-adaptive times a few target passes before its first generation; a hybrid model
    takes them back through a checkpoint (or, with nothing cached yet, by clearing), and the text
    stays plain's."""
    with Engine(str(mtp_models["exact"]), EngineParams(n_ctx=2048)) as e:
        prompt = e.tokenize(HYBRID_PROMPT)
        plain, _ = run(e, prompt, 0.8, 64, spec=spec())
        if not cached:
            e.reset()
        adaptive = spec(("ngram-simple",), ngram_size_n=3, ngram_size_m=12, adaptive=True)
        got, st = run(e, prompt, 0.8, 64, spec=adaptive)
        assert got == plain and {1, 2, 4, 8, 13} <= set(e.pass_cost.sums)   # the probe: 1, 2, 4, 8, size-m + 1


def test_hybrid_mtp_with_ngrams_keeps_ngram_drafts_within_the_snapshots(mtp_models):
    """With a drafter that reads the target's rows (MTP), a hybrid model takes no checkpoints: every
    draft, n-gram ones too, stays within its snapshots (--spec-draft-n-max), and nothing is restored."""
    both = spec(("ngram-simple", "draft-mtp"), 3, ngram_size_n=3, ngram_size_m=12)
    with Engine(str(mtp_models["random"]), EngineParams(n_ctx=2048, spec=both)) as e:
        assert e.ctx.params.n_rs_seq == 3
        prompt = e.tokenize(HYBRID_PROMPT)
        plain, _ = run(e, prompt, 0.0, 96, spec=spec())
        got, st = run(e, prompt, 0.0, 96)
        assert got == plain and st.n_restores == 0 and st.drafters[0].n_gen_tokens > 0
        assert 0 < len(st.drafters[0].acc_per_pos) <= 3          # its longest draft


def test_hybrid_drafters_that_read_the_old_context_are_refused_a_deeper_one(mtp_models):
    from specrun.gguf_spec.errors import SpecrunError

    with Engine(str(mtp_models["exact"]), EngineParams(n_ctx=1024, spec=spec(("draft-mtp",), 3))) as e:
        prompt = e.tokenize("Hello world, this is a test.")
        with pytest.raises(SpecrunError, match="need 8 tokens of rollback and the target context keeps 3"):
            run(e, prompt, 0.0, spec=spec(("draft-mtp",), 8), drafters=e.drafters)
        assert run(e, prompt, 0.0, spec=spec(("draft-mtp",), 3), drafters=e.drafters)[1].n_drafted > 0


def test_draft_mtp_without_heads_is_refused(smollm_path):
    from specrun.gguf_spec.errors import SpecrunError

    with pytest.raises(SpecrunError, match="no MTP heads.*specrun inspect"):
        Engine(str(smollm_path), EngineParams(spec=spec(("draft-mtp",))))
