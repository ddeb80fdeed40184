"""Request and response bodies of `specrun serve` (pydantic; they make the published OpenAPI schema).

Requests are strict (no "5" for 5, no NaN) and ignore fields they do not know, as OpenAI clients
send a few (`user`, `metadata`...) that change nothing here. Fields that would change the answer
and are not implemented (`tools`, tool messages, `n_probs`, `echo`, `suffix`, `audio`...) are refused with a 400 naming them
unless they hold their neutral value, never ignored. The logit controls (penalties, `logit_bias`,
`ignore_eos`, `grammar`, `json_schema`, `response_format` json_object / json_schema) are applied
in every verify row as in plain decoding, so the answer does not depend on speculation.
A field left out (or null) takes the server's default,
which is the command line's (`--temp`, `-n`, `--spec-type`...). Every text must be Unicode: a lone
UTF-16 surrogate (a JSON escape \\ud800 without its pair) is a 400 naming the field.
"""

from __future__ import annotations

import json
import math
import re
from typing import Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError, core_schema

from specrun.kernels.params import IN_ORDER, spelled

from .limits import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TEXTS

MAX_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed, as -1 is
INT32_MAX = 2**31 - 1  # llama-server's bound on repeat_last_n


def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "unencodable_text", f"the text holds a lone UTF-16 surrogate (U+{ord(s[e.start]):04X} at character "
            f"{e.start}), which is not Unicode; send UTF-8 text, with surrogate escapes only in pairs") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]

LIST_CHUNK = 1 << 13   # items of a long list validated in one call (pydantic holds the GIL through a call)
_KNOWN_ERRORS = frozenset(get_args(core_schema.ErrorType))


def chunked(item: Any) -> Any:
    """list[item] (strict), a long one validated LIST_CHUNK items per call, so that a list of
    millions (token ids) lets the event loop run between its chunks. The value and the errors are
    list[item]'s, placed in the whole list; a long list stops at its first chunk with errors."""
    adapter = TypeAdapter(list[item], config=ConfigDict(strict=True))

    def validate(v: Any, handler) -> Any:
        if not isinstance(v, list) or len(v) <= LIST_CHUNK:
            return handler(v)
        out: list = []
        for i in range(0, len(v), LIST_CHUNK):
            try:
                out += adapter.validate_python(v[i:i + LIST_CHUNK])
            except ValidationError as e:
                raise _shifted(e, i) from None
        return out

    return Annotated[list[item], WrapValidator(validate)]


def chunked_dict(value: Any) -> Any:
    """dict[str, value] (strict), a long one validated LIST_CHUNK entries per call (as chunked)."""
    adapter = TypeAdapter(dict[str, value], config=ConfigDict(strict=True))

    def validate(v: Any, handler) -> Any:
        if not isinstance(v, dict) or len(v) <= LIST_CHUNK:
            return handler(v)
        items, out = list(v.items()), {}
        for i in range(0, len(items), LIST_CHUNK):
            out.update(adapter.validate_python(dict(items[i:i + LIST_CHUNK])))
        return out

    return Annotated[dict[str, value], WrapValidator(validate)]


def _shifted(e: ValidationError, offset: int) -> ValidationError:
    """e's errors, their list index moved by offset."""
    def detail(err: dict) -> dict:
        kind = err["type"] if err["type"] in _KNOWN_ERRORS else PydanticCustomError(err["type"], err["msg"])
        return {"type": kind, "loc": (err["loc"][0] + offset, *err["loc"][1:]), "input": err["input"],
                **({"ctx": err["ctx"]} if "ctx" in err else {})}

    return ValidationError.from_exception_data(e.title, [detail(err) for err in e.errors(include_url=False)])


TokenIds = chunked(int)


def unsupported(field: str, why: str, *, named: bool = False) -> PydanticCustomError:
    """named: the message starts with field (a check of the whole body, which has no field's place)."""
    lead = f"{field}: " if named else ""
    return PydanticCustomError("unsupported_parameter", f"{lead}not supported by this server ({why}); leave {field} out")


