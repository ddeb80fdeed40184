"""draft-eagle3: EAGLE-3 drafts over llama.cpp (issue 15, items 1, 2 and 5).

The test models are the tiny synthetic pair of gguf_spec.testmodel_eagle3 (a 4-layer llama
bigram target, n_embd 256, and its eagle3 draft), q8_0 so that exact mode is bit-exact. Exactness
is checked against a separate engine without the draft (the target's layer-input export is off
there), greedy and seeded at temperature 0.8, before and past 256 tokens of context, through both
branches: the exact head (everything accepted, computed by llama.cpp), a noisy head (partial
acceptance), a random head and a shifted, always-wrong drafter (everything rejected).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import gguf
import numpy as np
import pytest
from click.testing import CliRunner
from drafters import ShiftedDraft

from specrun.cli.main import cli
from specrun.gguf_spec.compat import check_eagle3_compatible, eagle3_problem
from specrun.gguf_spec.errors import IncompatibleDraft, SpecrunError
from specrun.gguf_spec.spec import load_spec
from specrun.gguf_spec.testmodel import Head, SynthConfig, SynthConfigError
from specrun.gguf_spec.testmodel_eagle3 import TINY, Eagle3Config, bigram_map, draft_tokens, write_eagle3_pair
from specrun.kernels.drafters import DraftEagle3
from specrun.kernels.drafters.draft_eagle3 import FOLD_ROWS
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.prefill import fast_len
from specrun.kernels.prefill_worker import PrefillWorker
from specrun.kernels.types import SamplingParams

N_GEN = 40
SEED = 1234
PROMPTS = {"short": "Hello world, this is a test.", "long": "the quick brown fox jumps over the lazy dog " * 12}


def pair(d: Path, name: str, cfg: Eagle3Config = TINY, dtype: str = "q8_0") -> tuple[Path, Path]:
    return write_eagle3_pair(d / f"{name}-target.gguf", d / f"{name}-eagle3.gguf", cfg, dtype)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """The tiny pair with each head (one target: the heads share the seed), and a d2t variant."""
    d = tmp_path_factory.mktemp("eagle3")
    out = {h: pair(d, h.replace(":", ""), replace(TINY, head=Head.parse(h))) for h in ("exact", "noisy:0.2", "random")}
    out["d2t"] = pair(d, "d2t", replace(TINY, draft_vocab=64))
    out["deep"] = pair(d, "deep", replace(TINY, n_layer=8))               # extract layers 1, 4, 7
    out["wide"] = pair(d, "wide", replace(TINY, n_embd=320, n_ff=512))    # n_embd 320
    return out


# ---- the files: writer, reader, compatibility (no model runs) --------------------------------


def test_writer_is_deterministic_and_targets_share_the_trunk(tmp_path, models):
    a = pair(tmp_path, "a")
    assert [hashlib.sha256(p.read_bytes()).digest() for p in a] == \
        [hashlib.sha256(p.read_bytes()).digest() for p in models["exact"]]
    heads = [{t.name: bytes(t.data) for t in gguf.GGUFReader(models[h][0]).tensors} for h in ("exact", "random")]
    assert heads[0] == heads[1]


def test_reader_reports_the_eagle3_keys(models):
    e = load_spec(models["exact"][1]).eagle3
    assert e is not None and e.target_layers == (1, 2, 3) and e.target_hidden_size == 256 and e.n_embd == 256
    assert e.n_layer == 1 and e.draft_vocab is None and not e.own_output and not e.own_token_embd
    e = load_spec(models["d2t"][1]).eagle3
    assert e.draft_vocab == 64 and e.own_output and e.d2t_max == int(draft_tokens(replace(TINY, draft_vocab=64))[-1])
    assert load_spec(models["exact"][0]).eagle3 is None


def test_bigram_map_never_ends_and_stays_in_the_draft_vocab():
    f = bigram_map(TINY)
    assert f.max() < TINY.n_vocab - 1
    cfg = replace(TINY, draft_vocab=64)
    assert set(bigram_map(cfg).tolist()) <= set(draft_tokens(cfg).tolist())


@pytest.mark.parametrize("kwargs, words", [
    ({"n_layer": 3}, r"target layers must be >= 4"),
    ({"n_embd": 100}, "not a positive multiple of the head size 64"),
    ({"n_ff": 256}, "n_ff 256 is below the vocab 512"),
    ({"draft_vocab": 512}, r"draft vocab 512 is out of range \[2, 511\]"),
])
def test_config_rejects(kwargs, words):
    with pytest.raises(SynthConfigError, match=words):
        Eagle3Config(**kwargs)


def test_compatibility_names_both_numbers(models):
    target = load_spec(models["exact"][0])
    assert check_eagle3_compatible(target, load_spec(models["exact"][1])).ok
    deep = check_eagle3_compatible(target, load_spec(models["deep"][1]))
    assert not deep.ok and "extract layers [1, 4, 7] do not fit the target's 4 layers (0..3)" in deep.reason
    wide = check_eagle3_compatible(target, load_spec(models["wide"][1]))
    assert "the draft reads target rows of width 320 but the target's n_embd is 256" in wide.reason
    assert "the draft's n_embd 320 differs from the target's n_embd 256" in wide.reason


def test_other_files_are_not_eagle3_drafts(tmp_path, models):
    from conftest import write_gguf

    from specrun.gguf_spec.testmodel import write_test_model

    heads = load_spec(write_gguf(tmp_path / "heads.gguf", arch="qwen35", n_layer=2, nextn=1))
    assert eagle3_problem(heads).startswith("it holds MTP heads (architecture qwen35), not an EAGLE-3 draft; "
                                            "use --spec-type draft-mtp -md heads.gguf")
    assert eagle3_problem(load_spec(models["exact"][0])).startswith("it is a llama model, not an EAGLE-3 draft")
    qwen35 = load_spec(write_test_model(tmp_path / "q.gguf", SynthConfig(), "f16"))
    c = check_eagle3_compatible(qwen35, load_spec(models["exact"][1]))
    assert "llama.cpp exports no layer inputs of a qwen35 target" in c.reason


# ---- the drafter through the engine ------------------------------------------------------------


def spec(n_max: int = 3, verify: str = "match") -> SpecParams:
    return SpecParams(types=("draft-eagle3",), n_max=n_max, verify=verify)


def run(e: Engine, prompt, temp: float, sp: SpecParams, **kw):
    gen = e.generate(prompt, N_GEN, SamplingParams(temp=temp, seed=SEED), spec=sp, **kw)
    return [t for ts in gen for t in ts], gen.stats


# one thread: the tiny models decode in about 1 ms, and two threads on a shared 2-core machine spin
PARAMS = EngineParams(n_ctx=1024, n_threads=1)


@pytest.fixture(scope="module")
def plain(models):
    """plain(head) -> (prompt tokens, reference outputs by (prompt, temp)) of that pair's target
    alone (no layer-input export); cached."""
    cache: dict[Path, tuple] = {}

    def get(head: str) -> tuple[dict, dict]:
        path = models[head][0]
        if path not in cache:
            with Engine(str(path), PARAMS) as e:
                toks = {k: e.tokenize(v) for k, v in PROMPTS.items()}
                assert len(toks["short"]) < 256 < len(toks["long"])
                cache[path] = toks, {(k, t): run(e, p, t, SpecParams())[0] for k, p in toks.items() for t in (0.0, 0.8)}
        return cache[path]

    return get


def eagle3_engine(models, head: str) -> Engine:
    t, d = models[head]
    return Engine(str(t), replace(PARAMS, draft_model=str(d), spec=spec()))


@pytest.mark.slow
@pytest.mark.parametrize("head", ["exact", "noisy:0.2", "random", "d2t"])
def test_draft_eagle3_equals_plain(models, plain, head):
    toks, ref = plain(head)
    with eagle3_engine(models, head) as e:
        assert e.fast is not None    # long prompts: the fast path, as plain decoding's (rows from it too)
        for name, prompt in toks.items():
            for temp in (0.0, 0.8):
                for n_max in (1, 3, 8):
                    got, st = run(e, prompt, temp, spec(n_max))
                    assert got == ref[(name, temp)], (head, name, temp, n_max)
                    assert st.n_drafted > 0
                    if temp == 0.0 and head in ("exact", "d2t"):
                        assert st.n_accepted == st.n_drafted, (name, n_max)
                    if temp == 0.0 and head == "noisy:0.2" and n_max > 1:
                        assert 0 < st.n_accepted < st.n_drafted, (name, n_max)   # partial acceptance
                    if temp == 0.0 and head == "random":
                        assert st.acceptance_rate < 0.2, (name, n_max)


@pytest.mark.slow
def test_the_exact_head_holds_for_exact_modes_longest_chain(models, plain):
    """Exact means every greedy draft accepted at any n-max, not only at short ones: the draft is
    written in f16 beside the q8_0 target (a q8_0 draft's rounding, carried in its residual from
    step to step, drafted a wrong token after 16-20 steps: 81 % acceptance at n-max 62)."""
    toks, ref = plain("exact")
    assert {t.tensor_type.name for t in gguf.GGUFReader(models["exact"][1]).tensors if t.name == "fc.weight"} == {"F16"}
    t, d = models["exact"]
    with Engine(str(t), replace(PARAMS, draft_model=str(d), spec=spec(62))) as e:
        assert e.n_max_cap == 62
        gen = e.generate(toks["long"], 160, SamplingParams(temp=0.0), spec=spec(62))
        got = [t for ts in gen for t in ts]
    assert gen.stats.n_accepted == gen.stats.n_drafted > 150
    assert got[:N_GEN] == ref[("long", 0.0)]


@pytest.mark.slow
def test_long_prompts_equal_plain_where_attention_counts(models, tmp_path):
    """Prompts of 256+ tokens take the fast prompt path in plain decoding; with an EAGLE-3 draft
    they used to be evaluated by the exact context alone, whose KV rows differ from the fast
    context's: on a target whose attention counts (random attn_output, not the bigram's zeros) the
    texts then differed. The target now takes the fast state, as plain decoding does (and the
    draft its rows from the fast context)."""
    from conftest import rewrite_gguf

    t, d = models["exact"]
    rng = np.random.default_rng(0)
    q8 = gguf.GGMLQuantizationType.Q8_0
    attn = {f"blk.{il}.attn_output.weight":
            gguf.quants.quantize(rng.normal(0, 3 / np.sqrt(256), (256, 256)).astype(np.float32), q8)
            for il in range(TINY.n_layer)}
    target = rewrite_gguf(t, tmp_path / "attn-target.gguf", tensors=attn)
    prompt = np.random.default_rng(1).integers(0, 500, 300).astype(np.int32)
    with Engine(str(target), PARAMS) as e:
        assert e.fast is not None
        ref = {temp: run(e, prompt, temp, SpecParams())[0] for temp in (0.0, 0.8)}
    with Engine(str(target), replace(PARAMS, draft_model=str(d), spec=spec())) as e:
        for temp in (0.0, 0.8):
            got, st = run(e, prompt, temp, spec(4))
            assert got == ref[temp] and st.n_prompt_fast > 0 and st.n_drafted > 0, temp
        got, st = run(e, prompt, 0.0, spec(4))                      # the same prompt again: reused
        assert got == ref[0.0] and st.n_prompt < 300 == st.n_prompt_total


@pytest.mark.slow
@pytest.mark.parametrize("worker", [False, True])
def test_long_prompts_are_evaluated_once(models, plain, worker):
    """The fast context, in this process or in the prompt worker, hands the draft its rows of a
    256+-token prompt while it evaluates it (the exact context evaluated the prompt a second time
    for them): the exact context decodes none of it, the exact head accepts every greedy draft
    after it, and the text is plain decoding's. The same prompt again evaluates only its tail.
    With the worker shared by a second engine, whose draft has seen nothing while the worker
    holds the prompt's blocks, the blocks are evaluated again for its rows."""
    toks, ref = plain("exact")
    t, d = models["exact"]
    params = replace(PARAMS, draft_model=str(d), spec=spec(), prefill_worker=worker)

    def once(e: Engine) -> tuple[list[int], int]:
        fed = []
        decode_chunks = e.ctx.decode_chunks
        e.ctx.decode_chunks = lambda tokens, *a, **k: fed.append(len(tokens)) or decode_chunks(tokens, *a, **k)
        try:
            got, st = run(e, toks["long"], 0.0, spec(8))
        finally:
            del e.ctx.decode_chunks
        assert got == ref[("long", 0.0)] and sum(fed) == 0, fed
        assert st.n_accepted == st.n_drafted > 0 and st.n_prompt == st.n_prompt_fast
        return got, st.n_prompt

    with Engine(str(t), params) as e:
        assert isinstance(e.fast, PrefillWorker) == worker
        n = len(toks["long"])
        assert once(e)[1] == n
        assert once(e)[1] == n - fast_len(n)              # the tail again, for the draft's last row
        if worker:
            with Engine(str(t), params, prefill=e.share_prefill()) as e2:
                assert once(e2)[1] == n


