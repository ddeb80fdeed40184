"""The model drafters' greedy draft loop in C (kernels/_draftloop.c, Context.draft_chain) drafts
what the same loop in Python drafts (kernels/drafters/base.py draft_steps), token for token, on
real llama.cpp passes: draft-mtp and draft-eagle3 (chained rows, noisy heads: partial acceptance)
and draft-simple (SmolLM2 drafting for itself: plain token rows). The two loops run interleaved on
one engine, with the C module taken away for the Python one, and must give the same drafts pass by
pass and the same text, which is plain decoding's.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

import specrun.kernels.llama as llama
from specrun.gguf_spec.testmodel import Head, SynthConfig
from specrun.gguf_spec.testmodel_eagle3 import TINY, write_eagle3_pair
from specrun.kernels.engine import Engine
from specrun.kernels.llama import Context, ContextParams, LlamaError, Model
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.testmodel import build_test_model
from specrun.kernels.types import SamplingParams

N_GEN = 48
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


@pytest.fixture(scope="module")
def engines(tmp_path_factory, smollm_path):
    """kind -> (target path, EngineParams): a noisy MTP head, a noisy EAGLE-3 head (tiny pair),
    SmolLM2 as its own draft model."""
    d = tmp_path_factory.mktemp("draftloop")
    mtp = build_test_model(d / "mtp.gguf", SynthConfig(head=Head.parse("noisy:0.3")), "q8_0")
    target, eagle3 = write_eagle3_pair(d / "e3-target.gguf", d / "e3-draft.gguf",
                                       replace(TINY, head=Head.parse("noisy:0.2")), "q8_0")
    base = EngineParams(n_ctx=1024, n_threads=1)
    return {"draft-mtp": (str(mtp), base),
            "draft-eagle3": (str(target), replace(base, draft_model=str(eagle3))),
            "draft-simple": (str(smollm_path), replace(base, draft_model=str(smollm_path)))}


def test_the_c_loop_is_built():
    """`make install` (pip install -e .) compiles it; where it is missing, drafts run in Python."""
    assert llama._draftloop is not None


@pytest.mark.parametrize("kind", ["draft-mtp", "draft-eagle3", pytest.param("draft-simple", marks=pytest.mark.full)])
def test_c_loop_drafts_what_the_python_loop_drafts(engines, kind, monkeypatch):
    path, params = engines[kind]
    sp = SpecParams(types=(kind,), n_max=6, verify="match")
    real, calls = llama._draftloop, []
    spy = SimpleNamespace(chain=lambda *a: (calls.append(a[7]), real.chain(*a))[1])
    with Engine(path, replace(params, spec=sp)) as e:
        prompt = e.tokenize(PROMPT)
        plain = [t for ts in e.generate(prompt, N_GEN, SamplingParams(temp=0.0), spec=SpecParams()) for t in ts]
        drafter = e.drafters[0]
        propose, drafts = drafter.propose, []
        drafter.propose = lambda ctx, n_max: (d := propose(ctx, n_max), drafts.append(d.tokens.tolist()))[0]
        got = {}
        for loop in ("c", "python", "c", "python"):
            monkeypatch.setattr(llama, "_draftloop", spy if loop == "c" else None)
            n_calls = len(calls)
            drafts.clear()
            gen = e.generate(prompt, N_GEN, SamplingParams(temp=0.0), spec=sp)
            text = [t for ts in gen for t in ts]
            assert text == plain, (kind, loop)
            assert (len(calls) > n_calls) == (loop == "c")       # the loop under test ran
            seen = (list(drafts), gen.stats.n_drafted, gen.stats.n_accepted)
            assert got.setdefault(loop, seen) == seen                # the same again, after the other loop
    assert got["c"] == got["python"]
    proposals, n_drafted, n_accepted = got["c"]
    assert max(len(d) for d in proposals) == 6                       # steps that decode
    # drafted: the proposals' tokens the target verified (none past an end-of-generation token)
    if kind == "draft-simple":     # the target drafting for itself
        assert n_accepted == n_drafted > 0
    else:                          # the noisy heads: partial acceptance
        assert 0 < n_accepted < n_drafted


@pytest.mark.parametrize("opts", [{"p_min": 0.3}, {"temp": 0.8, "verify": "rejection"}])
def test_p_min_and_sampled_drafts_stay_in_python(engines, opts):
    """The C loop drafts greedy tokens without p_min only (kernels/_draftloop.c says why); drafts
    sampled from the drafter's distribution (rejection sampling) are Python's."""
    path, params = engines["draft-mtp"]
    sp = SpecParams(types=("draft-mtp",), n_max=6, p_min=opts.get("p_min", 0.0), verify=opts.get("verify", "match"))
    with Engine(path, replace(params, spec=sp)) as e:
        calls = []
        e.drafters[0].ctx.draft_chain = lambda *a, **k: calls.append(a)
        gen = e.generate(e.tokenize(PROMPT), N_GEN, SamplingParams(temp=opts.get("temp", 0.0), seed=1), spec=sp)
        assert sum(len(ts) for ts in gen) == N_GEN and gen.stats.n_drafted > 0 and not calls


def test_a_missing_hidden_row_is_an_error_not_a_crash(smollm_path):
    """A chained step on a context that exports no hidden rows: llama.cpp returns NULL (and logs),
    the loop stops and Python raises, after the first step's token was drafted."""
    with Model(str(smollm_path)) as m, Context(m, ContextParams(n_ctx=256, n_threads=1)) as ctx:
        ctx.decode(np.asarray(m.tokenize("Hello"), dtype=np.int32), 0, "last")
        with pytest.raises(LlamaError, match="draft step 1 .*no hidden row"):
            ctx.draft_chain(0, 3, m.n_vocab, chained=True)
        first = ctx.draft_chain(0, 1, m.n_vocab, chained=True)       # one step decodes nothing
        assert first.tolist() == [int(np.argmax(ctx.logits_rows()[-1]))]
