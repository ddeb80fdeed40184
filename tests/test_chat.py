"""`specrun chat`: the ChatSession core on SmolLM2-135M-Instruct (greedy, exact mode), the REPL
through CliRunner with piped input, and a real terminal session under a pseudo-terminal."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import pexpect
import pytest
from click.testing import CliRunner

from specrun.cli.main import cli
from specrun.cli.repl import history_path
from specrun.cli.runtime.chat import ChatSession, ContextFull
from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.testmodel import write_test_model
from specrun.kernels.chat_template import TemplateError, template_for
from specrun.kernels.engine import Engine, Generation
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.stats import GenStats
from specrun.kernels.types import SamplingParams

GREEDY = SamplingParams(temp=0.0)
N_PREDICT = 24
# SmolLM2 answers the first greedily and ends its turn (<|im_end|>); the second runs into -n, and
# quotes the question's words, so an n-gram drafter gets drafts accepted and rejected there
TURNS = ("Hi", "Fix the spelling in this sentence: I has writen a leter to my freind yesterday.")
SPECRUN = str(Path(sys.executable).with_name("specrun"))


@pytest.fixture(scope="module")
def engine(smollm_path):
    with Engine(str(smollm_path), EngineParams(n_ctx=1024)) as e:
        yield e


@pytest.fixture
def session(engine):
    """A fresh conversation (empty KV cache, no spec type) over the shared engine."""
    engine.reset()
    engine.set_spec(SpecParams())
    return ChatSession(engine, template_for(engine.model), GREEDY, N_PREDICT)


def chat(session: ChatSession, turns=TURNS) -> list:
    """Send each turn; the Turn records (with a copy of the engine's GenStats) in order."""
    out = []
    for text in turns:
        answer = "".join(session.send(text))
        assert answer == session.last.text
        out.append(session.last)
    return out


@pytest.fixture(scope="module")
def plain(engine):
    """The two turns without speculative decoding, plus the renders they were built from."""
    engine.reset()
    engine.set_spec(SpecParams())
    s = ChatSession(engine, template_for(engine.model), GREEDY, N_PREDICT)
    render1 = s.template.render([{"role": "user", "content": TURNS[0]}])
    t1 = chat(s, TURNS[:1])[0]
    kv_after_1 = list(engine.kv_tokens)
    t2 = chat(s, TURNS[1:])[0]
    return dict(turns=[t1, t2], messages=s.messages, render1=render1, kv_after_1=kv_after_1,
                render2=s.template.render(s.messages[:3]))


# ---- the session core --------------------------------------------------------------------------

@pytest.mark.slow
def test_turns_stop_at_end_of_turn_and_at_n_predict(plain):
    t1, t2 = plain["turns"]
    assert t1.stop == "eog" and t1.tokens[-1] == 2            # <|im_end|>, kept in the history tokens
    assert t1.text and "<|im_end|>" not in t1.text
    assert t2.stop == "n_predict" and len(t2.tokens) == N_PREDICT
    assert [m["role"] for m in plain["messages"]] == ["user", "assistant", "user", "assistant"]
    assert plain["messages"][1]["content"] == t1.text


@pytest.mark.slow
def test_second_turn_evaluates_only_the_new_tokens(engine, plain):
    t1, t2 = plain["turns"]
    render1, render2 = plain["render1"], plain["render2"]
    # The history's text (prompt + answer + its end-of-turn token) is a prefix of the next render ...
    history = render1 + t1.text + "<|im_end|>"
    assert render2.startswith(history)
    new = engine.tokenize(render2[len(history):], add_special=False)
    p1 = engine.tokenize(render1, add_special=False)
    # ... the cache held prompt 1 + answer 1 but its last token (sampled, never decoded) ...
    assert plain["kv_after_1"] == [*p1, *t1.tokens[:-1]]
    # ... so turn 2 evaluates exactly that last token and the new text's tokens.
    assert t2.stats.n_prompt == 1 + len(new)
    assert t2.stats.n_prompt_total == len(p1) + len(t1.tokens) + len(new)
    assert t1.stats.n_prompt == len(p1)                         # turn 1: everything is new


@pytest.mark.slow
def test_speculative_answers_equal_plain_answers(engine, plain):
    engine.reset()
    # ngram-simple with 2-token keys: it drafts often, so drafts are both accepted and rejected
    engine.set_spec(SpecParams(types=("ngram-simple",), ngram_size_n=2))
    s = ChatSession(engine, template_for(engine.model), GREEDY, N_PREDICT)
    spec = chat(s)
    for a, b in zip(spec, plain["turns"], strict=True):
        assert (a.text, a.tokens, a.stop) == (b.text, b.tokens, b.stop)
        assert a.stats.n_prompt == b.stats.n_prompt
    drafted = sum(t.stats.n_drafted for t in spec)
    accepted = sum(t.stats.n_accepted for t in spec)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert s.stats.n_drafted == drafted and s.stats.n_accepted == accepted
    assert s.stats.turns == 2 and s.stats.n_gen == sum(len(t.tokens) for t in spec)


@pytest.mark.slow
def test_spec_switch_mid_session(session):
    assert session.set_spec("ngram-simple") == "ngram-simple"
    assert session.engine.params.spec.types == ("ngram-simple",)
    with pytest.raises(SpecrunError, match="unknown spec type 'bogus'"):
        session.set_spec("bogus")
    with pytest.raises(SpecrunError, match="-md"):          # draft-simple needs a draft model
        session.set_spec("draft")
    assert session.engine.params.spec.types == ("ngram-simple",)   # a refused switch changes nothing
    assert session.set_spec("none") == "none"


@pytest.mark.slow
def test_closing_the_answer_keeps_the_partial_turn(session):
    it = session.send(TURNS[1])
    first = next(it)
    it.close()                                                # what Ctrl-C does in the REPL
    t = session.last
    assert t.stop == "interrupted" and t.text.startswith(first) and 1 <= len(t.tokens) < N_PREDICT
    assert session.messages[-1] == {"role": "assistant", "content": t.text}
    e = session.engine
    assert e.ctx.pos_max() == len(e.kv_tokens) - 1           # the cache is as the engine believes
    again = chat(session, ["Hi"])[0]                         # the session goes on, reusing the cache
    assert again.stats.n_prompt < again.stats.n_prompt_total


def test_save_load_round_trip(session, tmp_path):
    session.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, ünïcode!"}]
    path = tmp_path / "conv.json"
    session.save(str(path))
    assert json.loads(path.read_text(encoding="utf-8")) == {"messages": session.messages}
    other = ChatSession(session.engine, session.template, GREEDY, N_PREDICT)
    assert other.load(str(path)) == 2
    assert other.messages == session.messages
    assert other.prompt_for([*other.messages, {"role": "user", "content": "x"}]) == \
        session.prompt_for([*session.messages, {"role": "user", "content": "x"}])


@pytest.mark.parametrize("content, words", [
    (None, "cannot read"),
    ("{not json", "is not JSON"),
    ('{"turns": []}', "holds no conversation"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "message 0 is not"),
    ('{"messages": [{"role": "user", "content": 3}]}', "message 0 is not"),
])
def test_load_refuses_a_bad_file_and_keeps_the_conversation(session, tmp_path, content, words):
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    session.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    with pytest.raises(SpecrunError, match=words):
        session.load(str(path))
    assert session.messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def test_a_failed_turn_leaves_the_conversation_as_it_was(session, monkeypatch):
    session.messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]

    def steps():
        raise SpecrunError("the engine broke")
        yield []

    monkeypatch.setattr(session.engine, "generate", lambda *a, **k: Generation(steps(), GenStats()))
    with pytest.raises(SpecrunError, match="the engine broke"):
        "".join(session.send("again"))
    assert session.messages == [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    broken = replace(session.template, source="{{ raise_exception('one user message only') }}")
    session.format = replace(session.format, template=broken)
    with pytest.raises(TemplateError, match="one user message only"):
        "".join(session.send("again"))
    assert len(session.messages) == 2 and session.last is None


def test_stop_tokens_are_the_turn_separator_control_tokens(session):
    assert session.stop_tokens == {1, 2}                     # <|im_start|>, <|im_end|>


@pytest.mark.slow
def test_full_context_drops_the_oldest_turns(smollm_path):
    long = " ".join(["apple banana cherry"] * 34)            # 102 tokens
    with Engine(str(smollm_path), EngineParams(n_ctx=256)) as e:
        assert e.n_ctx == 256
        s = ChatSession(e, template_for(e.model), GREEDY, 8)
        first = chat(s, [long])[0]                            # ~140 tokens with the answer
        assert first.n_dropped == 0
        second = chat(s, ["Again: " + long])[0]               # both turns do not fit in 256 - 8
        assert second.n_dropped == 1 and second.tokens
        assert [m["role"] for m in s.messages] == ["user", "assistant"]
        assert s.messages[0]["content"].startswith("Again: ")
        before = list(s.messages)
        with pytest.raises(ContextFull, match=r"does not fit in the context \(\d+ tokens, ctx 256\)"):
            next(s.send(long * 3))
        assert s.messages == before                           # the refused message left no trace
        assert chat(s, ["Hi"])[0].tokens                      # and the session goes on


@pytest.mark.slow
@pytest.mark.full
def test_full_context_keeps_the_turn_a_follow_up_refers_to(smollm_path):
    """Older turns go to leave -n for the answer; the turn just before the new message stays while
    at least min(-n, ctx / 16) tokens are left, and the drop is reported before the answer begins."""
    with Engine(str(smollm_path), EngineParams(n_ctx=512)) as e:
        s = ChatSession(e, template_for(e.model), GREEDY, 100)          # reserve 100, least 32
        follow_up = {"role": "user", "content": "Which fruit did I name first?"}
        older = [{"role": "user", "content": "Hello there."}, {"role": "assistant", "content": "Hi! " * 40}]
        for k in range(10, 200):
            last = [{"role": "user", "content": "Remember: " + "apple banana cherry " * k},
                    {"role": "assistant", "content": "I will remember them."}]
            n = len(s.prompt_for([*last, follow_up])[0])
            if 512 - 100 < n <= 512 - 32:
                break
        assert 512 - 100 < n <= 512 - 32
        s.messages = [*older, *last]
        events = []
        for piece in s.send(follow_up["content"], on_dropped=lambda k: events.append(("dropped", k))):
            events.append(("piece", piece))
        assert events[0] == ("dropped", 1) and len(events) > 1
        assert s.last.n_dropped == 1
        assert s.messages[:3] == [*last, follow_up]                     # the referent stayed


@pytest.mark.slow
def test_repl_says_context_full_before_the_answer():
    long = " ".join(["apple banana cherry"] * 34)
    notice = "context full: dropped the oldest 1 turn(s) to make room; /reset starts over\n"
    r = invoke("chat", "-m", "smollm2-135m-instruct", "-c", "256", "--temp", "0", "-n", "8", "-q",
               input=f"{long}\nAgain: {long}\n")
    assert r.exit_code == 0, r.output
    assert r.stderr == notice
    first, rest = r.output.split(notice)
    assert first + rest == r.stdout and first.endswith("\n") and rest.strip()   # between the answers


# ---- the REPL with piped input -----------------------------------------------------------------

def invoke(*args: str, input: str):
    return CliRunner().invoke(cli, list(args), input=input, catch_exceptions=False)


def test_piped_bad_load_is_one_line_and_the_session_goes_on(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]", encoding="utf-8")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}), encoding="utf-8")
    r = invoke("chat", "-m", "smollm2-135m-instruct", "-sys", "Be brief.",
               input=f"/load {bad}\n/bogus\n/save\n/save {tmp_path / 'sys.json'}\n/load {good}\n/exit\n")
    assert r.exit_code == 0, r.output
    assert r.stdout == ""                                     # no answers: nothing on stdout
    assert r.stderr.splitlines() == [
        f"error: {bad}: message 0 is not {{\"role\": system|user|assistant, \"content\": text}}",
        "error: unknown command /bogus; /help lists the commands",
        "error: /save needs a file name: /save FILE",
        "saved 1 messages to " + str(tmp_path / "sys.json"),
        f"loaded 1 messages from {good}",
    ]
    assert json.loads((tmp_path / "sys.json").read_text()) == {"messages": [{"role": "system", "content": "Be brief."}]}


def test_conversation_flag_takes_p_as_the_first_user_message(tmp_path):
    """llama-cli: in conversation mode -p is a user message (-sys gives the system message); with
    -cnv the conversation goes on with stdin's lines after the answer."""
    out = tmp_path / "c.json"
    r = invoke("-m", "smollm2-135m-instruct", "-cnv", "-p", "Hi", "--temp", "0", "-n", "4", input=f"/save {out}\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Hello")
    assert [(m["role"], m["content"]) for m in json.loads(out.read_text())["messages"]] == [
        ("user", "Hi"), ("assistant", r.stdout.rstrip("\n"))]
    assert "conversation mode" not in r.stderr             # asked for: nothing to say
    r = invoke("-m", "smollm2-135m-instruct", "-cnv", "--json", input="")
    assert r.exit_code == 2 and "--json and -cnv/--conversation do not go together" in r.stderr


CNV_NOTE = ("conversation mode, as SmolLM2-135M-Instruct.Q4_1.gguf has a chat template: the prompt is the first user "
            "message, then exit (stdin is not a terminal); -no-cnv for a raw completion")


@pytest.mark.slow
def test_a_model_with_a_chat_template_chats_for_p_as_llama_cli(tmp_path):
    """Without -cnv / -no-cnv, -p to a model with a chat template is the first user message; from a
    script (stdin not a terminal) one answer, then exit. -no-cnv and --json: a raw completion."""
    saved = tmp_path / "c.json"
    args = ("-m", "smollm2-135m-instruct", "-p", "Hi", "--temp", "0", "-n", "8")
    auto = invoke(*args, input=f"/save {saved}\n")
    assert auto.exit_code == 0, auto.output
    assert not saved.exists()                                  # stdin was never read
    chat = invoke("chat", "-m", "smollm2-135m-instruct", "--temp", "0", "-n", "8", "-q", input="Hi\n")
    assert auto.stdout == chat.stdout and auto.stdout.startswith("Hello")
    note, stats = auto.stderr.splitlines()
    assert note == CNV_NOTE and re.fullmatch(r"\[8 tokens, .* \| prompt 31 new \+ 0 cached \| stopped at -n\]", stats)
    piped = invoke(*args[:2], "--temp", "0", "-n", "8", input="Hi")   # the prompt on stdin: the same message
    assert piped.stdout == auto.stdout and piped.stderr.splitlines()[0] == CNV_NOTE
    slash = invoke(*args[:2], "-p", "/help", "--temp", "0", "-n", "4", input="/exit\n")   # a message, not a command
    assert slash.exit_code == 0 and slash.stdout.strip() and "/regen" not in slash.stderr
    raw = invoke(*args, "-no-cnv", input="")
    js = invoke(*args, "--json", input="")
    assert raw.exit_code == 0 and js.exit_code == 0
    assert raw.stdout == json.loads(js.stdout)["text"] + "\n" != auto.stdout
    assert "conversation mode" not in raw.stderr + js.stderr and "generation:" in raw.stderr


@pytest.mark.slow
def test_regen_answers_again_from_the_cache_and_clear_keeps_the_system_prompt(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    r = invoke("chat", "-m", "smollm2-135m-instruct", "-sys", "Be brief.", "--temp", "0", "-n", "8",
               input=f"/regen\nHi\n/regen\n/save {a}\n/clear\n/save {b}\n/regen\n")
    assert r.exit_code == 0, r.output
    first, again = r.stdout.splitlines()                      # greedy: the same answer twice
    assert first == again and first.startswith("Hello")
    system, user = {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}
    assert json.loads(a.read_text())["messages"] == [system, user, {"role": "assistant", "content": first}]
    assert json.loads(b.read_text())["messages"] == [system]
    err = r.stderr.splitlines()
    nothing = "error: no answer to regenerate: the conversation does not end with one"
    assert err[0] == nothing and err[3:] == [f"saved 3 messages to {a}", "conversation cleared",
                                            f"saved 1 messages to {b}", nothing]
    n_prompt = int(re.fullmatch(r"\[8 tokens, .* \| prompt (\d+) new \+ 0 cached \| stopped at -n\]", err[1]).group(1))
    # the regenerated answer's prompt came from the cache but its last token (its logits are needed)
    assert re.fullmatch(rf"\[8 tokens, .* \| prompt 1 new \+ {n_prompt - 1} cached \| stopped at -n\]", err[2])


@pytest.mark.slow
def test_piped_turns_answer_on_stdout_statistics_on_stderr():
    r = invoke("chat", "-m", "smollm2-135m-instruct", "--temp", "0", "-n", "8", "--spec-type", "ngram-simple",
               input="Hi\n\\\nsecond \\\nline\n")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("Hello")
    stats = r.stderr.splitlines()
    assert len(stats) == 2 and all(re.fullmatch(r"\[\d+ tokens, .* tokens/s \| prompt \d+ new \+ \d+ cached.*\]", s)
                                   for s in stats), stats
    assert "+ 0 cached" in stats[0] and "+ 0 cached" not in stats[1]
    q = invoke("chat", "-m", "smollm2-135m-instruct", "--temp", "0", "-n", "8", "--quiet", input="Hi\n")
    assert q.exit_code == 0 and q.stderr == ""
    assert q.stdout.endswith("\n") and r.stdout.startswith(q.stdout)      # the same greedy answer


def test_model_without_a_template_is_one_line(tmp_path):
    path = write_test_model(tmp_path / "synth.gguf")
    r = invoke("chat", "-m", str(path), input="hello\n")
    assert r.exit_code == 1
    assert r.stderr.splitlines()[-1] == (f"Error: {path} has no chat template (tokenizer.chat_template); "
                                          "give one with --chat-template FILE")
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<assistant>{% endif %}")
    r = invoke("chat", "-m", str(path), "--chat-template", str(tmpl), "--temp", "0", "-n", "3",
               input="hello\nhello again\n")
    assert r.exit_code == 0, r.output
    stats = r.stderr.splitlines()
    assert len(stats) == 2 and "stopped at -n" in stats[0] and "+ 0 cached" not in stats[1]


def test_help_shows_the_model_chat_loads_without_m():
    r = invoke("chat", "--help", input="")
    assert r.exit_code == 0 and "[default: smollm2-135m-instruct]" in r.output
    assert "[default: gemma-3-270m]" in invoke("run", "--help", input="").output


def test_history_path(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECRUN_HISTORY", str(tmp_path / "h"))
    assert history_path() == tmp_path / "h"
    monkeypatch.delenv("SPECRUN_HISTORY")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert history_path() == tmp_path / "state" / "specrun" / "chat_history"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert history_path() == tmp_path / ".local" / "state" / "specrun" / "chat_history"


# ---- a real terminal ---------------------------------------------------------------------------

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[()][0-9A-Za-z]|\x1b[=>78]|[\x08\r]")


class Screen:
    """What a terminal shows, roughly: the child's output without escape sequences. wait()
    searches forward from the end of the last match, with a deadline."""

    def __init__(self, child: pexpect.spawn) -> None:
        self.child, self.raw, self.pos = child, "", 0

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def wait(self, pattern: str, timeout: float = 180) -> re.Match:
        rx, deadline = re.compile(pattern), time.monotonic() + timeout
        while not (m := rx.search(self.text, self.pos)):
            if time.monotonic() > deadline:
                raise AssertionError(f"{pattern!r} not on the screen after {timeout} s:\n{self.text[-3000:]}")
            try:
                self.raw += self.child.read_nonblocking(4096, timeout=0.5)
            except pexpect.TIMEOUT:
                pass
        self.pos = m.end()
        return m


def terminal_chat(history, *args: str) -> pexpect.spawn:
    """`specrun chat -m smollm2-135m-instruct ARGS` in a 50x200 pseudo-terminal, input history at `history`."""
    env = dict(os.environ, SPECRUN_HISTORY=str(history), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    return pexpect.spawn(SPECRUN, ["chat", "-m", "smollm2-135m-instruct", *args], env=env, encoding="utf-8",
                         dimensions=(50, 200))


@pytest.mark.slow
def test_terminal_session(tmp_path, smollm_path):
    hist = tmp_path / "history"
    child = terminal_chat(hist, "--temp", "0", "-n", "400")   # the dragon story outlasts its ^C
    try:
        s = Screen(child)
        s.wait(r"chatting with SmolLM2-135M-Instruct\.Q4_1\.gguf; /help for commands")
        s.wait(">")
        child.sendline("Hi")
        s.wait(r"Hi\n")
        answer = s.wait(r"(.+)\n\[\d+ tokens, [\d.]+ tokens/s \| prompt 31 new \+ 0 cached\]\n").group(1)
        assert answer.startswith("Hello")
        s.wait(">")
        child.sendline("What is the capital of France?")
        s.wait(r"France\?\n")
        cached = int(s.wait(r"\| prompt \d+ new \+ (\d+) cached").group(1))
        assert cached > 31                              # turn 1's prompt and answer came from the cache
        s.wait(">")
        child.sendline("/help")
        s.wait(r"/spec TYPE +switch the speculative decoding type")
        s.wait(">")
        child.sendline("Tell me a long story about a dragon.")
        s.wait(r"dragon\.\n")
        s.wait(r"\w\w")                                 # the answer has begun: stop it
        child.sendintr()
        s.wait(r"\[\d+ tokens, .*\| interrupted\]")
        s.wait(">")
        child.sendline("/stats")
        s.wait(r"session: 3 answers, prompt eval \d+ tokens \(\d+ reused from the KV cache\)")
        s.wait(">")
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=60)
        child.close()
        assert child.exitstatus == 0
    finally:
        if child.isalive():
            child.kill(9)
    lines = [ln[1:] for ln in hist.read_text().splitlines() if ln.startswith("+")]
    assert lines == ["Hi", "What is the capital of France?", "/help", "Tell me a long story about a dragon.",
                     "/stats", "/exit"]


@pytest.mark.slow
def test_terminal_paste_continuation_ctrl_c_at_the_prompt_and_ctrl_d(tmp_path, smollm_path):
    child = terminal_chat(tmp_path / "h", "-n", "2", "-q")
    saved = tmp_path / "c.json"
    try:
        s = Screen(child)
        s.wait(">")                                              # -q: no welcome line
        child.send("\x1b[200~Say yes.\nOr no.\x1b[201~")      # a bracketed paste of two lines: one message
        s.wait("Or no.")
        child.send("\r")
        s.wait(">")
        child.sendline("line one \\")                           # a trailing backslash continues the message
        s.wait(r"\.\.\.")
        child.sendline("line two")
        s.wait(">")
        child.send("half a line")
        s.wait("half a line")
        child.sendintr()                                         # clears the line, the session stays
        s.wait(">")
        child.sendline("dropped \\")
        s.wait(r"\.\.\.")
        child.send("and this")
        s.wait("and this")
        child.sendintr()                                         # drops the continued message: a fresh prompt
        s.wait(">")
        child.sendline(f"/save {saved}")
        s.wait("saved 4 messages")
        s.wait(">")
        child.sendeof()
        child.expect(pexpect.EOF, timeout=60)
        child.close()
        assert child.exitstatus == 0
    finally:
        if child.isalive():
            child.kill(9)
    users = [m["content"] for m in json.loads(saved.read_text())["messages"] if m["role"] == "user"]
    assert users == ["Say yes.\nOr no.", "line one \nline two"]


@pytest.mark.slow
def test_terminal_p_with_a_chat_template_goes_on_chatting_with_regen_and_clear(tmp_path, smollm_path):
    """On a terminal, `specrun -m MODEL -p ...` answers -p in the chat template, then the
    conversation goes on, as llama-cli's; /regen answers again, /clear forgets."""
    env = dict(os.environ, SPECRUN_HISTORY=str(tmp_path / "h"), PROMPT_TOOLKIT_NO_CPR="1", TERM="xterm")
    child = pexpect.spawn(SPECRUN, ["-m", "smollm2-135m-instruct", "-p", "Hi", "--temp", "0", "-n", "8"], env=env,
                          encoding="utf-8", dimensions=(50, 200))
    saved = tmp_path / "c.json"
    try:
        s = Screen(child)
        s.wait(r"conversation mode, as SmolLM2-135M-Instruct\.Q4_1\.gguf has a chat template: the prompt is the "
               r"first user message; -no-cnv for a raw completion")
        answer = s.wait(r"(Hello.*)\n\[8 tokens, .*\| prompt 31 new \+ 0 cached \| stopped at -n\]").group(1)
        s.wait(">")
        child.sendline("/help")
        s.wait(r"/regen +drop the last answer and generate it again")
        s.wait(r"/clear +forget the conversation, keep the system prompt")
        s.wait(">")
        child.sendline("/regen")
        again = s.wait(r"(Hello.*)\n\[8 tokens, .*\| prompt 1 new \+ 30 cached \| stopped at -n\]").group(1)
        assert again == answer
        s.wait(">")
        child.sendline("/clear")
        s.wait("conversation cleared")
        s.wait(">")
        child.sendline(f"/save {saved}")
        s.wait("saved 0 messages")
        s.wait(">")
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=60)
        child.close()
        assert child.exitstatus == 0
    finally:
        if child.isalive():
            child.kill(9)


@pytest.mark.slow
def test_terminal_history_path_that_is_a_folder_falls_back_in_one_line(tmp_path, smollm_path):
    """touch() accepts a folder, and prompt_toolkit then printed a traceback at every prompt."""
    child = terminal_chat(tmp_path, "-n", "2", "-q")
    try:
        s = Screen(child)
        s.wait(rf"no input history: cannot write {re.escape(str(tmp_path))} \(")
        s.wait(">")
        child.sendline("/exit")
        child.expect(pexpect.EOF, timeout=60)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in s.text
    finally:
        if child.isalive():
            child.kill(9)
