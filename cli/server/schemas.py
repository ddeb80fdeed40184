"""Request and response bodies of `specrun serve` (pydantic; they make the published OpenAPI schema).

Requests are strict (no "5" for 5, no NaN) and ignore fields they do not know, as OpenAI clients
send a few (`user`, `metadata`...) that change nothing here. Fields that would change the answer
and are not implemented (penalties, `logit_bias`, `tools`, `response_format`, tool messages...)
are refused with a 400 naming them unless they hold their neutral value, never ignored. A field left out (or null) takes the server's default,
which is the command line's (`--temp`, `-n`, `--spec-type`...). Every text must be Unicode: a lone
UTF-16 surrogate (a JSON escape \\ud800 without its pair) is a 400 naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

MAX_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed, as -1 is


def _unicode(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError(
            "unencodable_text", f"the text holds a lone UTF-16 surrogate (U+{ord(s[e.start]):04X} at character "
            f"{e.start}), which is not Unicode; send UTF-8 text, with surrogate escapes only in pairs") from None
    return s


Text = Annotated[str, AfterValidator(_unicode)]


def unsupported(field: str, why: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", f"not supported by this server ({why}); leave {field} out")


_NO_STREAM_LOGPROBS = "log-probabilities come with the whole answer; ask without stream"
_NO_N_PROBS = "ask POST /v1/completions with logprobs instead"
_NO_PENALTIES = "the sampler has no penalties or logit bias yet"
_NO_TOOLS = "it has no tool calling"
_NO_GRAMMAR = "it generates plain text only, without constrained decoding"
_TEXT_ONLY = 'only {"type": "text"}: anything else (JSON mode, a schema) is a 400'


def _plain_text(v: dict | None) -> dict | None:
    if v is not None and v.get("type", "text") != "text":
        raise unsupported("response_format", _NO_GRAMMAR)
    return v


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class Speculative(_Body):
    """Per-request speculative decoding (llama.cpp's --spec-* options). The output does not depend
    on it: only how fast it comes."""

    type: Text | None = Field(None, description="comma-separated spec types: none, ngram-simple, draft-simple "
                             "(alias draft), draft-mtp; only those the server can build (GET /v1/models lists "
                             "them). Default: the server's --spec-type", examples=["ngram-simple"])
    n_max: int | None = Field(None, ge=1, le=62, description="most tokens drafted per step")
    n_min: int | None = Field(None, ge=0, le=62, description="drafts shorter than this are not verified")
    p_min: float | None = Field(None, ge=0.0, le=1.0, description="stop drafting below this top-1 probability")


class StreamOptions(_Body):
    include_usage: bool = False


class _NoPenalties(_Body):
    """The sampler's penalties and logit bias, accepted only at their neutral values."""

    frequency_penalty: float | None = Field(None, description=f"only 0 ({_NO_PENALTIES})")
    presence_penalty: float | None = Field(None, description=f"only 0 ({_NO_PENALTIES})")
    repeat_penalty: float | None = Field(None, description=f"llama.cpp extension; only 1 ({_NO_PENALTIES})")
    logit_bias: dict[str, float] | None = Field(None, description=f"only empty ({_NO_PENALTIES})")

    @field_validator("frequency_penalty", "presence_penalty", "repeat_penalty", "logit_bias")
    @classmethod
    def _neutral_only(cls, v, info):
        neutral = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repeat_penalty": 1.0}.get(info.field_name)
        if v is not None and v != neutral and v != {}:
            raise unsupported(info.field_name, _NO_PENALTIES)
        return v


class _Sampling(_NoPenalties):
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
    response_format: dict[str, Any] | None = Field(None, description=_TEXT_ONLY)

    _text_only = field_validator("response_format")(_plain_text)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Text | list[Text] | list[int] = Field(description="text, a list of one text, or token ids")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (default: the server's -n)")
    logprobs: int | None = Field(None, ge=0, le=20, description="the log-probability of each generated token "
                                 "under the model (raw logits, the same with any speculative setting) and of the "
                                 "`logprobs` most likely tokens at its position; not with stream")

    @model_validator(mode="after")
    def _logprobs_not_streamed(self):
        if self.logprobs is not None and self.stream:
            raise unsupported("logprobs with stream", _NO_STREAM_LOGPROBS)
        return self


class TextPart(_Body):
    type: Literal["text"]
    text: Text


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
    logprobs: bool | None = Field(None, description="the log-probability of each generated token under the model "
                                  "(raw logits, the same with any speculative setting); not with stream")
    top_logprobs: int | None = Field(None, ge=0, le=20, description="with logprobs: the most likely tokens at "
                                     "each position")
    tools: list[Any] | None = Field(None, description="not supported: a 400 unless empty")
    tool_choice: str | dict[str, Any] | None = Field(None, description="only \"none\": anything else is a 400")
    functions: list[Any] | None = Field(None, description="not supported: a 400 unless empty")
    function_call: str | dict[str, Any] | None = Field(None, description="only \"none\": anything else is a 400")

    @model_validator(mode="after")
    def _logprobs_not_streamed(self):
        if self.logprobs and self.stream:
            raise unsupported("logprobs with stream", _NO_STREAM_LOGPROBS)
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("invalid_value", "top_logprobs needs logprobs: true")
        return self

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v, info):
        if v:
            raise unsupported(info.field_name, _NO_TOOLS)
        return v

    @field_validator("tool_choice", "function_call")
    @classmethod
    def _no_tool_choice(cls, v, info):
        if v is not None and v != "none":
            raise unsupported(info.field_name, _NO_TOOLS)
        return v


class LlamaCompletionRequest(_NoPenalties):
    """POST /completion, llama-server's own endpoint."""

    prompt: Text | list[int]
    n_predict: int | None = Field(None, ge=-1, description="-1: until end of generation or a full context")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-1, le=MAX_SEED)
    stop: list[Text] | None = None
    stream: bool = False
    cache_prompt: bool = Field(True, description="accepted for compatibility; the slot's KV cache is always reused")
    speculative: Speculative | None = None
    n_probs: int | None = Field(None, description=f"only 0: more is a 400 ({_NO_N_PROBS})")
    grammar: Text | None = Field(None, description="not supported: a 400 unless empty")
    json_schema: dict[str, Any] | None = Field(None, description="not supported: a 400 unless empty")
    response_format: dict[str, Any] | None = Field(None, description=_TEXT_ONLY)

    @field_validator("n_probs")
    @classmethod
    def _no_probs(cls, v):
        if v:
            raise unsupported("n_probs", _NO_N_PROBS)
        return v

    @field_validator("grammar", "json_schema")
    @classmethod
    def _no_grammar(cls, v, info):
        if v:
            raise unsupported(info.field_name, _NO_GRAMMAR)
        return v

    _text_only = field_validator("response_format")(_plain_text)


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