@pytest.mark.slow
def test_always_wrong_drafter_equals_plain(models, plain):
    toks, ref = plain("exact")
    with eagle3_engine(models, "exact") as e:
        wrong = ShiftedDraft(e.drafters[0], e.model.n_vocab)
        for temp in (0.0, 0.8):
            got, st = run(e, toks["long"], temp, spec(3), drafters=[wrong])
            assert got == ref[("long", temp)] and st.n_drafted > 0
            if temp == 0.0:
                assert st.n_accepted == 0
        got, st = run(e, toks["long"], 0.0, spec(3))        # the real drafter still follows the target
        assert got == ref[("long", 0.0)] and st.n_accepted == st.n_drafted


@pytest.mark.slow
def test_behind_an_ngram_drafter_it_catches_up(models, plain):
    """Passes the n-gram drafter drafts for are not the EAGLE-3 draft's: it sees them only through
    accept(), and writes their decoder rows with its next boundary row, in one batch of several rows
    (llama.cpp's eagle3 graph hands back its first rows: the boundary's logits are the last row)."""
    toks, ref = plain("exact")
    with eagle3_engine(models, "exact") as e:
        sp = SpecParams(types=("ngram-simple", "draft-eagle3"), n_max=3, ngram_size_n=2, ngram_size_m=4)
        for name in ("short", "long"):
            got, st = run(e, toks[name], 0.0, sp)
            assert got == ref[(name, 0.0)], name
            ngram, eagle3 = st.drafters
            assert ngram.n_gen_drafts > 0 and eagle3.n_gen_drafts > 0, (name, ngram, eagle3)
            assert eagle3.n_acc_tokens == eagle3.n_gen_tokens, name     # the exact head, caught up