_NO_STREAM_LOGPROBS = "log-probabilities come with the whole answer; ask without stream"
_NO_N_PROBS = "ask POST /v1/completions with logprobs instead"
_NO_POST_SAMPLING = ("log-probabilities are the model's own, before the sampler chain, as llama-server's default; "
                     "probabilities after it are not implemented")
_RAW_LOGPROBS = ("the model's raw logits at temperature 1, before the sampler chain, as llama-server reports them "
                 "without post_sampling_probs: a logit bias, penalty or grammar does not change them, so a token "
                 "they forbid can be among the likeliest; the same with any speculative setting")
_NO_TOOLS = "it has no tool calling"
_NO_ECHO = "the answer holds the generated text only, without the prompt's log-probabilities; prepend the prompt yourself"
_NO_SUFFIX = "it has no fill-in-the-middle: the text is generated after the prompt only"
_NO_BEST_OF = "one answer per request, as n"
_NO_AUDIO = "it answers in text only"
_RESPONSE_FORMAT = ('{"type": "text"} (plain text), {"type": "json_object"} (any JSON object, or the one of '
                    'its "schema") or {"type": "json_schema", "json_schema": {"schema": {...}}}')
RESPONSE_TYPES = ("text", "json_object", "json_schema")


def _response_format(v: dict | None) -> dict | None:
    if v is not None:
        t = v.get("type", "text")
        if t not in RESPONSE_TYPES:
            raise PydanticCustomError("invalid_value", f"response_format type must be text, json_object or "
                                      f"json_schema, not {t!r}: {_RESPONSE_FORMAT}")
        inner = v.get("json_schema") if t == "json_schema" else v
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if (t == "json_schema" and not isinstance(inner, dict)) or (schema is not None and not isinstance(schema, dict)):
            raise PydanticCustomError("invalid_value", f"response_format: the schema must be a JSON object: "
                                      f"{_RESPONSE_FORMAT}")
    return v


_ID_KEY = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]+")   # what strtol(key, &end, 10) reads whole
_BIAS_FORMS = ('{"15043": 1.5, " Hello": false} or [[15043, 1.5], [" Hello", false]] (a text\'s bias goes to '
               'each of its tokens; false: never)')


def _bias_value(where: str, v: Any) -> float:
    """A logit_bias value: a finite number, or false (-inf: never), as llama-server's parse_bias."""
    if v is False:
        return float("-inf")
    if isinstance(v, int | float) and not isinstance(v, bool):
        try:
            if math.isfinite(float(v)):
                return float(v)
        except OverflowError:
            pass
    raise PydanticCustomError("invalid_value", f"logit_bias{where}: the bias {json.dumps(v)} is not a finite number "
                              "or false (never)")


def _bias_key(where: str, k: Any) -> int | str:
    """A logit_bias token: an id, or a non-empty text (tokenized by the server)."""
    if isinstance(k, str) and _ID_KEY.fullmatch(k):
        return int(k)
    if isinstance(k, int) and not isinstance(k, bool):
        return k
    if isinstance(k, str) and k:
        return _unicode(k)
    raise PydanticCustomError("invalid_value", f"logit_bias{where}: {json.dumps(k)} is not a token id or a non-empty "
                              "text")


def logit_bias_pairs(v: Any) -> tuple[tuple[int | str, float], ...]:
    """llama-server's logit_bias (server-schema.cpp): an object whose keys are token ids ("15043",
    read as strtol does) or texts, or an array of [token id or text, bias] pairs; a bias is a number
    or false (-inf). Returns (token id or text, bias) pairs in order. What llama-server skips
    silently (a malformed pair, a bias of true or null, a float id) is a PydanticCustomError here,
    and so is a logit_bias above the server's limits (limits.py: entries, and texts to tokenize)."""
    if isinstance(v, dict | list) and len(v) > MAX_LOGIT_BIAS:
        raise PydanticCustomError("invalid_value", f"{len(v)} entries, above this server's limit of "
                                  f"{MAX_LOGIT_BIAS}; bias fewer tokens")
    if isinstance(v, dict):
        items = [(f"[{json.dumps(k)}]", k, b) for k, b in v.items()]
    elif isinstance(v, list):
        items = []
        for i, pair in enumerate(v):
            if not isinstance(pair, list) or len(pair) != 2:
                raise PydanticCustomError("invalid_value", f"logit_bias[{i}]: {json.dumps(pair)} is not a "
                                          f"[token, bias] pair; give {_BIAS_FORMS}")
            items.append((f"[{i}]", pair[0], pair[1]))
    else:
        raise PydanticCustomError("invalid_value", f"logit_bias must be an object or an array: {_BIAS_FORMS}")
    pairs = tuple((_bias_key(w, k), _bias_value(w, b)) for w, k, b in items)
    n_texts = sum(isinstance(k, str) for k, _ in pairs)
    if n_texts > MAX_LOGIT_BIAS_TEXTS:
        raise PydanticCustomError("invalid_value", f"{n_texts} texts to tokenize, above this server's limit of "
                                  f"{MAX_LOGIT_BIAS_TEXTS}; give token ids (POST /tokenize turns texts into ids)")
    return pairs


