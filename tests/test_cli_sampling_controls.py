"""llama.cpp's sampling controls on the command line (issue 13): --repeat-penalty, --repeat-last-n,
--presence-penalty, --frequency-penalty, --ignore-eos, -l/--logit-bias, --grammar, --grammar-file,
-j/--json-schema, -jf/--json-schema-file. Bad values are one line and exit 1 before the model
loads (never a traceback or llama.cpp's dump of the grammar); good ones change the text, which
stays the same with speculative decoding."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from specrun.cli.main import cli
from specrun.cli.runtime.options import parse_logit_bias

CHAT = r"<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n"
MODEL = "smollm2-135m-instruct"


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def gen(*args: str):
    return invoke("-m", MODEL, "-p", "The quick brown fox", "--temp", "0", "-n", "12", "-no-cnv", *args)


@pytest.mark.parametrize("args, words", [
    (["--grammar", 'root ::= "a'], "--grammar: the grammar does not parse: unexpected end of input; fix the GBNF"),
    (["--grammar", "root ::= foo"], "Undefined rule identifier 'foo'"),
    (["--grammar", 'root ::= "a"{3,1}'], "repetition {3,1} whose maximum is below its minimum"),
    (["-j", "{bad"], "-j/--json-schema's schema is not JSON"),
    (["-j", '{"type": "foo"}'], "cannot be turned into a grammar: Unrecognized schema"),
    (["-jf", "/nonexistent/schema.json"], "-jf/--json-schema-file /nonexistent/schema.json: cannot read it"),
    (["--grammar-file", "/nonexistent/g.gbnf"], "--grammar-file /nonexistent/g.gbnf: cannot read it"),
    (["-l", "hello"], "--logit-bias 'hello': not TOKEN_ID(+/-)BIAS; write e.g. 15043+1"),
    (["-l", "15+inf"], "a bias of +inf would leave nothing to sample"),
    (["--repeat-penalty", "0"], "--repeat-penalty 0.0: give a number greater than 0"),
    (["--frequency-penalty", "inf"], "--frequency-penalty inf: give a finite number"),
    (["--frequency-penalty", "nan"], "--frequency-penalty nan: give a finite number"),
    (["--temp", "nan"], "--temp nan: give a finite temperature (<= 0: greedy)"),   # was a traceback
    (["--temp", "inf"], "--temp inf: give a finite temperature"),
    (["--top-p", "nan"], "--top-p nan: give a number from 0 to 1"),    # passed click's range, sampled as off
    (["--min-p", "nan"], "--min-p nan: give a number from 0 to 1"),
    (["--repeat-last-n", "-1"], "--repeat-last-n -1: invalid repeat-last-n (llama.cpp refuses negative values too)"),
    (["--repeat-last-n", "-5"], "--repeat-last-n -5: invalid repeat-last-n"),
])
def test_bad_values_are_one_line_and_exit_1(args, words):
    r = invoke("-m", "/nonexistent/model.gguf", "-p", "x", *args)    # refused before the model is looked at
    assert r.exit_code == 1, r.output
    assert words in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), r.stderr
    assert "Traceback" not in r.output and "root ::=" not in r.stderr.replace(words, "")


@pytest.mark.parametrize("spec, pair", [
    ("15043+1", (15043, 1.0)), ("15043-0.5", (15043, -0.5)), ("15043-inf", (15043, float("-inf"))),
    ("15043--1", (15043, 1.0)), ("15043 + 1e2", (15043, 100.0)),   # llama.cpp: sign, then std::stof of the rest
])
def test_logit_bias_reads_as_llama_cpp(spec, pair):
    """-l is llama.cpp's TOKEN_ID(+/-)BIAS (common/arg.cpp): a token id, never a text."""
    assert parse_logit_bias(spec) == pair


@pytest.mark.parametrize("cmd", ["chat", "serve"])
def test_negative_repeat_last_n_is_refused_in_chat_and_serve(cmd):
    """llama.cpp 0.3.36 refuses --repeat-last-n -1 (common/arg.cpp: "invalid repeat-last-n") in every
    tool, with exit 1: so do chat and serve, before the model is looked at."""
    r = invoke(cmd, "-m", "/nonexistent/model.gguf", "--repeat-last-n", "-1")
    assert r.exit_code == 1, r.output
    assert [x for x in r.stderr.splitlines() if x.strip()] == [
        "Error: --repeat-last-n -1: invalid repeat-last-n (llama.cpp refuses negative values too); give the last N "
        "tokens the penalties look at (0: off)"], r.stderr