@pytest.mark.slow
def test_draft_kv_equals_a_fresh_drafts(models):
    """After generations that reuse, cut and skip its rows (a new prompt, one that differs in
    a single token, partial accepts, passes an n-gram drafter drafted), the draft's KV holds what a fresh draft fed the same text in one
    prompt holds: its next logits are bit-identical. The noisy head's attention reads that KV a
    little (its noise is on attn_output too); the exact head's adds nothing, so the acceptance
    checks above cannot show a stale row."""
    def next_logits(d, text: list[int]) -> np.ndarray:
        assert d.toks == text[:-1]
        assert len(d.propose(np.asarray(text, dtype=np.int32), 2)) == 2   # the second step: chained
        return d.ctx.logits_rows()[-1].copy()

    sp = SpecParams(types=("ngram-simple", "draft-eagle3"), n_max=3, ngram_size_n=2, ngram_size_m=4)
    with eagle3_engine(models, "noisy:0.2") as a, eagle3_engine(models, "noisy:0.2") as b:
        short, long = (a.tokenize(PROMPTS[k]) for k in ("short", "long"))
        run(a, short, 0.0, spec())
        run(a, np.concatenate([short, long]), 0.0, sp)
        _, st = run(a, long, 0.0, sp)
        assert st.drafters[0].n_gen_drafts > 0 and 0 < st.drafters[1].n_acc_tokens < st.drafters[1].n_gen_tokens
        other = long.copy()
        other[1] = (other[1] + 1) % a.model.n_vocab   # the same tokens after it, with other features
        run(a, other, 0.0, sp)
        d = a.drafters_for(sp)[1]
        text = [*d.toks, 7]
        list(b.generate(d.toks, 1, SamplingParams(temp=0.0), spec=spec()))   # b's draft: the text as one prompt
        bd, calls = b.drafters[0], []
        write = bd.ctx.decode_with_hidden
        bd.ctx.decode_with_hidden = lambda t, p, h, logits: (calls.append((len(t), logits)), write(t, p, h, logits))
        assert np.array_equal(next_logits(d, text), next_logits(bd, text))
        # b wrote the whole text at once: the rows before the last FOLD_ROWS without outputs
        assert calls[-1] == (FOLD_ROWS, "all") and {lg for _, lg in calls[:-1]} == {"none"}
        assert sum(n for n, _ in calls) == len(text) - 1