def _logit_bias(v: Any) -> Any:
    if v is not None:
        logit_bias_pairs(v)
    return v


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class Speculative(_Body):
    """Per-request speculative decoding (llama.cpp's --spec-* options). The output does not depend
    on it: only how fast it comes."""

    type: Text | None = Field(None, description=f"comma-separated spec types: none, {spelled(IN_ORDER)}; only "
                             "those the server can build (GET /v1/models lists them). Default: the server's "
                             "--spec-type", examples=["ngram-simple"])
    # bounded by the server's cap for model drafters (state.py: a 400 that names it); n-gram drafts by their own flags
    n_max: int | None = Field(None, ge=1, le=1024, description="most tokens drafted per step by a draft model, "
                              "EAGLE-3 or MTP heads (at most the server's cap: spec_n_max_cap in GET /v1/models)")
    n_min: int | None = Field(None, ge=0, le=62, description="drafts shorter than this are not verified")
    p_min: float | None = Field(None, ge=0.0, le=1.0, description="stop drafting below this top-1 probability")


class StreamOptions(_Body):
    include_usage: bool = False


class _Controls(_Body):
    """llama.cpp's logit controls (its sampler's logit bias, penalties and grammar), applied to every
    row the target computes with the state of the tokens before it: the answer is plain decoding's
    with any speculative setting. Left out: the server's command line (--repeat-penalty, --grammar...)."""

    frequency_penalty: float | None = Field(None, description="subtract count x this from the logit of each token "
                                            "in the last repeat_last_n (0: off)")
    presence_penalty: float | None = Field(None, description="subtract this from the logit of each token in the "
                                           "last repeat_last_n (0: off)")
    repeat_penalty: float | None = Field(None, gt=0.0, description="llama.cpp extension: a repeated token's logit "
                                         "l > 0 becomes l / this, l <= 0 becomes l * this (1: off)")
    repeat_last_n: int | None = Field(None, ge=0, le=INT32_MAX, description="llama.cpp extension: the last tokens "
                                      "(prompt included) the penalties look at (0: off; negative: a 400, as "
                                      "llama-server)")
    logit_bias: chunked_dict(float | bool) | chunked(list[int | str | float | bool]) | None = Field(
        None, description="llama-server's: an object {\"15043\": 1.5, \" Hello\": false} or pairs [[15043, 1.5], "
        "[\" Hello\", false]]; a key that is a whole number is a token id, any other text gives its bias to each of "
        "its tokens; the bias is added to the logit (false: never, -inf)")
    ignore_eos: bool | None = Field(None, description="llama.cpp extension: never stop at end of generation")
    grammar: Text | None = Field(None, description="llama.cpp extension: a GBNF grammar the text follows")
    json_schema: dict[str, Any] | None = Field(None, description="llama.cpp extension: a JSON schema the text "
                                               "follows ({} : any JSON object)")
    response_format: dict[str, Any] | None = Field(None, description=_RESPONSE_FORMAT)
    post_sampling_probs: bool | None = Field(None, description=f"llama-server's; only false ({_NO_POST_SAMPLING})")
    id_slot: int | None = Field(None, ge=-1, le=INT32_MAX, description="llama.cpp extension: the slot that serves "
                                "the request (modulo the number of slots), waiting for it while it is busy; -1: an "
                                "idle one, the one whose cache shares the longest prefix")

    _response = field_validator("response_format")(_response_format)

    @field_validator("post_sampling_probs")
    @classmethod
    def _no_post_sampling(cls, v):
        if v:
            raise unsupported("post_sampling_probs", _NO_POST_SAMPLING)
        return v

    _bias = field_validator("logit_bias", mode="before")(_logit_bias)

    def bias_pairs(self) -> tuple[tuple[int | str, float], ...] | None:
        """logit_bias as (token id or text, bias) pairs (false is -inf); None when left out."""
        return None if self.logit_bias is None else logit_bias_pairs(self.logit_bias)

    def _grammars(self) -> list[tuple[str, str | dict]]:
        given: list[tuple[str, str | dict]] = []
        if self.grammar:
            given.append(("grammar", self.grammar))
        if self.json_schema is not None:
            given.append(("json_schema", self.json_schema or {"type": "object"}))   # {}: any object, as llama-server
        rf = self.response_format
        if rf is not None and rf.get("type", "text") != "text":
            inner = rf.get("json_schema") if rf["type"] == "json_schema" else rf
            given.append(("response_format", inner.get("schema") or {"type": "object"}))
        return given

    @model_validator(mode="before")
    @classmethod
    def _no_flat_speculative(cls, data):
        """llama-server's flat keys ("speculative.n_max": 1, which 0.3.36 compiles out and ignores): a
        400 that shows the object form, rather than a setting silently not applied."""
        if isinstance(data, dict):
            flat = sorted(k for k in data if isinstance(k, str) and k.startswith("speculative."))
            if flat:
                inner = ", ".join(f'"{k.split(".", 1)[1]}": ...' for k in flat)
                raise unsupported(flat[0], f'per-request speculative settings are an object: "speculative": {{{inner}}}',
                                  named=True)
        return data

    @model_validator(mode="after")
    def _one_grammar(self):
        given = self._grammars()
        if len(given) > 1:   # llama-server: "Cannot use both json_schema and grammar"
            raise PydanticCustomError("invalid_value", f"{' and '.join(f for f, _ in given)} both constrain the "
                                      "text: give one of them")
        return self

    def grammar_source(self) -> tuple[str, str | dict] | None:
        """(field, GBNF text or JSON schema) of the grammar asked for, or None (the server's default)."""
        given = self._grammars()
        return given[0] if given else None


