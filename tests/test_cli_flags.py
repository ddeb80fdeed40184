"""llama.cpp's spellings and meanings (issue 13): single-dash multi-letter options, flags that
cannot apply here (accepted, one line on stderr each), --seed -1 and the printed seed, -e, -r,
--predict, a full context, -md inferring the spec type, and `chat` choosing a model with a chat
template. Most runs use the tiny synthetic qwen35 model (loads in well under a second)."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from specrun.cli.main import cli
from specrun.cli.runtime.options import DEFAULT_CHAT_MODEL, unapplied
from specrun.cli.runtime.prompts import process_escapes
from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.extract import extract_mtp, extract_trunk
from specrun.gguf_spec.registry import DEFAULT_MODEL, resolve_model
from specrun.gguf_spec.spec import load_spec
from specrun.gguf_spec.testmodel import write_test_model

PROMPT = "def fib(n):"


def invoke(*args: str, input: str | None = None):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny qwen35 with an exact MTP head, its trunk and its heads, as separate files."""
    d = tmp_path_factory.mktemp("tiny")
    full = write_test_model(d / "full.gguf")
    extract_trunk(full, d / "trunk.gguf")
    extract_mtp(full, d / "heads.gguf")
    return {"full": str(full), "trunk": str(d / "trunk.gguf"), "heads": str(d / "heads.gguf")}


def gen(model: str, *args: str, input: str | None = None):
    return invoke("-m", model, "-p", PROMPT, "--temp", "0", *args, input=input)


# ---- parsing ------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, words", [
    (["-foo", "1"], "No such option: -foo"),
    (["-sysx", "Be brief."], "No such option: -sysx; did you mean -sys"),
    (["-ngll", "99"], "No such option: -ngll; did you mean -ngl"),
])
def test_unknown_single_dash_option_is_refused_by_its_own_name(tiny, args, words):
    r = gen(tiny["full"], *args)
    assert r.exit_code == 2
    assert words in r.stderr
    assert "Invalid value" not in r.stderr and "'-s'" not in r.stderr and "'-n'" not in r.stderr


@pytest.mark.parametrize("args, words", [
    (["--context", "-5"], "--context: -5: each context must be at least 1 token"),    # was a slice: ids[:-5]
    (["--n-max", "3,0"], "--n-max: 3,0: each n-max must be 1..255"),
    (["--n-max", "100000"], "--n-max: 100000: each n-max must be 1..255"),              # 100,000 decodes
    (["--context", "99999999", "--n-max", "3"], "--context: 99999999 tokens do not fit full.gguf's context of "),
])
def test_check_exact_refuses_what_it_cannot_check(tiny, args, words):
    r = invoke("check-exact", "-m", tiny["full"], "-t", "1", *args)
    assert r.exit_code == 2 and words in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize("command", [["run", "-p", "x"], ["check-exact"], ["rpc-worker"], ["quantize", "a", "b", "q8_0"]])
def test_threads_beyond_ggml_s_limit_are_refused(tiny, command):
    """ggml's CPU backend takes at most GGML_MAX_N_THREADS (512): run -t 100000 died of SIGSEGV."""
    r = invoke(*command, "-t", "100000")
    assert r.exit_code == 2 and "100000 is not in the range 0<=x<=512" in r.stderr


@pytest.mark.parametrize("args, words", [
    (["-p", "x", "--spec-type", "auto,ngram-simple"], "auto chooses among every type this model can use, so it "
                                                      "stands alone"),      # was "unknown spec type 'auto'"
    (["bench", "-p", "x", "--plot", "/nonexistent/b.png"], "cannot write /nonexistent/b.png: No such file or "
                                                            "directory"),    # was a traceback after the run
    (["bench", "-p", "x", "--plot", "b.xyz"], "--plot b.xyz: matplotlib writes "),
    (["bench", "-p", "x", "--temp", "nan"], "--temp nan: give a finite temperature"),   # was a traceback
    (["serve", "--host", "no.such.host.invalid", "--port", "0"], "give --host an address of this machine"),
])
def test_bad_values_caught_before_anything_runs(tiny, args, words):
    cmd, rest = (args[:1], args[1:]) if args[0] != "-p" else ([], args)    # a subcommand, or run's bare form
    r = invoke(*cmd, "-m", tiny["full"], "-t", "1", *rest)
    assert r.exit_code in (1, 2) and words in r.stderr and "Traceback" not in r.output, r.output