@pytest.mark.slow
def test_conversation_reuse_and_rejection_sampling(models, plain):
    """A prompt that extends the cached one reuses the KV of both the target and the draft; at
    temperature 0.8 with verify auto the draft's distribution feeds rejection sampling."""
    toks, _ = plain("exact")
    with eagle3_engine(models, "exact") as e:
        got, _ = run(e, toks["short"], 0.0, spec())
        longer = np.concatenate([toks["short"], np.asarray(got, dtype=np.int32), toks["short"]])
        again, st = run(e, longer, 0.0, spec())
        assert st.n_prompt < len(longer) and st.n_accepted == st.n_drafted
        with Engine(str(models["exact"][0]), PARAMS) as p:
            assert again == run(p, longer, 0.0, SpecParams())[0]
        out, st = run(e, toks["short"], 0.8, spec(3, verify="auto"))
        assert st.verify == "rejection" and st.n_accepted > 0 and len(out) == N_GEN


@pytest.mark.slow
def test_drafter_refuses_what_llama_cpp_would_abort_on(models):
    t, _ = models["exact"]
    with Engine(str(t), PARAMS) as e:
        with pytest.raises(IncompatibleDraft, match=r"extract layers \[1, 4, 7\] do not fit the target's 4 layers"):
            DraftEagle3(e.target, str(models["deep"][1]))
        with pytest.raises(IncompatibleDraft, match="n_embd is 256"):
            DraftEagle3(e.target, str(models["wide"][1]))
        with pytest.raises(IncompatibleDraft, match="it is a llama model, not an EAGLE-3 draft"):
            DraftEagle3(e.target, str(t))
    with pytest.raises(SpecrunError, match="draft-eagle3 needs an EAGLE-3 draft: add -md EAGLE3.gguf"):
        Engine(str(t), replace(PARAMS, spec=spec()))