class _Sampling(_Controls):
    model: Text | None = Field(None, description="ignored: the server serves one model")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0: greedy")
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="llama.cpp extension; 0: the whole vocabulary")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="llama.cpp extension")
    seed: int | None = Field(None, ge=-1, le=MAX_SEED, description="-1 or 4294967295: random")
    stop: Text | list[Text] | None = Field(None, description="up to 4 strings; the text ends before the first one")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="choices per request (only 1)")
    speculative: Speculative | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Text | chunked(Text) | TokenIds | list[TokenIds] = Field(
        description="text, a list of one text, token ids, or a list of one list of token ids")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (default: the server's -n)")
    logprobs: int | None = Field(None, ge=0, le=20, description="the log-probability of each generated token "
                                 f"and of the `logprobs` most likely tokens at its position ({_RAW_LOGPROBS}); "
                                 "not with stream")

    echo: bool | None = Field(None, description=f"only false ({_NO_ECHO})")
    suffix: Text | None = Field(None, description=f"only empty ({_NO_SUFFIX})")
    best_of: int | None = Field(None, description=f"only 1 ({_NO_BEST_OF})")

    @model_validator(mode="after")
    def _logprobs_not_streamed(self):
        if self.logprobs is not None and self.stream:
            raise unsupported("logprobs with stream", _NO_STREAM_LOGPROBS, named=True)
        return self

    @field_validator("echo", "suffix", "best_of")
    @classmethod
    def _neutral_only(cls, v, info):
        neutral = {"echo": (None, False), "suffix": (None, ""), "best_of": (None, 1)}[info.field_name]
        if v not in neutral:
            why = {"echo": _NO_ECHO, "suffix": _NO_SUFFIX, "best_of": _NO_BEST_OF}[info.field_name]
            raise unsupported(info.field_name, why)
        return v


class TextPart(_Body):
    type: Literal["text"] = Field(description="only text: image, audio and file parts are a 400 (the model reads text)")
    text: Text

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, v):
        if v != "text" and isinstance(v, str):
            raise unsupported(f"a content part of type {v!r}", "the model reads text only; send the text itself")
        return v


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"] = Field(
        description="'tool' (and 'function') messages are a 400: the server has no tool calling")
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[Any] | None = Field(None, description="not supported: a 400 unless empty")

    @field_validator("role", mode="before")
    @classmethod
    def _no_tool_role(cls, v):
        if v in ("tool", "function"):
            raise unsupported("the tool message", f"'{v}' messages carry tool results and {_NO_TOOLS}")
        return v

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v):
        if v:
            raise unsupported("tool_calls", _NO_TOOLS)
        return v


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")
    logprobs: bool | None = Field(None, description=f"the log-probability of each generated token ({_RAW_LOGPROBS}); "
                                  "not with stream")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the most likely tokens at "
                                     "each position")
    tools: list[Any] | None = Field(None, description="not supported: a 400 unless empty")
    tool_choice: str | dict[str, Any] | None = Field(None, description="only \"none\": anything else is a 400")
    functions: list[Any] | None = Field(None, description="not supported: a 400 unless empty")
    function_call: str | dict[str, Any] | None = Field(None, description="only \"none\": anything else is a 400")
    modalities: list[Text] | None = Field(None, description=f"only [\"text\"] ({_NO_AUDIO})")
    audio: dict[str, Any] | None = Field(None, description=f"not supported: a 400 unless null ({_NO_AUDIO})")

    @model_validator(mode="after")
    def _logprobs_not_streamed(self):
        if self.logprobs and self.stream:
            raise unsupported("logprobs with stream", _NO_STREAM_LOGPROBS, named=True)
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs: true")
        return self

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v, info):
        if v:
            raise unsupported(info.field_name, _NO_TOOLS)
        return v

    @field_validator("modalities")
    @classmethod
    def _text_only(cls, v):
        if v is not None and any(m != "text" for m in v):
            raise unsupported("modalities other than text", _NO_AUDIO)
        return v

    @field_validator("audio")
    @classmethod
    def _no_audio(cls, v):
        if v is not None:
            raise unsupported("audio", _NO_AUDIO)
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v, info):
        if v is not None and v != "none":
            raise unsupported(info.field_name, _NO_TOOLS)
        return v