def test_a_context_llama_cpp_rounds_up_is_said(tiny):
    r = gen(tiny["full"], "-n", "1", "-c", "64")
    assert r.exit_code == 0, r.output
    assert "-c 64: llama.cpp rounds a context up to a multiple of 256 tokens; it holds 256" in r.stderr
    assert "rounds" not in gen(tiny["full"], "-n", "1", "-c", "512").stderr


def test_llamacpp_spellings_parse_and_unapplied_flags_say_why_in_one_line_each(tiny):
    r = gen(tiny["full"], "-n", "2", "-ngl", "99", "-ngld", "all", "-fa", "off", "-ctk", "f16", "-ctv", "q4_0",
            "-ub", "256", "-tb", "1", "-t", "2", "--mlock", "--no-mmap", "-lm", "none")
    assert r.exit_code == 0, r.output
    notes = [ln for ln in r.stderr.splitlines() if ": not applied" in ln or ": ignored" in ln or "keeps" in ln]
    assert notes == [
        "-ngl 99: ignored; specrun runs every layer on the CPU (its kernels load models with n_gpu_layers 0)",
        "-ngld all: ignored; specrun runs the draft model on the CPU (its kernels load models with n_gpu_layers 0)",
        "-fa off: exact mode keeps flash attention on, so that verify logits equal one-token decoding's; it "
        "applies with --no-exact",
        "-ctk f16: exact mode keeps a q8_0 K cache (bf16 where q8_0's blocks do not divide the head size) and an "
        "f16 V cache, so that one-token decodes never take flash attention's split-KV path; it applies with "
        "--no-exact",
        "-ctv q4_0: exact mode keeps a q8_0 K cache (bf16 where q8_0's blocks do not divide the head size) and an "
        "f16 V cache, so that one-token decodes never take flash attention's split-KV path; it applies with "
        "--no-exact",
        "-ub 256: not applied; the engine evaluates in llama.cpp's micro-batches of 512 tokens: it has no setting "
        "for it yet",
        "-tb 1: not applied; prompt processing uses -t's threads (2): the engine has no separate setting yet",
        "--mlock, --no-mmap, -lm none: not applied; the model is memory-mapped, as by default: the kernels do not "
        "pass llama.cpp's load mode yet",
    ]


def base_kw(**kw) -> dict:
    return {"no_exact": False, "threads": 0, **kw}


@pytest.mark.parametrize("kw, expected", [
    (base_kw(flash_attn="on", cache_type_k="q8_0", cache_type_v="f16", gpu_layers="0", ubatch_size=512,
             mmap=True, load_mode="mmap", threads_batch=0), []),                        # what exact mode does anyway
    (base_kw(no_exact=True, flash_attn="auto", cache_type_k="f16", gpu_layers="auto"), []),  # llama.cpp's defaults
    (base_kw(no_exact=True, flash_attn="off", cache_type_k="q4_0", cache_type_v="q8_0"), []),   # --no-exact applies them
    (base_kw(flash_attn="off"), ["-fa off: exact mode keeps flash attention on"]),
    (base_kw(threads_batch=4, threads=4), []),
])
def test_unapplied_is_silent_for_what_applies(kw, expected):
    lines = unapplied(kw)
    assert len(lines) == len(expected)
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(start), line