# ---- the CLI: run, inspect, make-test-model, auto -----------------------------------------------


def cli_run(*args: str, input=None):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def one_error_line(r, text: str) -> None:
    assert r.exit_code == 1 and "Traceback" not in r.output, (r.exit_code, r.output)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines == [f"Error: {text}"], r.stderr
    assert r.stdout == ""


@pytest.mark.slow
def test_run_with_md_infers_draft_eagle3_and_equals_none(models):
    t, d = (str(p) for p in models["exact"])
    args = ["-m", t, "-p", "Hello world", "-n", "24", "--temp", "0", "-t", "1"]
    none = cli_run(*args, "--spec-type", "none")
    r = cli_run(*args, "-md", d)
    assert r.exit_code == 0 and none.exit_code == 0, r.output
    assert r.stdout == none.stdout
    assert r.stderr.startswith(f"spec type: draft-eagle3, inferred from -md {Path(d).name} (an EAGLE-3 draft)")
    assert "draft acceptance rate = 1.00000" in r.stderr and "statistics draft-eagle3:" in r.stderr


@pytest.mark.slow
def test_bad_input_is_one_line_exit_1(models, tmp_path):
    from conftest import write_gguf

    t, d = (str(p) for p in models["exact"])
    heads = write_gguf(tmp_path / "heads.gguf", arch="qwen35", n_layer=2, nextn=1)
    base = ["-m", t, "-p", "hi", "-n", "4", "-t", "1"]
    one_error_line(cli_run(*base, "-md", d, "--spec-type", "draft"),
                   f"-md {Path(d).name} is an EAGLE-3 draft (architecture eagle3), not a draft model; "
                   "use --spec-type draft-eagle3")
    one_error_line(cli_run(*base, "-md", str(heads), "--spec-type", "draft-eagle3"),
                   "-md heads.gguf cannot be used with --spec-type draft-eagle3: it holds MTP heads (architecture "
                   "qwen35), not an EAGLE-3 draft; use --spec-type draft-mtp -md heads.gguf")
    one_error_line(cli_run(*base, "--spec-type", "draft-eagle3"),
                   "--spec-type draft-eagle3 needs an EAGLE-3 draft: add -md EAGLE3.gguf (converted for this model)")
    one_error_line(cli_run(*base, "-md", str(models["deep"][1])),
                   "EAGLE-3 draft deep-eagle3.gguf cannot draft for exact-target.gguf: extract layers [1, 4, 7] "
                   "do not fit the target's 4 layers (0..3): the draft was made for a deeper model; use the EAGLE-3 "
                   "draft made for this model")
    r = cli_run(*base, "-md", str(models["wide"][1]), "--spec-type", "draft-eagle3")
    one_error_line(r, "EAGLE-3 draft wide-eagle3.gguf cannot draft for exact-target.gguf: the draft reads target rows "
                      "of width 320 but the target's n_embd is 256; the draft's n_embd 320 differs from the target's "
                      "n_embd 256, and it borrows the target's token embeddings; use the EAGLE-3 draft made for this "
                      "model")
    one_error_line(cli_run("-m", d, "-p", "hi"),
                   f"{d} is an EAGLE-3 draft, so it cannot be the main model; use it as -md {Path(d).name} "
                   "--spec-type draft-eagle3 beside the model it was made for")


