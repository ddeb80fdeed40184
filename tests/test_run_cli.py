"""The one-shot CLI: flags, streamed text on stdout, statistics on stderr, --json, and every
error as one line with exit 1."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from specrun.cli.main import cli

pytestmark = pytest.mark.slow

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


def invoke(*args, input=None):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def one_error_line(result, pattern: str) -> None:
    assert result.exit_code == 1, (result.exit_code, result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, result.stderr
    assert re.search(pattern, lines[0]), lines[0]
    assert result.stdout == ""


def test_bare_flags_run_the_default_command_and_json_matches_text(smollm_path):
    args = ["-m", str(smollm_path), "-p", PROMPT, "-n", "24", "--temp", "0", "-c", "512", "-no-cnv"]
    text = invoke(*args)
    assert text.exit_code == 0, text.stderr
    js = invoke(*args, "--json")
    assert js.exit_code == 0
    d = json.loads(js.stdout)
    assert text.stdout == d["text"] + "\n"
    assert len(d["tokens"]) == d["stats"]["n_gen"] <= 24
    assert d["stats"]["exact"] is True
    assert "prompt eval:" in text.stderr and "generation:" in text.stderr
    assert "tokens/s" in text.stderr


def test_ngram_statistics_in_llamacpp_words_and_same_text(smollm_path):
    base = ["-m", str(smollm_path), "-p", PROMPT * 3, "-n", "32", "--temp", "0", "-c", "512", "-no-cnv"]
    plain = invoke(*base, "--json")
    spec = invoke(*base, "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                  "--spec-draft-n-max", "8")
    assert spec.exit_code == 0, spec.stderr
    assert spec.stdout == json.loads(plain.stdout)["text"] + "\n"
    m = re.search(r"draft acceptance rate = (\d\.\d{5}) \((\d+) accepted / (\d+) generated\)", spec.stderr)
    assert m, spec.stderr
    acc, gen = int(m.group(2)), int(m.group(3))
    assert gen > 0 and float(m.group(1)) == pytest.approx(acc / gen, abs=1e-5)
    assert re.search(r"statistics\s+ngram-simple: #gen drafts = \d+, #acc drafts = \d+, #gen tokens = "
                     rf"{gen}, #acc tokens = {acc}, #mean acc len = \d+\.\d\d", spec.stderr)


def test_prompt_from_file_and_stdin(smollm_path, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text(PROMPT)
    a = invoke("-m", str(smollm_path), "-f", str(f), "-n", "8", "--temp", "0", "--json")
    b = invoke("-m", str(smollm_path), "-f", "-", "-n", "8", "--temp", "0", "--json", input=PROMPT)
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]


def test_seeded_sampling_is_reproducible(smollm_path):
    args = ["-m", str(smollm_path), "-p", "Once upon a time", "-n", "16", "--temp", "0.8", "--seed", "7", "--json"]
    a, b = invoke(*args), invoke(*args)
    assert json.loads(a.stdout)["tokens"] == json.loads(b.stdout)["tokens"]
    assert json.loads(a.stdout)["stats"]["seed"] == 7


def test_unknown_spec_type_lists_valid_ones(smollm_path):
    r = invoke("-m", str(smollm_path), "-p", "x", "--spec-type", "ngram-simple,eagle9")
    assert r.exit_code == 2
    assert "unknown spec type 'eagle9'" in r.stderr
    assert ("none, draft-simple, draft-eagle3, draft-mtp, ngram-simple, ngram-map-k, ngram-map-k4v, ngram-mod, "
            "ngram-cache, suffix, draft") in r.stderr


def test_prompt_longer_than_context(smollm_path):
    one_error_line(invoke("-m", str(smollm_path), "-p", "word " * 400, "-c", "256", "-no-cnv"),
                   r"the prompt exceeds the context size \(\d+ tokens, ctx 256\); raise -c")


def test_draft_mtp_without_heads(smollm_path):
    one_error_line(invoke("-m", str(smollm_path), "-p", "x", "--spec-type", "draft-mtp"),
                   r"has no MTP heads.*specrun inspect")


def test_draft_without_model_draft(smollm_path):
    r = invoke("-m", str(smollm_path), "-p", "x", "--spec-type", "draft")
    assert r.exit_code == 2
    assert "--spec-type draft needs -md/--model-draft" in r.stderr


def test_incompatible_draft(smollm_path, gemma_path):
    one_error_line(invoke("-m", str(gemma_path), "-md", str(smollm_path), "-p", "x", "--spec-type", "draft"),
                   r"cannot draft for .*49152.*262144")


@pytest.mark.parametrize("content", [None, b"", b"GGUF\x03\x00\x00\x00garbage", b"not a model at all"])
def test_unreadable_model(tmp_path, content):
    p = tmp_path / "bad.gguf"
    if content is not None:
        p.write_bytes(content)
    one_error_line(invoke("-m", str(p), "-p", "x"), r"bad\.gguf")


def test_no_prompt(smollm_path):
    r = invoke("-m", str(smollm_path))
    assert r.exit_code == 2 and "no prompt" in r.stderr