class AnthropicBlock(_Body):
    """A content block of the Anthropic Messages API: text only."""

    type: Literal["text"] = Field(description="only text: image, document, tool_use, tool_result and thinking "
                                              "blocks are a 400 (the model reads text; the server has no tool calling)")
    text: Text
    cache_control: dict[str, Any] | None = Field(None, description="ignored: every prompt prefix is cached")

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, v):
        if v in ("tool_use", "tool_result", "server_tool_use"):
            raise unsupported(f"a content block of type {v!r}", _NO_TOOLS)
        if v != "text" and isinstance(v, str):
            raise unsupported(f"a content block of type {v!r}", "the model reads text only; send the text itself")
        return v


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Text | list[AnthropicBlock]


def _block_text(content: str | list[AnthropicBlock]) -> str:
    """A text, or the text of its blocks, joined."""
    return content if isinstance(content, str) else "".join(b.text for b in content)


class MessagesRequest(_Controls):
    """POST /v1/messages (Anthropic's Messages API, as llama-server serves it): the conversation
    through the model's chat template; a final assistant message is continued (prefill)."""

    model: Text | None = Field(None, description="ignored: the server serves one model")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (Anthropic requires it; "
                                                           "default: the server's -n)")
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Text | list[AnthropicBlock] | None = Field(None, description="the system prompt")
    stop_sequences: list[Text] | None = Field(None, description="up to 4 strings; the text ends before the first one")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0: greedy")
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="llama.cpp extension")
    seed: int | None = Field(None, ge=-1, le=MAX_SEED, description="llama.cpp extension; -1: random")
    stream: bool = False
    metadata: dict[str, Any] | None = Field(None, description="ignored")
    tools: list[Any] | None = Field(None, description="not supported: a 400 unless empty")
    tool_choice: dict[str, Any] | None = Field(None, description='only {"type": "none"}: anything else is a 400')
    thinking: dict[str, Any] | None = Field(None, description='only {"type": "disabled"}: the server has no '
                                                              "reasoning budget")
    speculative: Speculative | None = None

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v):
        if v:
            raise unsupported("tools", _NO_TOOLS)
        return v

    # the one "type" each of these objects may have here, and why
    _ONLY_TYPE: ClassVar[dict[str, tuple[str, str]]] = {
        "tool_choice": ("none", _NO_TOOLS),
        "thinking": ("disabled", "it has no extended-thinking budget; the model answers as its chat template "
                                 "makes it")}

    @field_validator("tool_choice", "thinking")
    @classmethod
    def _only_type(cls, v, info):
        allowed, why = cls._ONLY_TYPE[info.field_name]
        if v is not None and v.get("type") != allowed:
            raise unsupported(info.field_name, why)
        return v

    def chat(self) -> list[dict]:
        """The conversation as chat-template messages: the system prompt first."""
        system = [{"role": "system", "content": _block_text(self.system)}] if self.system else []
        return system + [{"role": m.role, "content": _block_text(m.content)} for m in self.messages]


