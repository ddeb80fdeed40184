"""The chat core shared by the REPL (`specrun chat`) and the server's chat endpoint.

ChatFormat turns messages into prompt tokens with the model's chat template (one BOS rule) and
knows the template's turn-stop tokens. ChatSession is a conversation over one engine: each turn
renders the whole conversation and hands the tokens to the engine, which evaluates only what its
KV cache does not hold yet. To keep the cache reusable, the tokens of the history are the ones the
model actually produced: when the new render extends the text of the history (the usual case),
only the new text is tokenized and appended to them.

    turn 1: [render(u1) -> tokens P1] + answer tokens A1 (incl. its end-of-turn token)
    turn 2: P1 + A1 + tokenize(render(u1, a1, u2)[len(render(u1) + a1 + eot):])
            -> the engine evaluates the last token of A1 (sampled, never decoded) + the delta
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.chat_template import ChatTemplate, TemplateError, template_for
from specrun.kernels.engine import Engine
from specrun.kernels.llama import Model
from specrun.kernels.params import parse_spec_types
from specrun.kernels.stats import GenStats
from specrun.kernels.types import SamplingParams, Stops

from .text import TextRun

ROLES = ("system", "user", "assistant")

_ANSWER, _USER = "\x1fspecrun-answer\x1f", "\x1fspecrun-user\x1f"


class ContextFull(SpecrunError):
    """A message that does not fit the context even with every earlier turn dropped."""


@dataclass(frozen=True, slots=True)
class ChatFormat:
    """A chat template bound to a model: messages -> prompt text -> tokens, with one BOS rule for
    every front end, and the turn-stop tokens that end an answer."""

    template: ChatTemplate
    model: Model
    stop_tokens: frozenset[int]

    @classmethod
    def of(cls, template: ChatTemplate, model: Model) -> ChatFormat:
        """Binds template to model. raises TemplateError when the template cannot render a
        two-turn probe conversation (checked at start, so no request is blamed for it later)."""
        return cls(template, model, _turn_stop_tokens(template, model))

    @classmethod
    def load(cls, model: Model, override: str | None = None, file: str | None = None) -> ChatFormat:
        """The model's own template; or override (--chat-template): one of llama.cpp's built-in
        names, Jinja text, or a file path; or file (--chat-template-file)."""
        return cls.of(chat_template(model, override, file), model)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        """A whole rendered prompt -> tokens: the model's BOS is added (when it adds one) unless
        the template already wrote it."""
        bos = self.template.bos_token
        add = not (bos and text.startswith(bos))
        return [int(t) for t in self.model.tokenize(text, add_special=add)]

    def prompt(self, messages: list[dict]) -> tuple[list[int], str]:
        """The tokens and text of messages rendered with the generation prompt."""
        text = self.render(messages)
        return self.tokenize(text), text


# ---- llama.cpp's built-in templates (src/llama-chat.cpp, llm_chat_apply_template) as Jinja ---------

def _turns(system: tuple[str, str], user: tuple[str, str], assistant: tuple[str, str], gen: str = "", *,
           trim: bool = False, head: str = "") -> str:
    """Jinja for a template that writes head, then each message as before + content + after by its
    role, then gen when a generation prompt is asked for."""
    c = "(m.content | trim)" if trim else "m.content"
    out = [f"{{{{ {head!r} }}}}" if head else "", "{%- for m in messages -%}"]
    for i, (role, (before, after)) in enumerate((("system", system), ("user", user), ("assistant", assistant))):
        out.append(f"{{%- {'el' * (i > 0)}if m.role == {role!r} -%}}{{{{ {before!r} + {c} + {after!r} }}}}")
    out.append(f"{{%- endif -%}}{{%- endfor -%}}{{%- if add_generation_prompt -%}}{{{{ {gen!r} }}}}{{%- endif -%}}")
    return "".join(out)


def _tags(open_: str, close: str, gen: str, **kw) -> str:
    """Each message as open_ (with {role}) + content + close (ChatML and its relatives)."""
    return _turns(*((open_.format(role=r), close) for r in ("system", "user", "assistant")), gen, **kw)


def _llama2(system: bool, bos_inside: bool, strip: bool) -> str:
    c = "(m.content | trim)" if strip else "m.content"
    sys_ = "'<<SYS>>\\n' + c + '\\n<</SYS>>\\n\\n'" if system else "c + '\\n'"
    again = "<s>[INST] " if bos_inside else "[INST] "
    return ("{%- set ns = namespace(inside=true) -%}{{ '[INST] ' }}{%- for m in messages -%}"
            f"{{%- set c = {c} -%}}"
            f"{{%- if not ns.inside -%}}{{%- set ns.inside = true -%}}{{{{ {again!r} }}}}{{%- endif -%}}"
            f"{{%- if m.role == 'system' -%}}{{{{ {sys_} }}}}"
            "{%- elif m.role == 'user' -%}{{ c + ' [/INST]' }}"
            "{%- else -%}{{ c + '</s>' }}{%- set ns.inside = false -%}{%- endif -%}{%- endfor -%}")


def _mistral(lead: str, trail: str, trim_answer: bool) -> str:
    answer = "(m.content | trim)" if trim_answer else "m.content"
    return ("{%- set ns = namespace(inside=false) -%}{%- for m in messages -%}"
            f"{{%- if not ns.inside -%}}{{{{ {lead + '[INST]' + trail!r} }}}}{{%- set ns.inside = true -%}}{{%- endif -%}}"
            "{%- if m.role == 'system' -%}{{ m.content + '\\n\\n' }}"
            f"{{%- elif m.role == 'user' -%}}{{{{ m.content + {lead + '[/INST]'!r} }}}}"
            f"{{%- else -%}}{{{{ {trail!r} + {answer} + '</s>' }}}}{{%- set ns.inside = false -%}}{{%- endif -%}}"
            "{%- endfor -%}")


_GEMMA = ("{%- set ns = namespace(sys='') -%}{%- for m in messages -%}"
          "{%- if m.role == 'system' -%}{%- set ns.sys = ns.sys + (m.content | trim) -%}"
          "{%- else -%}{%- set role = 'model' if m.role == 'assistant' else m.role -%}"
          "{{ '<start_of_turn>' + role + '\\n' }}"
          "{%- if ns.sys and role != 'model' -%}{{ ns.sys + '\\n\\n' }}{%- set ns.sys = '' -%}{%- endif -%}"
          "{{ (m.content | trim) + '<end_of_turn>\\n' }}{%- endif -%}{%- endfor -%}"
          "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}")

_RWKV = ("{%- for m in messages -%}{%- set c = m.content | trim -%}"
         "{%- if m.role == 'system' -%}{{ 'System: ' + c + '\\n\\n' }}"
         "{%- elif m.role == 'user' -%}{{ 'User: ' + c + '\\n\\n' }}{%- if loop.last -%}{{ 'Assistant:' }}{%- endif -%}"
         "{%- else -%}{{ 'Assistant: ' + c + '\\n\\n' }}{%- endif -%}{%- endfor -%}")

_MONARCH = ("{%- for m in messages -%}{{ ('' if loop.first else '<s>') + m.role + '\\n' + m.content + '</s>\\n' }}"
            "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<s>assistant\\n' }}{%- endif -%}")

_EOS_DS = "<\uff5cend\u2581of\u2581sentence\uff5c>"
_GRANITE = _tags("<|start_of_role|>{role}<|end_of_role|>", "<|end_of_text|>\n", "<|start_of_role|>assistant<|end_of_role|>")
_EXAONE = _turns(("[|system|]", "[|endofturn|]\n"), ("[|user|]", "\n"), ("[|assistant|]", "[|endofturn|]\n"),
                 "[|assistant|]", trim=True)

BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": _tags("<|im_start|>{role}\n", "<|im_end|>\n", "<|im_start|>assistant\n"),
    "llama2": _llama2(system=False, bos_inside=False, strip=False),
    "llama2-sys": _llama2(system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _llama2(system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _llama2(system=True, bos_inside=False, strip=True),
    "mistral-v1": _mistral(" ", " ", False),
    "mistral-v3": _mistral("", " ", True),
    "mistral-v3-tekken": _mistral("", "", False),
    "mistral-v7": _turns(("[SYSTEM_PROMPT] ", "[/SYSTEM_PROMPT]"), ("[INST] ", "[/INST]"), (" ", "</s>")),
    "mistral-v7-tekken": _turns(("[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"), ("[INST]", "[/INST]"), ("", "</s>")),
    "phi3": _tags("<|{role}|>\n", "<|end|>\n", "<|assistant|>\n"),
    "phi4": _tags("<|im_start|>{role}<|im_sep|>", "<|im_end|>", "<|im_start|>assistant<|im_sep|>"),
    "falcon3": _tags("<|{role}|>\n", "\n", "<|assistant|>\n"),
    "zephyr": _tags("<|{role}|>\n", "<|endoftext|>\n", "<|assistant|>\n"),
    "monarch": _MONARCH,
    "gemma": _GEMMA,
    "openchat": _turns(("", "<|end_of_turn|>"), ("GPT4 Correct User: ", "<|end_of_turn|>"),
                       ("GPT4 Correct Assistant: ", "<|end_of_turn|>"), "GPT4 Correct Assistant:"),
    "vicuna": _turns(("", "\n\n"), ("USER: ", "\n"), ("ASSISTANT: ", "</s>\n"), "ASSISTANT:"),
    "vicuna-orca": _turns(("SYSTEM: ", "\n"), ("USER: ", "\n"), ("ASSISTANT: ", "</s>\n"), "ASSISTANT:"),
    "deepseek": _turns(("", ""), ("### Instruction:\n", "\n"), ("### Response:\n", "\n<|EOT|>\n"), "### Response:\n"),
    "deepseek2": _turns(("", "\n\n"), ("User: ", "\n\n"), ("Assistant: ", _EOS_DS), "Assistant:"),
    "deepseek3": _turns(("", "\n\n"), ("<\uff5cUser\uff5c>", ""), ("<\uff5cAssistant\uff5c>", _EOS_DS),
                        "<\uff5cAssistant\uff5c>"),
    "command-r": _turns(("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
                        ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
                        ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
                        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", trim=True),
    "llama3": _tags("<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>",
                    "<|start_header_id|>assistant<|end_header_id|>\n\n", trim=True),
    "chatglm3": _tags("<|{role}|>\n ", "", "<|assistant|>", head="[gMASK]sop"),
    "chatglm4": _tags("<|{role}|>\n", "", "<|assistant|>\n", head="[gMASK]<sop>"),
    "glmedge": _tags("<|{role}|>\n", "", "<|assistant|>"),
    "minicpm": _turns(("", ""), ("<\u7528\u6237>", "<AI>"), ("", ""), trim=True),
    "exaone3": _EXAONE,
    "exaone4": _EXAONE,
    "exaone-moe": _tags("<|{role}|>\n", "<|endofturn|>\n", "<|assistant|>\n", trim=True),
    "rwkv-world": _RWKV,
    "granite": _GRANITE,
    "granite-4.0": _GRANITE,
    "granite-4.1": _GRANITE,
}

# every name llama.cpp 0.3.36 knows (llama_chat_builtin_templates); those above render here
LLAMA_TEMPLATE_NAMES = (
    "bailing", "bailing-think", "bailing2", "chatglm3", "chatglm4", "chatml", "command-r", "deepseek", "deepseek-ocr",
    "deepseek2", "deepseek3", "exaone-moe", "exaone3", "exaone4", "falcon3", "gemma", "gigachat", "glmedge", "gpt-oss",
    "granite", "granite-4.0", "granite-4.1", "grok-2", "hunyuan-dense", "hunyuan-moe", "hunyuan-vl", "kimi-k2",
    "llama2", "llama2-sys", "llama2-sys-bos", "llama2-sys-strip", "llama3", "llama4", "megrez", "minicpm",
    "mistral-v1", "mistral-v3", "mistral-v3-tekken", "mistral-v7", "mistral-v7-tekken", "monarch", "openchat", "orion",
    "pangu-embedded", "phi3", "phi4", "rwkv-world", "seed_oss", "smolvlm", "solar-open", "vicuna", "vicuna-orca",
    "yandex", "zephyr")


def chat_template(model: Model, override: str | None = None, file: str | None = None) -> ChatTemplate:
    """The model's own template; or --chat-template (override): one of llama.cpp's built-in names,
    Jinja text (as llama.cpp takes it), or a file path (specrun's earlier meaning); or
    --chat-template-file (file). Raises TemplateError, one line."""
    if file is not None:
        return template_for(model, file)
    if override is None:
        return template_for(model)
    if override in BUILTIN_TEMPLATES or "{{" in override or "{%" in override:
        return ChatTemplate(BUILTIN_TEMPLATES.get(override, override), model.token_text(model.bos),
                            model.token_text(model.eos))
    if override in LLAMA_TEMPLATE_NAMES:
        raise TemplateError(f"llama.cpp's built-in template '{override}' is not carried by specrun, which renders "
                            "templates with Jinja; give the model's Jinja template with --chat-template-file FILE")
    if not os.path.exists(override) and os.sep not in override and "." not in override:
        raise TemplateError(f"--chat-template {override}: not a built-in template name "
                            f"({', '.join(BUILTIN_TEMPLATES)}), Jinja text, or a file")
    return template_for(model, override)


def _turn_stop_tokens(template: ChatTemplate, model: Model) -> frozenset[int]:
    """The control tokens of the text the template puts between an answer and the next user
    message (ChatML: <|im_end|>, <|im_start|>; Gemma: <end_of_turn>, <start_of_turn>). A model
    that emits one has finished its turn, or started the next one on its own."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _ANSWER},
            {"role": "user", "content": _USER}]
    text = template.render(msgs, add_generation_prompt=False)
    template.render(msgs[:1], add_generation_prompt=True)
    i, j = text.find(_ANSWER), text.find(_USER)
    if i < 0 or j < i:
        return frozenset()
    sep = text[i + len(_ANSWER):j]
    return frozenset(int(t) for t in model.tokenize(sep, add_special=False)
                     if not model.piece(int(t)) and model.token_text(int(t)))