def test_inspect_reports_the_draft_and_the_spec_types(models):
    t, d = (str(p) for p in models["d2t"])
    r = cli_run("inspect", d)
    assert r.exit_code == 0, r.output
    for words in ("EAGLE-3 draft", "extract layers", "1, 2, 3 (low, mid, high", "target hidden size",
                  "256 (fc: 3 x that -> 256)", "64 tokens, mapped to target ids by d2t",
                  "spec types: none of its own; an EAGLE-3 draft runs beside the model it was made for"):
        assert words in r.stdout, words
    js = json.loads(cli_run("inspect", d, "--json").stdout)
    assert js["eagle3"]["target_layers"] == [1, 2, 3] and js["eagle3"]["target_hidden_size"] == 256
    assert js["eagle3"]["draft_vocab"] == 64 and js["spec_types"] == []
    r = cli_run("inspect", t, "-md", d)
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("spec types: ")]
    assert line.startswith("spec types: none, ngram-simple") and line.endswith(", draft-eagle3 (with -md d2t-eagle3.gguf)")
    assert r.stdout.rstrip().splitlines()[-1] == "draft d2t-eagle3.gguf: compatible with d2t-target.gguf"
    r = cli_run("inspect", t, "-md", str(models["deep"][1]), "--json")
    js = json.loads(r.stdout)
    assert js["spec_types"][:2] == ["none", "ngram-simple"] and not js["draft"]["compatible"]
    assert "draft-eagle3" not in js["spec_types"]
    assert "extract layers [1, 4, 7] do not fit the target's 4 layers" in js["draft"]["reason"]
    assert "draft-eagle3" not in json.loads(cli_run("inspect", t, "--json").stdout)["spec_types"]


@pytest.mark.slow
def test_make_test_model_eagle3_checks_with_llama_cpp(tmp_path):
    t, d = tmp_path / "t.gguf", tmp_path / "d.gguf"
    r = cli_run("make-test-model", str(t), "--eagle3", str(d), "--shape", "tiny", "--quant", "q8_0", "--check",
                "-t", "1")
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    assert "llama q8_0, 4 layers" in r.stderr and "eagle3 f16, extract layers 1, 2, 3" in r.stderr
    assert "greedy EAGLE-3 acceptance: 100.0% (" in r.stderr and "at n-max 62)" in r.stderr
    assert "output equals --spec-type none" in r.stderr
    assert t.read_bytes() == (tmp_path / "t.gguf").read_bytes()
    r = cli_run("make-test-model", str(t), "--eagle3", str(d), "--quant", "q4_k_m")
    assert r.exit_code == 1 and "the EAGLE-3 test models are written as f32, f16, q8_0, not 'q4_k_m'" in r.stderr
    r = cli_run("make-test-model", str(t), "--draft-vocab", "8")
    assert r.exit_code == 2 and "--draft-vocab goes with --eagle3 DRAFT.gguf" in r.stderr


@pytest.mark.slow
def test_auto_calibrates_draft_eagle3_too(models):
    from specrun.cli.runtime.auto import auto_candidates
    from specrun.cli.runtime.loading import prepare

    t, d = (str(p) for p in models["exact"])
    path, params = prepare(t, replace(PARAMS, draft_model=d, spec=SpecParams(types=("auto",))))
    assert params.spec.types[-1] == "draft-eagle3" and "ngram-simple" in params.spec.types
    with Engine(str(path), params) as e:
        cands = auto_candidates(e, params.spec)
        assert [c.n_max for c in cands if c.types == ("draft-eagle3",)] == [1, 2, 3, 4, 6, 8]
        r = cli_run("-m", t, "-md", d, "--spec-type", "auto", "-p", "Hello", "-n", "8", "--temp", "0", "-t", "1")
        assert r.exit_code == 0 and "spec auto: " in r.stderr, r.output