class LlamaCompletionRequest(_Controls):
    """POST /completion, llama-server's own endpoint."""

    prompt: Text | TokenIds
    n_predict: int | None = Field(None, ge=-1, description="-1: until end of generation or a full context")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-1, le=MAX_SEED)
    stop: list[Text] | None = None
    stream: bool = False
    cache_prompt: bool = Field(True, description="reuse the longest prefix of the prompt that the slot's KV cache holds; "
                               "false: evaluate the whole prompt (llama-server's cache_prompt)")
    speculative: Speculative | None = None
    n_probs: int | None = Field(None, description=f"only 0: more is a 400 ({_NO_N_PROBS})")
    logprobs: int | None = Field(None, description=f"llama-server's other name of n_probs: only 0 ({_NO_N_PROBS})")

    @field_validator("n_probs", "logprobs")
    @classmethod
    def _no_probs(cls, v, info):
        if v:
            raise unsupported(info.field_name, _NO_N_PROBS)
        return v


class TokenizeRequest(_Body):
    """POST /tokenize, llama-server's."""

    content: Text | chunked(Text | int) = Field(description="a text, or texts and token ids mixed (ids kept as they are)")
    add_special: bool = Field(False, description="add the model's BOS (and EOS) as a prompt gets them")
    parse_special: bool = Field(True, description="read special-token texts ('<|im_end|>') as those tokens")
    with_pieces: bool = Field(False, description="each token as {id, piece}: its text, or its bytes when they "
                              "are not UTF-8 on their own")


class DetokenizeRequest(_Body):
    """POST /detokenize, llama-server's."""

    tokens: TokenIds = Field(description="token ids; control tokens are spelled out ('<|im_end|>')")


# ---- responses (documentation: handlers return plain JSON) -----------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    prompt_n: int = Field(description="prompt tokens evaluated (not reused from the slot's KV cache)")
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int = Field(description="draft tokens sent to the target")
    draft_n_accepted: int
    drafts: int = Field(description="drafts (proposals of one or more tokens) verified")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings


class LlamaCompletion(BaseModel):
    content: str
    tokens: list[int]
    id_slot: int
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    stop_type: Literal["eos", "limit", "word", "none"]
    stopping_word: str
    tokens_cached: int
    truncated: bool
    generation_settings: dict
    timings: Timings


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    meta: dict


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    slots_idle: int
    slots_processing: int


class AnthropicTextOut(BaseModel):
    type: Literal["text"]
    text: str


class AnthropicUsage(BaseModel):
    input_tokens: int = Field(description="prompt tokens evaluated (not read from the slot's KV cache)")
    cache_read_input_tokens: int = Field(description="prompt tokens reused from the slot's KV cache")
    output_tokens: int


class AnthropicMessageOut(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[AnthropicTextOut]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence"]
    stop_sequence: str | None
    usage: AnthropicUsage


class InputTokens(BaseModel):
    input_tokens: int
    object: str | None = None