def test_two_grammars_are_a_usage_error():
    r = invoke("-m", MODEL, "-p", "x", "--grammar", 'root ::= "a"', "-j", "{}")
    assert r.exit_code == 2 and "--grammar and -j/--json-schema do not go together" in r.stderr


def test_the_flags_reach_chat_and_serve():
    for cmd in ("run", "chat", "serve"):
        out = invoke(cmd, "--help").stdout
        for flag in ("--repeat-penalty", "--repeat-last-n", "--presence-penalty", "--frequency-penalty",
                     "--ignore-eos", "-l, --logit-bias", "--grammar", "--grammar-file", "-j, --json-schema",
                     "-jf, --json-schema-file"):
            assert flag in out, (cmd, flag)


def test_out_of_vocabulary_bias_is_one_line():
    r = gen("-l", "999999+1")
    assert r.exit_code == 1
    assert "logit bias for token 999999: the vocabulary has 49152 tokens (0..49151)" in r.stderr


@pytest.fixture(scope="module")
def free():
    """temp -> `run --json`'s output without a control (seed 5), once per temp for the module."""
    out: dict[str, dict] = {}

    def get(temp: str) -> dict:
        if temp not in out:
            out[temp] = json.loads(gen("--json", "--temp", temp, "-s", "5").stdout)
        return out[temp]

    return get


# (control, its flags given the files and the greedy free output, a check of the controlled output);
# make test runs each control at one temperature, greedy or seeded, the other in `make test-full`
CONTROLS = {
    "penalties": (lambda d, f: ["--repeat-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "0.5"],
                  None),
    "logit-bias": (lambda d, f: ["-l", f"{f['tokens'][0]}-inf"], lambda o, f: f["tokens"][0] not in o["tokens"]),
    "grammar-file": (lambda d, f: ["--grammar-file", str(d / "g.gbnf")], lambda o, f: "e" not in o["text"]),
    "json-schema-file": (lambda d, f: ["-jf", str(d / "s.json")], lambda o, f: set(json.loads(o["text"])) == {"n"}),
}
IN_MAKE_TEST = {("logit-bias", "0"), ("grammar-file", "0.8"), ("json-schema-file", "0")}   # penalties: test_exact_constraints


@pytest.mark.slow
@pytest.mark.parametrize("control, temp", [
    pytest.param(c, t, id=f"{c}-{t}", marks=() if (c, t) in IN_MAKE_TEST else pytest.mark.full)
    for c in CONTROLS for t in ("0", "0.8")])
def test_controls_change_the_text_and_spec_keeps_it(tmp_path, free, control, temp):
    (tmp_path / "s.json").write_text('{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}')
    (tmp_path / "g.gbnf").write_text("root ::= [^e]*\n")
    flags, check = CONTROLS[control]
    args = flags(tmp_path, free("0"))
    plain = json.loads(gen("--json", "--temp", temp, "-s", "5", *args).stdout)
    spec = json.loads(gen("--json", "--temp", temp, "-s", "5", "--spec-type", "ngram-simple",
                          "--spec-ngram-simple-size-n", "2", *args).stdout)
    assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"], args
    assert plain["tokens"] != free(temp)["tokens"], args
    assert check is None or check(plain, free("0")), (args, plain["text"])


@pytest.mark.slow
def test_ignore_eos_generates_past_the_end_of_the_answer():
    short = json.loads(invoke("-m", MODEL, "-no-cnv", "-p", CHAT, "--temp", "0", "-n", "24", "--json").stdout)
    assert short["stop"] == "eog" and len(short["tokens"]) < 24
    long = json.loads(invoke("-m", MODEL, "-no-cnv", "-p", CHAT, "--temp", "0", "-n", "24", "--json", "--ignore-eos").stdout)
    assert long["stop"] == "n_predict" and len(long["tokens"]) == 24
    assert long["tokens"][:len(short["tokens"]) - 1] == short["tokens"][:-1]    # the same answer, then more
    assert re.search(r"\S", long["text"][len(short["text"]):])