@pytest.mark.parametrize("value", ["on", "enabled", "true", "1", "off", "0", "auto", "-1"])
def test_flash_attn_takes_llamacpp_truthy_falsey_autoy_values(tiny, value):
    r = gen(tiny["full"], "-n", "1", "-fa", value)
    assert r.exit_code == 0, r.output


def test_flash_attn_refuses_other_values(tiny):
    r = gen(tiny["full"], "-n", "1", "-fa", "maybe")
    assert r.exit_code == 2 and "unknown value 'maybe': use on, off or auto" in r.stderr


def test_bundled_options_reach_chat_and_serve():
    for cmd in ("chat", "serve"):
        r = invoke(cmd, "--help")
        assert r.exit_code == 0
        for flag in ("-ngl", "-ngld", "-fa", "-ctk", "-ctv", "-ub", "-tb", "--mlock", "--no-mmap", "--predict"):
            assert re.search(rf"(^|[\s,]){re.escape(flag)}[\s,]", r.stdout), (cmd, flag)
    assert "-sys" in invoke("chat", "--help").stdout and "-st" in invoke("chat", "--help").stdout


# ---- prompts, seeds, -n, -r ---------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    (r"Q: hi\nA:", "Q: hi\nA:"),
    (r"tab\there", "tab\there"),
    (r"a\\nb", "a\\nb"),                  # an escaped backslash, then a plain n
    (r"\x41\xe2\x82\xac", "A€"),           # \xNN is a byte, as llama.cpp's
    (r"\q \x4", "\\q \\x4"),              # unknown or short escapes stay as written
    ("trailing\\", "trailing\\"),
    (r"\'\"", "'\""),
])
def test_process_escapes_as_llamacpp(text, expected):
    assert process_escapes(text) == expected


def test_escapes_on_by_default_and_no_escape_keeps_them(tiny):
    js = lambda *a: json.loads(invoke("-m", tiny["full"], "-n", "4", "--temp", "0", "--json", *a).stdout)  # noqa: E731
    escaped, real, literal = js("-p", r"Q: hi\nA:"), js("-p", "Q: hi\nA:"), js("-p", r"Q: hi\nA:", "--no-escape")
    assert escaped["tokens"] == real["tokens"] and escaped["n_prompt"] == real["n_prompt"]
    assert literal["n_prompt"] != real["n_prompt"]


def test_seed_minus_one_is_random_and_the_seed_used_is_printed_and_replays(tiny):
    args = ["-m", tiny["full"], "-p", PROMPT, "-n", "12", "--temp", "1.0"]
    a = invoke(*args, "--seed", "-1")
    assert a.exit_code == 0, a.output
    m = re.search(r"^sampler seed: (\d+)$", a.stderr, re.M)
    assert m, a.stderr
    b = invoke(*args, "--seed", m.group(1))
    assert b.stdout == a.stdout
    assert "sampler seed" not in b.stderr                  # a given seed is not repeated back
    assert "sampler seed" not in invoke("-m", tiny["full"], "-p", PROMPT, "-n", "2", "--temp", "0").stderr
    assert invoke(*args, "--seed", "-2").exit_code == 2


def test_predict_is_n(tiny):
    d = json.loads(gen(tiny["full"], "--predict", "3", "--json").stdout)
    assert d["stats"]["n_gen"] == 3


def test_reverse_prompt_stops_there_and_is_printed(smollm_path):
    base = ["-m", str(smollm_path), "-p", "Once upon a time, in a land far away,", "--temp", "0", "-c", "512", "-no-cnv"]
    plain = invoke(*base, "-n", "24").stdout
    word = plain.split()[3]
    r = invoke(*base, "-n", "24", "-r", word)
    assert r.exit_code == 0, r.output
    assert r.stdout == plain[:plain.index(word) + len(word)] + "\n"
    d = json.loads(invoke(*base, "-n", "24", "-r", word, "--json").stdout)
    assert d["stop"] == "word" and d["text"] + "\n" == r.stdout


