"""What the endpoints share: the server's settings, its slots and metrics, and the steps from a
request to a running job (validate, prepare the prompt off the event loop, take a slot).

Every step whose time grows with the request (parsing and validating the body, tokenizing,
detokenizing, compiling a grammar or a schema, rendering a large answer) runs in a worker thread,
PREPARE_THREADS at most at once (limits.py): the event loop only moves bytes, so /health and every
stream keep answering while a large request is prepared."""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

import anyio
import numpy as np
from fastapi import Request
from fastapi.responses import Response

from specrun.gguf_spec.errors import SpecrunError
from specrun.kernels.chat_template import TemplateError
from specrun.kernels.constrain import check_controls
from specrun.kernels.grammar import Grammar, GrammarError, schema_to_gbnf
from specrun.kernels.llama import MAX_EXACT_BATCH
from specrun.kernels.params import MODEL_TYPES, SpecParams, adaptive_default, parse_spec_types
from specrun.kernels.rpc import WorkerLost
from specrun.kernels.types import LLAMA_DEFAULT_SEED, SamplingParams

from ..runtime.chat import ChatFormat
from . import bulk
from .errors import ApiError, ClientGone
from .limits import MAX_GRAMMAR_BYTES, MAX_SCHEMA_BYTES, PREPARE_THREADS, kib, time_limited
from .metrics import Metrics
from .schemas import ChatRequest, Speculative
from .slots import Busy, Drained, Job, Outcome, Run, ShuttingDown, SlotPool

T = TypeVar("T")

MAX_BODY = 8 << 20            # bytes: --max-body's default
BODY_TIMEOUT_S = 10.0         # --body-timeout's default
DRAIN_TIMEOUT_S = 30.0        # --drain-timeout's default


@dataclass(frozen=True, slots=True)
class ServerConfig:
    alias: str                      # the model's name in responses and /v1/models
    sampling: SamplingParams        # defaults for fields a request leaves out
    n_predict: int                  # default max tokens; when > 0 also the most a request gets
    spec: SpecParams                # the server's --spec-* options
    spec_types: tuple[str, ...]     # what a request may name in speculative.type ("none" included)
    max_queue: int
    api_key: str | None = None
    chat_format: ChatFormat | None = None     # the chat template bound to the model (chat requests)
    no_template_reason: str = ""
    max_body: int = MAX_BODY                  # bytes of a request body; more is a 413
    body_timeout: float = BODY_TIMEOUT_S      # seconds for a request body to arrive; then a 408
    drain_timeout: float = DRAIN_TIMEOUT_S    # seconds the runs in flight get to finish on SIGTERM
    prefill_assistant: bool = True            # a final assistant message is continued (llama-server's default)
    slots_endpoint: bool = True               # GET /slots (--no-slots: 501)
    slots_debug: bool = False                 # /slots shows prompts, texts, stop strings and grammars too
    model_path: str = ""                      # /props' model_path: the -m value as typed (a path or a name)
    host: str = ""                            # --host as given: on loopback without a key, the Host header is
                                              # checked (middleware.py); "" (not known): it is not


@dataclass(frozen=True, slots=True)
class Stopped:
    """How a shutdown went (the line `specrun serve: stopped ...`)."""

    drained: Drained
    queued: int                    # waiting requests answered 503 at once
    refused: int                   # new requests answered 503 while stopping
    served: int                    # generations that ran to their end since the start

    def line(self) -> str:
        d = self.drained
        return (f"{self.served} requests answered; at the signal {d.finished} finished within the drain and "
                f"{d.interrupted} were interrupted ({d.interrupted_in_prompt} during the prompt); "
                f"{self.queued} queued and {self.refused} new requests answered 503")


