"""Request and response bodies of `specrun serve` (pydantic; they make the published OpenAPI schema).

Requests are strict (no "5" for 5, no NaN) and ignore fields they do not know, as OpenAI clients
send a few (`user`, `frequency_penalty`...) that this server does not implement. A field left out
(or null) takes the server's default, which is the command line's (`--temp`, `-n`, `--spec-type`...).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_SEED = 0xFFFFFFFF  # LLAMA_DEFAULT_SEED: a random seed, as -1 is


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class Speculative(_Body):
    """Per-request speculative decoding (llama.cpp's --spec-* options). The output does not depend
    on it: only how fast it comes."""

    type: str | None = Field(None, description="comma-separated spec types: none, ngram-simple, draft-simple "
                             "(alias draft), draft-mtp; only those the server can build (GET /v1/models lists "
                             "them). Default: the server's --spec-type", examples=["ngram-simple"])
    n_max: int | None = Field(None, ge=1, le=62, description="most tokens drafted per step")
    n_min: int | None = Field(None, ge=0, le=62, description="drafts shorter than this are not verified")
    p_min: float | None = Field(None, ge=0.0, le=1.0, description="stop drafting below this top-1 probability")


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    model: str | None = Field(None, description="ignored: the server serves one model")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0: greedy")
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0, description="llama.cpp extension; 0: the whole vocabulary")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="llama.cpp extension")
    seed: int | None = Field(None, ge=-1, le=MAX_SEED, description="-1 or 4294967295: random")
    stop: str | list[str] | None = Field(None, description="up to 4 strings; the text ends before the first one")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="choices per request (only 1)")
    speculative: Speculative | None = None


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] = Field(description="text, a list of one text, or token ids")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most (default: the server's -n)")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")


class LlamaCompletionRequest(_Body):
    """POST /completion, llama-server's own endpoint."""

    prompt: str | list[int]
    n_predict: int | None = Field(None, ge=-1, description="-1: until end of generation or a full context")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-1, le=MAX_SEED)
    stop: list[str] | None = None
    stream: bool = False
    cache_prompt: bool = Field(True, description="accepted for compatibility; the slot's KV cache is always reused")
    speculative: Speculative | None = None


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


class CompletionChoice(BaseModel):
    text: str
    index: int
    logprobs: None = None
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


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
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