def test_full_context_says_so_in_one_line(tiny):
    r = gen(tiny["full"], "-c", "64")
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if "context full" in ln]
    m = re.fullmatch(r"context full \((\d+) tokens\) => stopping; raise -c for a longer text", lines[0])
    assert len(lines) == 1 and m, r.stderr
    d = json.loads(gen(tiny["full"], "-c", "64", "--json").stdout)
    assert d["stop"] == "ctx" and d["n_prompt"] + d["stats"]["n_gen"] == int(m.group(1))


def test_keep_is_accepted_with_a_note(tiny):
    r = gen(tiny["full"], "-n", "1", "--keep", "-1")
    assert r.exit_code == 0
    assert "--keep -1: no effect; specrun does not shift the context" in r.stderr


# ---- -md infers the spec type -------------------------------------------------------------------

def test_md_heads_infer_draft_mtp_and_the_text_is_the_models(tiny):
    plain = gen(tiny["full"], "-n", "16")
    r = gen(tiny["trunk"], "-md", tiny["heads"], "-n", "16")
    assert r.exit_code == 0, r.output
    assert "spec type: draft-mtp, inferred from -md heads.gguf (MTP heads); --spec-type chooses another" in r.stderr
    assert re.search(r"statistics\s+draft-mtp: #gen drafts = [1-9]", r.stderr), r.stderr
    assert r.stdout == plain.stdout


def test_md_whole_model_infers_draft(tiny):
    r = gen(tiny["full"], "-md", tiny["full"], "-n", "8")
    assert r.exit_code == 0, r.output
    assert "spec type: draft-simple, inferred from -md full.gguf (a whole model)" in r.stderr
    assert re.search(r"statistics\s+draft-simple: #gen drafts = [1-9]", r.stderr), r.stderr


def test_md_with_a_type_that_does_not_use_it_says_so(tiny):
    r = gen(tiny["full"], "-md", tiny["heads"], "-n", "2", "--spec-type", "ngram-simple")
    assert r.exit_code == 0, r.output
    assert ("-md heads.gguf: not used, as --spec-type ngram-simple has no draft type; add draft (a draft model), "
            "draft-eagle3 (an EAGLE-3 draft) or draft-mtp (MTP heads)") in r.stderr
    assert "inferred" not in gen(tiny["full"], "-md", tiny["heads"], "-n", "2", "--spec-type", "draft-mtp").stderr


# ---- conversations ------------------------------------------------------------------------------

def test_run_and_chat_receive_their_options_checked_once(monkeypatch):
    """click's values reach run, chat and the REPL as RunOptions (built before any model loads),
    --spec-auto-refresh among them."""
    from specrun.cli import chat_cmd, run_cmd
    from specrun.cli.runtime import options

    seen = []

    def built(*a, **k):
        seen.append(options.run_options(*a, **k))
        raise SpecrunError("stop here")                        # before any model loads

    for module in (run_cmd, chat_cmd):
        monkeypatch.setattr(module, "run_options", built)
    for args in (("-p", "hi\\n", "-n", "3", "--temp", "0", "-r", "a\\tb", "--spec-auto-refresh"),
                 ("chat", "-sys", "Be brief.", "-q", "--spec-type", "ngram-simple"),
                 ("-m", DEFAULT_CHAT_MODEL, "-cnv", "-sys", "S", "-p", "Hi", "-st")):
        r = invoke(*args, input="")
        assert r.exit_code == 1 and r.stderr == "Error: stop here\n", r.output
    raw, chat, cnv = seen
    assert (raw.model, raw.prompt, raw.stops, raw.n_predict, raw.auto_refresh) == (
        DEFAULT_MODEL, "hi\n", ("a\tb",), 3, True)
    assert raw.sampling.greedy and raw.params.spec.types == ("infer",) and raw.conversation == "auto"
    assert (raw.chat.first_message, raw.chat.single_turn) == ("hi\n", True)   # stdin is not a terminal
    assert (chat.model, chat.auto_refresh, chat.prompt, chat.params.spec.types) == (
        DEFAULT_CHAT_MODEL, False, None, ("ngram-simple",))
    assert (chat.chat.system_prompt, chat.chat.first_message, chat.chat.quiet) == ("Be brief.", None, True)
    assert (cnv.chat.system_prompt, cnv.chat.first_message, cnv.chat.single_turn, cnv.chat.quiet) == (
        "S", "Hi", True, False)
    assert (chat.conversation, cnv.conversation) == ("on", "on")