@dataclass(slots=True)
class SessionStats:
    """Sums over the turns of a session (the per-turn numbers are GenStats)."""

    turns: int = 0
    n_prompt: int = 0          # prompt tokens evaluated
    n_prompt_total: int = 0    # prompt tokens, reused from the KV cache or not
    n_gen: int = 0
    n_gen_steps: int = 0       # of n_gen, those after each turn's first (GenStats.n_gen_steps)
    t_prompt_s: float = 0.0
    t_gen_s: float = 0.0
    n_gen_drafts: int = 0
    n_drafted: int = 0
    n_accepted: int = 0

    def add(self, st: GenStats) -> None:
        self.turns += 1
        self.n_prompt += st.n_prompt
        self.n_prompt_total += st.n_prompt_total
        self.n_gen += st.n_gen
        self.n_gen_steps += st.n_gen_steps
        self.t_prompt_s += st.t_prompt_s
        self.t_gen_s += st.t_gen_s
        self.n_gen_drafts += sum(d.n_gen_drafts for d in st.drafters)
        self.n_drafted += st.n_drafted
        self.n_accepted += st.n_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def mean_acc_len(self) -> float:
        return 1.0 + self.n_accepted / self.n_gen_drafts if self.n_gen_drafts else 0.0

    @property
    def gen_tps(self) -> float:
        """As GenStats.gen_tps: tokens after each turn's first over the turns' generation time."""
        return self.n_gen_steps / self.t_gen_s if self.t_gen_s > 0 else 0.0

    def lines(self) -> list[str]:
        out = [f"session: {self.turns} answers, prompt eval {self.n_prompt} tokens "
               f"({self.n_prompt_total - self.n_prompt} reused from the KV cache), "
               f"generation {self.n_gen} tokens in {self.t_gen_s:.2f} s ({self.gen_tps:.2f} tokens/s)"]
        if self.n_gen_drafts:
            out.append(f"session: draft acceptance rate = {self.acceptance_rate:.5f} ({self.n_accepted} "
                       f"accepted / {self.n_drafted} generated), #mean acc len = {self.mean_acc_len:.2f}")
        return out