class ServerState:
    """The config, the slots, the metrics, and the request -> job steps the endpoints share."""

    def __init__(self, config: ServerConfig, pool: SlotPool, metrics: Metrics) -> None:
        self.config = config
        self.pool = pool
        self.metrics = metrics
        engine = pool.slots[0].engine
        self.model = engine.model
        self.n_ctx = engine.n_ctx
        self.n_max_cap = min(s.engine.n_max_cap for s in pool.slots)
        self.exact = engine.params.exact
        self.created = int(time.time())
        self.stopping = False
        self.n_queued_refused = 0
        self.n_refused = 0
        self.limiter = anyio.CapacityLimiter(PREPARE_THREADS)   # the worker threads preparing requests
        pool.on_outcome = metrics.record

    # -- requests -> jobs ----------------------------------------------------------------------
    def sampling(self, req) -> SamplingParams:
        """The request's sampling over the server's (command-line) defaults. A grammar (GBNF,
        json_schema or a JSON response_format) is parsed here with the model's vocabulary, and
        logit-bias ids checked against it: a 400 naming the field, before the request takes a slot.
        A grammar or schema above its size limit (limits.py) is a 400 before any work. Tokenizes
        and compiles: call it off the event loop."""
        d = self.config.sampling
        seed = d.seed if req.seed is None else (LLAMA_DEFAULT_SEED if req.seed == -1 else req.seed)
        given = {k: getattr(req, k) for k in ("repeat_penalty", "repeat_last_n", "presence_penalty",
                                              "frequency_penalty", "ignore_eos") if getattr(req, k) is not None}
        bias = req.bias_pairs()
        if bias is not None:
            given["logit_bias"] = self.bias_tokens(bias)
        src = req.grammar_source()
        if src is not None:
            field, what = src
            try:
                gbnf = what if isinstance(what, str) else schema_to_gbnf(self.schema_text(field, what),
                                                                          what=f"the {field} schema")
                self.check_grammar_size(field, gbnf, made=not isinstance(what, str))
                Grammar(self.model, gbnf).close()        # parses it with the vocabulary (token literals)
            except GrammarError as e:
                raise ApiError(400, f"{field}: {e}", "invalid_value") from None
            given["grammar"] = gbnf
        s = replace(d, temp=d.temp if req.temperature is None else req.temperature,
                    top_k=d.top_k if req.top_k is None else req.top_k,
                    top_p=d.top_p if req.top_p is None else req.top_p,
                    min_p=d.min_p if req.min_p is None else req.min_p, seed=seed, **given)
        try:
            check_controls(s)
        except SpecrunError as e:
            raise ApiError(400, str(e), "invalid_value") from None
        return s

    @staticmethod
    def schema_text(field: str, schema: dict) -> str:
        """A request's JSON schema as compact JSON, within MAX_SCHEMA_BYTES (else a 400)."""
        text = json.dumps(schema, separators=(",", ":"))
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > MAX_SCHEMA_BYTES:
            raise ApiError(400, f"{field}: the schema is {kib(size)} as compact JSON, above this server's limit "
                           f"of {kib(MAX_SCHEMA_BYTES)}; send a smaller schema", "invalid_value")
        return text

    @staticmethod
    def check_grammar_size(field: str, gbnf: str, made: bool = False) -> None:
        """A 400 when a grammar (made: the one a schema turned into) is above MAX_GRAMMAR_BYTES."""
        size = len(gbnf.encode("utf-8", errors="surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            what = "the schema makes a grammar of " if made else ""
            raise ApiError(400, f"{field}: {what}{kib(size)}, above this server's limit of {kib(MAX_GRAMMAR_BYTES)}; "
                           f"send a smaller {'schema' if made else 'grammar'}", "invalid_value")

    def bias_tokens(self, pairs) -> tuple[tuple[int, float], ...]:
        """(token id or text, bias) pairs -> (token id, bias): a text gives its bias to each of its
        tokens, tokenized without BOS and without parsing special tokens, as llama-server's
        common_tokenize(vocab, text, false). An id outside the vocabulary, or a text of no tokens,
        is a 400 (llama-server skips both silently)."""
        out: list[tuple[int, float]] = []
        for key, b in pairs:
            if isinstance(key, str):
                toks = self.model.tokenize(key, add_special=False, parse_special=False)
                if len(toks) == 0:
                    raise ApiError(400, f"logit_bias: the text {key!r} has no tokens", "invalid_value")
                out.extend((int(t), b) for t in toks)
            elif not 0 <= key < self.model.n_vocab:
                raise ApiError(400, f"logit_bias: token id {key} is out of the vocabulary "
                               f"(0..{self.model.n_vocab - 1}); give an id in it, or a text", "invalid_value")
            else:
                out.append((key, b))
        return tuple(out)

    def spec(self, sp: Speculative | None) -> SpecParams | None:
        if sp is None:
            return None
        spec = self.config.spec
        if sp.type is not None:
            try:
                types = parse_spec_types(sp.type)
            except SpecrunError as e:
                raise ApiError(400, f"speculative.type: {e}", "unknown_spec_type") from None
            missing = [t for t in types if t not in self.config.spec_types]
            if missing:
                raise ApiError(400, f"speculative.type: {', '.join(missing)} is not available on this server "
                               f"(available: {', '.join(self.config.spec_types)}); the server builds "
                               f"draft-simple only with -md DRAFT.gguf and draft-mtp only when started with "
                               f"--spec-type draft-mtp", "unavailable_spec_type")
            # a type that drafts adaptive by default (suffix) does so here too
            spec = replace(spec, types=types, adaptive=spec.adaptive or adaptive_default(types))
        spec = replace(spec, n_max=spec.n_max if sp.n_max is None else sp.n_max,
                       n_min=spec.n_min if sp.n_min is None else sp.n_min,
                       p_min=spec.p_min if sp.p_min is None else sp.p_min)
        if any(t in MODEL_TYPES for t in spec.types) and spec.n_max > self.n_max_cap:
            # the engine's rule for model drafters (n-gram drafts are bounded by their size_m), checked
            # here so that the request never takes a slot
            why = (f"exact mode verifies at most {MAX_EXACT_BATCH - 1} draft tokens"
                   if self.exact and self.n_max_cap == MAX_EXACT_BATCH - 1 else "set when the server started")
            raise ApiError(400, f"speculative.n_max: draft n-max {spec.n_max} is above this server's cap of "
                           f"{self.n_max_cap} for {', '.join(MODEL_TYPES[:-1])} and {MODEL_TYPES[-1]} ({why}); ask for at most "
                           f"{self.n_max_cap}, or restart the server with a larger --spec-draft-n-max",
                           "invalid_value")
        return spec

    def n_predict(self, requested: int | None) -> int:
        cap = self.config.n_predict
        if requested is None or requested < 0:
            return cap
        return min(requested, cap) if cap > 0 else requested

    def tokens(self, prompt: str | list, add_special: bool = True) -> list[int] | np.ndarray:
        """A request's prompt -> checked token ids. Tokenizes: call it off the event loop."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ApiError(400, f"prompt: one prompt per request (got {len(prompt)})", "invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            toks = self.model.tokenize(prompt, add_special=add_special)
        else:
            bad = [t for t in prompt if not 0 <= t < self.model.n_vocab]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is out of the vocabulary (0..{self.model.n_vocab - 1})",
                               "invalid_value")
            toks = prompt
        if len(toks) == 0:
            raise ApiError(400, "prompt: the prompt is empty (0 tokens)", "invalid_value")
        if len(toks) >= self.n_ctx:
            raise ApiError(400, f"the prompt exceeds the context size ({len(toks)} tokens, ctx {self.n_ctx}); "
                           "shorten it or restart the server with a larger -c", "context_length_exceeded")
        return toks

    def chat_tokens(self, req: ChatRequest) -> list[int]:
        """The prompt tokens of a chat request: the conversation through the model's chat template
        (runtime.chat.ChatFormat, as the REPL renders it), within the template's time limit.
        Renders and tokenizes: call it off the event loop.
        A conversation that ends with an assistant message (prefill_assistant, llama-server's default)
        is continued: the messages before it with the assistant's generation prompt, then its content
        as the start of the answer (llama.cpp's common_chat_templates_apply with continue_final_message)."""
        return self.tokens(self.chat_prompt(self.chat_messages(req)))

    @staticmethod
    def chat_messages(req: ChatRequest) -> list[dict]:
        """A chat request's messages as the chat template reads them: {"role", "content"}, the
        content parts joined, a developer message as a system one."""
        return [{"role": "system" if m.role == "developer" else m.role,
                 "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or [])}
                for m in req.messages]

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """[{"role", "content"}] -> the prompt's tokens through the chat template (unchecked: see
        tokens()). Renders and tokenizes: call it off the event loop."""
        return self.chat_format().tokenize(self.chat_text(messages))

    def chat_text(self, messages: list[dict]) -> str:
        """The prompt text the chat template renders for [{"role", "content"}], a final assistant
        message continued (prefill_assistant) or closed as a whole turn."""
        fmt, messages = self.chat_format(), list(messages)
        prefill = ""
        if self.config.prefill_assistant and messages[-1]["role"] == "assistant":
            if len(messages) >= 2 and messages[-2]["role"] == "assistant":
                raise ApiError(400, "messages: two assistant messages end the conversation; the last one is "
                               "continued, so give one (or start the server with --no-prefill-assistant)",
                               "invalid_value")
            prefill = messages.pop()["content"] or ""
        try:
            text = time_limited(lambda: fmt.render(messages))
        except TemplateError as e:
            raise ApiError(400, f"messages: {e}", "invalid_value") from None
        return text + prefill

    def chat_format(self) -> ChatFormat:
        fmt = self.config.chat_format
        if fmt is None:
            raise ApiError(400, f"this server has no chat template: {self.config.no_template_reason}; "
                           "use /v1/completions", "no_chat_template")
        return fmt

    async def job(self, endpoint: str, req, n_predict: int | None, stop, prompt: Callable[[], list[int]],
                  stop_tokens: frozenset[int] = frozenset(), logprobs: int | None = None,
                  stop_field: str = "stop") -> Job:
        """Check the request, then its sampling (logit-bias texts, a grammar) and its prompt
        (tokenize, render) in a worker thread, so the event loop keeps answering meanwhile.
        stop_field: the stop strings' name in the request (Anthropic's stop_sequences), for the 400s."""
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if len(stop) > 4:
            raise ApiError(400, f"{stop_field}: at most 4 stop strings (got {len(stop)})", "invalid_value")
        if any(not s for s in stop):
            raise ApiError(400, f"{stop_field}: a stop string is empty", "invalid_value")
        n = self.n_predict(n_predict)
        sampling, spec, tokens = await self.prepare(lambda: (self.sampling(req), self.spec(req.speculative), prompt()))
        return Job(endpoint, np.asarray(tokens, dtype=np.int32), n, sampling, spec, stop, stop_tokens, logprobs,
                   cache_prompt=getattr(req, "cache_prompt", True), stream=bool(getattr(req, "stream", False)),
                   id_slot=-1 if req.id_slot is None else req.id_slot)

    def settings(self, job: Job) -> dict:
        """The settings a job runs with, as llama-server's generation_settings (/completion, /slots)."""
        s, sp = job.sampling, job.spec or self.config.spec
        return {"n_predict": job.n_predict, "temperature": s.temp, "top_k": s.top_k, "top_p": s.top_p,
                "min_p": s.min_p, "seed": s.seed, "stop": list(job.stop), "repeat_penalty": s.repeat_penalty,
                "repeat_last_n": s.repeat_last_n, "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty, "ignore_eos": s.ignore_eos,
                "logit_bias": [[t, b if b > float("-inf") else False] for t, b in s.logit_bias],
                "grammar": s.grammar or "", "stream": job.stream,
                "speculative": {"type": list(sp.types) or ["none"], "n_max": sp.n_max, "n_min": sp.n_min,
                                "p_min": sp.p_min}}

    def detokenize(self, tokens) -> str:
        """Token ids -> text, special tokens written out (llama-server's /detokenize). Each distinct
        id is asked of llama.cpp once."""
        ids = [int(t) for t in tokens]
        try:   # in steps: one C call over millions of ids holds the GIL (and so the event loop) throughout
            return bulk.text(ids, lambda t: self.model.piece(t, special=True))
        finally:
            bulk.release(ids)

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """fn() in a worker thread, at most PREPARE_THREADS at once (the others wait their turn): the
        event loop keeps answering meanwhile."""
        return await anyio.to_thread.run_sync(fn, limiter=self.limiter)

    async def prepare(self, fn: Callable[[], T]) -> T:
        """fn() (render a template, tokenize) off the event loop, counted in the metrics as a request
        being prepared."""
        self.metrics.preparing(+1)
        try:
            return await self.off_loop(fn)
        finally:
            self.metrics.preparing(-1)

    async def respond(self, fn: Callable[[], dict]) -> Response:
        """The JSON answer fn() makes, made and encoded off the event loop and in parts (bulk.json_value:
        a logit_bias of thousands echoed in the settings, long logprobs). The bytes are
        JSONResponse's for the same plain JSON values."""
        return await self.off_loop(lambda: bulk.PartsResponse(bulk.json_value(fn())))

    # -- running -----------------------------------------------------------------------------
    async def start(self, job: Job, client: Client) -> Run:
        """A slot for job (waiting in the queue if need be). A client that leaves while its request
        waits gives its place up (ClientGone) and never touches a slot."""
        acquire = asyncio.ensure_future(self.pool.start(job))
        gone = asyncio.ensure_future(client.gone.wait())
        try:
            await asyncio.wait({acquire, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not acquire.done():
            acquire.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                run = await acquire             # handed a slot just as the cancel came: give it back
                run.cancel("client")
            self.metrics.abandoned()
            raise ClientGone()
        try:
            return acquire.result()
        except Busy as e:
            raise ApiError(503, str(e), "server_busy", headers={"Retry-After": "1"}) from None
        except WorkerLost as e:
            raise ApiError(503, str(e), "rpc_worker_lost") from None
        except ShuttingDown as e:
            if not e.queued:
                self.n_refused += 1
            raise ApiError(503, str(e), "shutting_down") from None

    async def finish(self, run: Run, client: Client) -> Outcome:
        """The outcome of a non-streamed run; a client that leaves meanwhile stops it. Engine errors
        become 400s (their messages are the user's fix); a run the shutdown stopped, a 503."""
        result = asyncio.ensure_future(run.outcome())
        gone = asyncio.ensure_future(client.gone.wait())
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not result.done():
                run.cancel("client")
            try:
                o = await result
            except WorkerLost as e:   # the model's layers are gone with the worker: not the client's fault
                raise ApiError(502, str(e), "rpc_worker_lost") from None
            except SpecrunError as e:
                raise ApiError(400, str(e), "invalid_value") from None
        finally:
            gone.cancel()
        if run.shut_down:
            raise self.shutdown_error(o)
        return o

    @staticmethod
    def shutdown_error(o: Outcome) -> ApiError:
        where = "during the prompt" if o.stats.n_gen == 0 else f"after {len(o.tokens)} tokens"
        return ApiError(503, f"the server is shutting down: this generation was stopped {where} when the drain "
                        "timeout (--drain-timeout) expired; retry on another server", "shutting_down")

    # -- shutdown ------------------------------------------------------------------------------
    async def shut_down(self) -> Drained:
        """SIGTERM: new requests get 503 (Guard), the queue is answered 503 at once, the runs in flight
        get the drain timeout to finish, then are stopped (at the next prompt chunk or target pass)."""
        self.stopping = True
        self.n_queued_refused = self.pool.begin_shutdown()
        return await self.pool.drain(self.config.drain_timeout)

    def stopped(self, drained: Drained) -> Stopped:
        return Stopped(drained, self.n_queued_refused, self.n_refused, self.metrics.n_finished)

    # -- output shapes --------------------------------------------------------------------------
    @staticmethod
    def timings(o: Outcome) -> dict:
        st = o.stats
        pm, gm = st.t_prompt_s * 1e3, st.t_gen_s * 1e3
        return {"prompt_n": st.n_prompt, "prompt_ms": pm,
                "prompt_per_token_ms": pm / st.n_prompt if st.n_prompt else 0.0,
                "prompt_per_second": st.prompt_tps, "predicted_n": st.n_gen, "predicted_ms": gm,
                "predicted_per_token_ms": gm / st.n_gen_steps if st.n_gen_steps else 0.0,
                "predicted_per_second": st.gen_tps, "draft_n": st.n_drafted, "draft_n_accepted": st.n_accepted,
                "drafts": sum(d.n_gen_drafts for d in st.drafters)}

    def _logprob_tokens(self, o: Outcome) -> list:
        """The generated tokens' TokenLogprobs, without end-of-generation tokens (they are not text)."""
        return [t for t in o.logprobs or () if not self.model.is_eog(t.token)]

    def _text(self, token: int) -> str:
        return self.model.piece(token).decode("utf-8", errors="replace")

    def completion_logprobs(self, o: Outcome) -> dict | None:
        """OpenAI's legacy `logprobs` of a text completion (tokens, token_logprobs, top_logprobs, text_offset)."""
        if o.logprobs is None:
            return None
        lps = self._logprob_tokens(o)
        tokens = [self._text(t.token) for t in lps]
        return {"tokens": tokens, "token_logprobs": [t.logprob for t in lps],
                "top_logprobs": [{self._text(i): lp for i, lp in t.top} for t in lps],
                "text_offset": text_offsets([self.model.piece(t.token) for t in lps])}

    def chat_logprobs(self, o: Outcome) -> dict | None:
        """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
        if o.logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            return {"token": self._text(token), "logprob": logprob, "bytes": list(self.model.piece(token))}

        return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in self._logprob_tokens(o)]}

    @staticmethod
    def usage(job: Job, o: Outcome) -> dict:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": len(o.tokens),
                "total_tokens": len(job.prompt) + len(o.tokens)}


def text_offsets(pieces: list[bytes]) -> list[int]:
    """Each token's offset in the text the pieces decode to, in characters: a token that begins
    inside a character (byte-fallback pieces of one character) is at that character's start.
    [b"a", b"\xe6\x9d", b"\xb1", b"b"] ("a東b") -> [0, 1, 1, 2]."""
    dec, out, n = codecs.getincrementaldecoder("utf-8")(errors="replace"), [], 0
    for p in pieces:
        out.append(n)
        n += len(dec.decode(p))        # the characters complete so far (a split one is held back)
    return out


class Client:
    """Watches a request's connection: `gone` is set when the client disconnects. Only for requests
    whose body has been read (the watcher consumes what receive() gives)."""

    def __init__(self, request: Request) -> None:
        self.gone = asyncio.Event()
        self._task = asyncio.ensure_future(self._watch(request.receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone.set()

    def close(self) -> None:
        self._task.cancel()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