def test_the_chat_model_has_a_chat_template_and_the_default_model_has_none():
    assert load_spec(resolve_model(DEFAULT_CHAT_MODEL)).has_chat_template
    assert not load_spec(resolve_model(DEFAULT_MODEL)).has_chat_template


def test_chat_without_m_chats_with_the_model_that_has_a_template(monkeypatch):
    monkeypatch.delenv("SPECRUN_MODEL", raising=False)
    r = invoke("chat", "--temp", "0", "-n", "4", "-q", input="Hi\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Hello")


def test_llamacpp_conversation_spelling_with_sys_p_and_single_turn(tmp_path):
    saved = tmp_path / "c.json"
    r = invoke("-m", DEFAULT_CHAT_MODEL, "-cnv", "-sys", "Be brief.", "-p", "Hi", "-st", "--temp", "0", "-n", "4",
               input=f"/save {saved}\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Hello")
    assert not saved.exists()                              # -st with -p: answered, never read stdin
    # -sys alone starts the conversation (llama.cpp's -sys needs one); -p is then the first message
    r = invoke("-m", DEFAULT_CHAT_MODEL, "-sys", "Be brief.", "-p", "Hi", "--temp", "0", "-n", "4",
               input=f"/save {saved}\n")
    assert r.exit_code == 0, r.output
    assert [m["role"] for m in json.loads(saved.read_text())["messages"]] == ["system", "user", "assistant"]


def test_a_model_without_a_chat_template_completes_the_raw_text(tiny):
    """A base model (no tokenizer.chat_template) keeps llama-cli's raw completion for -p."""
    r = gen(tiny["full"], "-n", "2")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() and "generation:" in r.stderr and "conversation mode" not in r.stderr


def test_conversation_flags_without_conversation_mode_say_so(tiny):
    r = gen(tiny["full"], "-n", "1", "-no-cnv", "-sys", "x", "-st")
    assert r.exit_code == 0, r.output
    assert "-sys, -st: ignored without conversation mode (-no-cnv)" in r.stderr


def test_builtin_chat_template_by_name_on_a_model_without_one(tiny):
    r = invoke("chat", "-m", tiny["full"], "--chat-template", "chatml", "--temp", "0", "-n", "2", "-q",
               input="hello\n")
    assert r.exit_code == 0, r.output
    r = invoke("chat", "-m", tiny["full"], "--chat-template", "llama4", input="hello\n")
    assert r.exit_code == 1
    assert r.stderr.splitlines()[-1] == ("Error: llama.cpp's built-in template 'llama4' is not carried by specrun, "
                                         "which renders templates with Jinja; give the model's Jinja template with "
                                         "--chat-template-file FILE")
    r = invoke("chat", "-m", tiny["full"], "--chat-template", "chatmlx", input="hello\n")
    assert r.exit_code == 1 and "--chat-template chatmlx: not a built-in template name (chatml, " in r.stderr


