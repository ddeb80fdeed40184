"""The library entry point (kernels/api.py) on a real model: speculative output equals plain output
and the CLI's, stream() joins to generate(), and a bad spec type is one line naming the fix."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specrun.cli.main import cli
from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels import api

pytestmark = pytest.mark.slow

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n" * 3
N = 24


@pytest.fixture(scope="module")
def plain(smollm_path):
    with api.load(smollm_path, n_ctx=512) as m:
        yield m


@pytest.fixture(scope="module")
def spec(smollm_path):
    with api.load("smollm2-135m-instruct", spec_type="ngram-simple", ngram_size_n=2, ngram_size_m=8,
                  verify="match", n_ctx=512) as m:
        yield m


def test_greedy_spec_equals_plain_and_the_cli(spec, plain, smollm_path):
    a = spec.generate(PROMPT, n_predict=N, temp=0)
    b = plain.generate(PROMPT, n_predict=N, temp=0)
    assert a.stats.n_drafted > 0 and a.stats.n_accepted > 0     # the drafter drafted, and was right
    assert (a.text, a.tokens, a.stop) == (b.text, b.tokens, b.stop)
    assert a.stop == "n_predict" and len(a.tokens) == a.stats.n_gen == N
    r = CliRunner().invoke(cli, ["-m", str(smollm_path), "-p", PROMPT, "-n", str(N), "--temp", "0", "-c", "512", "-no-cnv",
                                 "--no-escape", "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["text"], tuple(d["tokens"]), d["stop"]) == (a.text, a.tokens, a.stop)


def test_stream_joins_to_generate_and_token_ids_equal_text(spec):
    whole = spec.generate(PROMPT, n_predict=N, temp=0)
    s = spec.stream(PROMPT, n_predict=N, temp=0)
    pieces = list(s)
    assert "".join(pieces) == whole.text and len(pieces) > 1
    assert (s.result.text, s.result.tokens, s.result.stop) == (whole.text, whole.tokens, whole.stop)
    ids = spec.generate(spec.tokenize(PROMPT), n_predict=N, temp=0)
    assert ids.tokens == whole.tokens


def test_closing_a_stream_early_keeps_what_was_written(spec):
    whole = spec.generate(PROMPT, n_predict=N, temp=0)
    with spec.stream(PROMPT, n_predict=N, temp=0) as s:
        first = next(s)
    assert s.result.stop == "interrupted"
    assert s.result.text.startswith(first) and whole.text.startswith(s.result.text)
    assert whole.tokens[:len(s.result.tokens)] == s.result.tokens
    unread = spec.stream(PROMPT, n_predict=N, temp=0)
    unread.close()
    assert (unread.result.text, unread.result.tokens, unread.result.stop) == ("", (), "interrupted")
    assert spec.generate(PROMPT, n_predict=N, temp=0).tokens == whole.tokens



def test_seeded_sampling_with_spec_equals_without(spec, plain):
    for seed in (1, 7):
        a = spec.generate(PROMPT, n_predict=N, temp=0.8, seed=seed)
        b = plain.generate(PROMPT, n_predict=N, temp=0.8, seed=seed)
        assert (a.text, a.tokens) == (b.text, b.tokens)
        assert a.stats.seed == b.stats.seed == seed


@pytest.mark.parametrize(("kw", "error", "words"), [
    ({"spec_type": "auto"}, api.SpecTypeError, "spec_type='ngram-simple'"),
    ({"spec_type": ("ngram-simple", "auto")}, api.SpecTypeError, "--spec-type auto"),
    ({"spec_type": "ngram-simple,eagle9"}, api.SpecTypeError, "unknown spec type 'eagle9'; valid types:"),
    ({"spec_type": "draft"}, api.SpecTypeError, "needs a draft model: add draft_model=DRAFT.gguf"),
    ({"spec_type": "ngram-simple", "ngram_sise_n": 3}, api.SettingError, "unknown spec setting 'ngram_sise_n'"),
    ({"spec_type": "ngram-simple", "verify": "greedy"}, api.SettingError, "use 'auto', 'match' or 'rejection'"),
])
def test_a_bad_spec_is_one_line_naming_the_fix(smollm_path, kw, error, words):
    with pytest.raises(error) as e:
        api.load(smollm_path, **kw)
    assert isinstance(e.value, SpecrunError)
    assert "\n" not in str(e.value) and words in str(e.value)


def test_an_unused_draft_model_is_refused(smollm_path):
    with pytest.raises(api.SpecTypeError, match=r"is not used by spec_type ngram-simple; add 'draft' \(a draft model\)"):
        api.load(smollm_path, spec_type="ngram-simple", draft_model=smollm_path)


def test_a_bad_sampling_setting_is_one_line(plain):
    with pytest.raises(api.SettingError, match=r"^unknown sampling setting 'temperature'; use one of temp"):
        plain.generate("x", n_predict=1, temperature=0)
    with pytest.raises(api.SettingError, match=r"^top_p 1.5: give a number from 0 to 1$"):
        plain.generate("x", n_predict=1, top_p=1.5)