@dataclass(frozen=True, slots=True)
class Turn:
    """One answer. stop: eog | turn (the model began a new turn) | n_predict | ctx | interrupted."""

    text: str
    tokens: list[int]              # as generated, without a new-turn token that stopped it
    stop: str
    stats: GenStats
    n_dropped: int = 0             # oldest turns dropped to make room (context shift)


@dataclass(slots=True)
class _Checkpoint:
    text: str                      # a prefix of the conversation's render...
    tokens: list[int] = field(default_factory=list)   # ...and the tokens that stand for it


class ChatSession:
    """A conversation over one engine. send(text) yields the answer's text as it is accepted;
    afterwards self.last is the Turn (also when the caller closed the iterator early)."""

    def __init__(self, engine: Engine, template: ChatTemplate | ChatFormat, sampling: SamplingParams | None = None,
                 n_predict: int = -1, system_prompt: str | None = None) -> None:
        self.engine = engine
        self.format = template if isinstance(template, ChatFormat) else ChatFormat.of(template, engine.model)
        self.template = self.format.template
        self.sampling = sampling if sampling is not None else SamplingParams()
        self.n_predict = n_predict
        self.system = [{"role": "system", "content": system_prompt}] if system_prompt else []
        self.messages: list[dict] = list(self.system)
        self.stats = SessionStats()
        self.last: Turn | None = None
        self._checkpoints: list[_Checkpoint] = []     # longest first
        # try the template once now, so a template that cannot take this conversation fails at start
        self.format.render([*self.messages, {"role": "user", "content": "hi"}])

    @property
    def stop_tokens(self) -> frozenset[int]:
        return self.format.stop_tokens

    # -- prompt ------------------------------------------------------------------------------
    def prompt_for(self, messages: list[dict]) -> tuple[list[int], str]:
        """The tokens and text of messages rendered with the generation prompt, extending the
        tokens of the history when the render extends its text."""
        text = self.format.render(messages)
        for cp in self._checkpoints:
            if text.startswith(cp.text):
                delta = self.engine.tokenize(text[len(cp.text):], add_special=False)
                return cp.tokens + [int(t) for t in delta], text
        return self.format.tokenize(text), text

    def _reserve(self) -> int:
        n_ctx = self.engine.n_ctx
        want = self.n_predict if self.n_predict > 0 else n_ctx
        return max(1, min(want, n_ctx // 4))

    def _fit(self, messages: list[dict]) -> tuple[list[int], str, int]:
        """Drop the oldest turns (user message and its answers) until the prompt leaves room
        for an answer (_reserve), as llama-cli's context shift; the system prompt and the new
        message stay. The turn just before the new message, which a follow-up may refer to, is
        not dropped for that room: only when fewer than min(_reserve, n_ctx / 16) tokens would be
        left for the answer."""
        n_ctx, reserve, dropped = self.engine.n_ctx, self._reserve(), 0
        least = max(1, min(reserve, n_ctx // 16))
        while True:
            tokens, text = self.prompt_for(messages)
            users = [i for i, m in enumerate(messages) if m["role"] == "user"]
            room = n_ctx - len(tokens)
            if room >= reserve or (len(users) == 2 and room >= least) or (len(users) < 2 and room > 0):
                return tokens, text, dropped
            if len(users) < 2:
                raise ContextFull(f"the message does not fit in the context ({len(tokens)} tokens, "
                                  f"ctx {n_ctx}); shorten it or raise -c")
            del messages[users[0]:users[1]]
            dropped += 1

    # -- turns -------------------------------------------------------------------------------
    def send(self, text: str, on_dropped: Callable[[int], None] | None = None) -> Iterator[str]:
        """Add a user message and yield the answer's text as the engine accepts it. on_dropped(n)
        is called before the answer begins when n of the oldest turns were dropped to fit."""
        before = self.messages
        messages = [*before, {"role": "user", "content": text}]
        tokens, rendered, dropped = self._fit(messages)
        if dropped and on_dropped is not None:
            on_dropped(dropped)
        self.messages = messages
        run = TextRun(self.engine.generate(tokens, self.n_predict, self.sampling,
                                           stops=Stops.of((), self.stop_tokens)), self.engine.model,
                      stop_tokens=self.stop_tokens)
        failed = False
        try:
            yield from run
        except Exception:
            failed = True
            raise
        finally:
            run.close()
            if failed:          # an engine error: the turn did not happen
                self.messages = before
                self._checkpoints = []
            else:
                c = run.result
                self._finish(tokens, rendered, c.tokens, c.text, Turn(c.text, c.tokens, c.stop, c.stats, dropped))

    def _finish(self, tokens: list[int], rendered: str, out: list[int], answer: str, turn: Turn) -> None:
        self.messages.append({"role": "assistant", "content": answer})
        eot = self.engine.model.token_text(out[-1]) if out and self.engine.model.is_eog(out[-1]) else ""
        self._checkpoints = [_Checkpoint(rendered + answer + eot, tokens + out), _Checkpoint(rendered, tokens)]
        self.stats.add(turn.stats)
        self.last = turn

    def regen(self, on_dropped: Callable[[int], None] | None = None) -> Iterator[str]:
        """/regen: drop the last answer and answer its user message again, as send() does (the
        cache holds that message's prompt already). raises SpecrunError when the conversation does
        not end with an answer; a failed answer leaves the conversation as it was."""
        kept = self.messages
        if len(kept) < 2 or kept[-1]["role"] != "assistant" or kept[-2]["role"] != "user":
            raise SpecrunError("no answer to regenerate: the conversation does not end with one")
        self.messages = kept[:-2]
        try:
            yield from self.send(kept[-2]["content"], on_dropped)
        except Exception:
            self.messages = kept
            raise

    # -- commands ----------------------------------------------------------------------------
    def reset(self) -> None:
        self.messages = list(self.system)
        self._checkpoints = []
        self.engine.reset()

    def recover(self) -> None:
        """After a hard interrupt (an exception raised inside the engine), the KV cache may no
        longer match engine.kv_tokens: start the cache over; the conversation stays."""
        self._checkpoints = []
        self.engine.reset()

    def set_spec(self, types: str) -> str:
        spec = replace(self.engine.params.spec, types=parse_spec_types(types))
        self.engine.set_spec(spec)
        return ",".join(spec.types) or "none"

    def save(self, path: str) -> None:
        try:
            with open(path, "w", encoding="utf-8") as fh:
                json.dump({"messages": self.messages}, fh, ensure_ascii=False, indent=2)
                fh.write("\n")
        except OSError as e:
            raise SpecrunError(f"cannot write {path}: {e.strerror}") from None

    def load(self, path: str) -> int:
        """Replace the conversation with the one in path (as /save writes it); returns the
        number of messages. Nothing changes when the file is not a conversation."""
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except OSError as e:
            raise SpecrunError(f"cannot read {path}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise SpecrunError(f"{path} is not JSON ({e}); give a file written by /save") from None
        msgs = data.get("messages") if isinstance(data, dict) else data
        if not isinstance(msgs, list):
            raise SpecrunError(f"{path} holds no conversation: expected {{\"messages\": [...]}} as /save writes")
        for i, m in enumerate(msgs):
            if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
                raise SpecrunError(f"{path}: message {i} is not {{\"role\": system|user|assistant, "
                                   f"\"content\": text}}")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in msgs]
        self._checkpoints = []
        return len(self.messages)