def test_chat_template_as_jinja_text_and_file_and_no_jinja(tiny, tmp_path):
    jinja = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    r = invoke("chat", "-m", tiny["full"], "--chat-template", jinja, "--temp", "0", "-n", "2", "-q", "--no-jinja",
               input="hello\n")
    assert r.exit_code == 0, r.output
    assert "--no-jinja: ignored; specrun renders every chat template with Jinja" in r.stderr
    f = tmp_path / "t.jinja"
    f.write_text(jinja)
    r2 = invoke("chat", "-m", tiny["full"], "--chat-template-file", str(f), "--temp", "0", "-n", "2", "-q",
                input="hello\n")
    assert r2.exit_code == 0 and r2.stdout == r.stdout
    both = invoke("chat", "-m", tiny["full"], "--chat-template", "chatml", "--chat-template-file", str(f), input="")
    assert both.exit_code == 2 and "not both" in both.stderr


def test_chat_prints_its_random_seed_once_before_the_first_answer_and_it_replays():
    args = ["chat", "-m", DEFAULT_CHAT_MODEL, "--temp", "1.0", "-n", "8", "-q"]
    a = invoke(*args, input="Tell me a story.\nAnd another.\n")
    assert a.exit_code == 0, a.output
    seeds = re.findall(r"^sampler seed: (\d+)$", a.stderr, re.M)
    assert len(seeds) == 1 and a.stderr.startswith("sampler seed:")
    b = invoke(*args, "--seed", seeds[0], input="Tell me a story.\nAnd another.\n")
    assert b.stdout == a.stdout and "sampler seed" not in b.stderr


def test_md_with_a_broken_eagle3_draft_is_refused_in_one_line(tmp_path):
    """-md infers draft-eagle3 from an eagle3 file, as llama.cpp does; one without extract layers, or
    an eagle3 file given to --spec-type draft, is refused before llama.cpp loads it (tests/test_eagle3.py
    runs the real thing)."""
    from conftest import write_gguf

    path = write_gguf(tmp_path / "eagle3.gguf", arch="eagle3")
    for extra, error in (([], "EAGLE-3 draft eagle3.gguf cannot draft for SmolLM2-135M-Instruct.Q4_1.gguf: it lists 0 "
                               "extract layers [] in eagle3.target_layers; llama.cpp's EAGLE-3 reads exactly 3"),
                         (["--spec-type", "draft"], "-md eagle3.gguf is an EAGLE-3 draft (architecture eagle3), not a "
                                                    "draft model; use --spec-type draft-eagle3")):
        r = CliRunner().invoke(cli, ["-m", "smollm2-135m-instruct", "-md", str(path), "-p", "hi", "-n", "1", *extra])
        assert r.exit_code == 1 and "Traceback" not in r.output, r.output
        assert r.output.strip().splitlines() == [f"Error: {error}"]


# ---- llama-cli script flags (issue 48) ----------------------------------------------------------

NOTES = (": no effect;", ": not applied;")


def notes_of(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if any(n in ln for n in NOTES)]


def test_llamacpp_script_flags_are_no_ops_with_one_note_each_and_the_same_text(smollm_path):
    """Flags that cannot change the text: exit 0, the text of the run without them, one line each
    (grouped where one reason covers several); llama.cpp's off values of its other samplers: silent."""
    base = ["-m", str(smollm_path), "-p", "Once upon a time", "-n", "4", "--temp", "0", "-t", "1", "-no-cnv"]
    plain = invoke(*base)
    assert plain.exit_code == 0, plain.output
    r = invoke(*base, "--no-display-prompt", "--log-disable", "--simple-io", "--no-warmup", "-co", "--perf",
               "--numa", "distribute", "--swa-full", "--cpu-moe", "-ncmoe", "3", "--prompt-cache", "p.bin",
               "--prompt-cache-all", "--prompt-cache-ro",
               "--mirostat", "0", "--typical", "1.0", "--dry-multiplier", "0", "--xtc-probability", "0",
               "--top-nsigma", "-1", "--mirostat-lr", "0.2", "--mirostat-ent", "4", "--dry-base", "2",
               "--dry-allowed-length", "3", "--dry-penalty-last-n", "32", "--dry-sequence-breaker", "x",
               "--xtc-threshold", "0.2")
    assert r.exit_code == 0, r.output
    assert r.stdout == plain.stdout and r.stdout.strip()
    assert notes_of(r.stderr) == [
        "--cpu-moe, -ncmoe 3: no effect; every weight is on the CPU already",
        "--swa-full: no effect; specrun's contexts keep a full-size SWA cache already (llama.cpp's library default)",
        "--numa distribute: not applied; the kernels do not call ggml's NUMA setup: threads run where the OS "
        "places them",
        "--no-warmup: no effect; run, chat and serve do no warm-up pass (bench keeps its untimed one)",
        "--perf: no effect; specrun prints its own statistics on stderr, not libllama's timings",
        "--log-disable: no effect; llama.cpp's log is already off (-v turns it on); specrun's notes and statistics "
        "stay on stderr",
        "--no-display-prompt: no effect; specrun prints only the generated text, never the prompt",
        "--simple-io: no effect; specrun reads plain lines when stdin is not a terminal and writes plain text",
        "-co on: no effect; stdout carries the text uncolored; stderr is colored on a terminal (NO_COLOR=1 turns "
        "it off)",
        "--prompt-cache p.bin, --prompt-cache-all, --prompt-cache-ro: not applied; specrun evaluates the prompt on "
        "each run and keeps no session file",
        "--mirostat-lr 0.2, --mirostat-ent 4, --dry-base 2, --dry-allowed-length 3, --dry-penalty-last-n 32, "
        "--dry-sequence-breaker x, --xtc-threshold 0.2: no effect; their samplers are off, as in llama.cpp with "
        "these values, and specrun has none of them",
    ]
    assert notes_of(plain.stderr) == []


@pytest.mark.parametrize("args, line", [
    (["-co", "off"], "-co off: no effect; stdout carries the text uncolored"),      # llama.cpp's [on|off|auto]
    (["--color", "auto"], "-co auto: no effect;"),
    (["--no-perf"], "--no-perf: no effect; specrun prints its own statistics"),
    (["--numa", "isolate"], "--numa isolate: not applied;"),
    (["--xtc-probability", "0.5", "--xtc-threshold", "0.6"], "--xtc-threshold 0.6: no effect; their samplers are "
                                                             "off"),                # threshold > 0.5: XTC is off
])
def test_other_spellings_of_the_no_op_flags(tiny, args, line):
    r = gen(tiny["full"], "-n", "1", *args)
    assert r.exit_code == 0, r.output
    notes = notes_of(r.stderr)
    assert len(notes) == 1 and notes[0].startswith(line), r.stderr


CHAIN = "specrun's sampler chain is fixed (penalties, top-k, top-p, min-p, temperature)"


@pytest.mark.parametrize("args, message", [
    (["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"],
     "--override-kv tokenizer.ggml.add_bos_token=bool:false: refused; it changes the model's metadata, and so the "
     "text, and specrun reads each GGUF as it is; write the change into a copy with gguf-new-metadata"),
    (["-ot", "exps=CPU"], "-ot exps=CPU: refused; specrun chooses each weight's buffer (exact mode: none repacked), "
                          "and another could change the text; every weight is on the CPU already"),
    (["--samplers", "top_k;temperature"], f"--samplers top_k;temperature: refused; {CHAIN}; turn one off instead: "
                                          "--top-k 0, --top-p 1, --min-p 0, --repeat-penalty 1"),
    (["--mirostat", "2"], f"--mirostat 2: refused; {CHAIN} and has no Mirostat; drop the flag (--mirostat 0 is "
                          "off) and use --temp with --top-p or --min-p"),
    (["--typical-p", "0.9"], f"--typical 0.9: refused; {CHAIN} and has no locally typical sampling; drop the flag "
                             "(--typical 1.0 is off) and use --top-p or --min-p"),
    (["--dry-multiplier", "0.8"], f"--dry-multiplier 0.8: refused; {CHAIN} and has no DRY; drop the flag "
                                  "(--dry-multiplier 0 is off) and use --repeat-penalty, --presence-penalty or "
                                  "--frequency-penalty"),
    (["--xtc-probability", "0.5"], f"--xtc-probability 0.5: refused; {CHAIN} and has no XTC; drop the flag "
                                   "(--xtc-probability 0 is off) and use a higher --temp"),
    (["--top-n-sigma", "1.5"], f"--top-nsigma 1.5: refused; {CHAIN} and has no top-n-sigma; drop the flag "
                               "(--top-nsigma -1 is off) and use --min-p"),
    (["-i", "-no-cnv"], "-i and -no-cnv do not go together: specrun's interactive mode is conversation mode; drop "
                        "-no-cnv to chat, or -i to generate once"),
    (["-n", "-5"], "Invalid value for '-n' / '--n-predict' / '--predict': -5 is not a number of tokens: give N >= 0, "
                   "-1 (until end of generation or a full context) or -2 (until the context is full)"),
    (["-co", "maybe"], "Invalid value for '-co' / '--color': unknown value 'maybe': use on, off or auto"),
    (["--mirostat", "3"], "Invalid value for '--mirostat': 3 is not in the range 0<=x<=2."),
])
def test_flags_that_could_change_the_text_are_refused_by_name_in_one_line(tiny, args, message):
    r = gen(tiny["full"], *args)
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines()[-1] == f"Error: {message}"
    assert "Did you mean" not in r.stderr and r.stdout == ""


@pytest.mark.parametrize("command, args, flag", [
    (["chat"], ["--mirostat", "1"], "--mirostat 1: refused;"),
    (["serve", "--port", "0"], ["--dry-multiplier", "1"], "--dry-multiplier 1: refused;"),
    (["serve", "--port", "0"], ["--override-kv", "a=int:1"], "--override-kv a=int:1: refused;"),
    (["bench", "-p", "x"], ["-ot", "x=CPU"], "-ot x=CPU: refused;"),
    (["chat"], ["-n", "-3"], "-3 is not a number of tokens"),
])
def test_refusals_reach_chat_serve_and_bench(tiny, command, args, flag):
    r = invoke(*command, "-m", tiny["full"], *args, input="hi\n")
    assert r.exit_code == 2, r.output
    assert flag in r.stderr.splitlines()[-1]


def test_n_minus_two_runs_to_a_full_context_as_minus_one(tiny):
    a = json.loads(gen(tiny["full"], "-c", "64", "-n", "-2", "--json").stdout)
    b = json.loads(gen(tiny["full"], "-c", "64", "-n", "-1", "--json").stdout)
    assert a["stop"] == "ctx" and a["tokens"] == b["tokens"]


def test_a_context_above_the_training_context_warns_once(tiny):
    """As llama.cpp's "n_ctx_seq (...) > n_ctx_train (...) -- possible training context overflow"."""
    r = gen(tiny["full"], "-n", "1", "-c", "8448")
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if "training context" in ln]
    assert lines == ["-c 8448: more than full.gguf's training context (8192 tokens); the text may degrade past it "
                     "(llama.cpp: possible training context overflow); -c 0 takes the training context"]
    for ok in ("8192", "0"):
        assert "training context" not in gen(tiny["full"], "-n", "1", "-c", ok).stderr


def test_interactive_is_conversation_mode(smollm_path):
    args = ["-m", str(smollm_path), "--temp", "0", "-n", "4", "-t", "1"]
    cnv = invoke(*args, "-cnv", input="Hi\n")
    r = invoke(*args, "-i", input="Hi\n")
    assert r.exit_code == 0, r.output
    assert r.stdout == cnv.stdout and r.stdout.startswith("Hello")
    assert "-i: interactive mode is conversation mode (-cnv) here: each line is a message in the chat template" \
        in r.stderr.splitlines()
