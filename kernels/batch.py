"""Many requests in one target context: one llama_decode per step for the rows of every sequence.

    submit(request) -> Handle            # any thread: queued for a free sequence (seq_id)
    step():                              # one thread (the server's loop)
        admit queued requests into free sequences (their KV reused, or a shared prefix copied)
        drafts: each generating sequence's proposal, cut to the rows that pay (draftlen.share_rows)
        rows = for each active sequence: a prompt chunk, or [id_last, d1..dk] (its draft, k may be 0)
        the active sequences' KV streams side by side (_compact: llama.cpp's ubatches need it)
        ONE llama_decode of all rows (prompt chunks of 64+ rows: a decode of their own, see below)
        per sequence: verify its rows, roll back what was rejected, tell its drafters, emit
        -> [(handle, new tokens)]

Why each sequence's text equals the same request decoded alone (Engine, --spec-type none):
exact mode's settings make every matmul row-invariant (llama.cpp's kernels then compute a row the
same way whatever the batch holds: kernels/llama.py), and the context keeps a KV stream per
sequence (kv_unified False), so a sequence's flash attention reads only its own cells, in position
order, as a one-sequence context lays them out. With one unified buffer, once a sequence leaves,
the others' next positions go into the cells it left, before their earlier ones, and the attention
sums them in another order (benchmarks/results/batch_invariance.md). llama.cpp splits a batch of
several streams into ubatches of equal rows per sequence, so how many of a sequence's rows share a
ubatch depends on the other sequences; flash attention picks its tiled kernel by that count (64+
rows: GGML_FA_TILE_Q, the reason for exact mode's 63-row verify cap). With exact mode's Q8_0 K
cache a prompt's rows came out the same either way (batch_invariance.md's second table), but a
prompt chunk of 64+ rows is still decoded on its own, as the Engine decodes it, and every other
row (verify rows: at most 63 a sequence) goes in the shared decode.

Prompts are evaluated here, in chunks of n_ubatch from the first position not reused, as the
Engine's exact path does. With BatchParams.fast_prefill, a prompt of MIN_PROMPT tokens or more goes
through the fast prompt context instead (kernels/prefill.py), as the Engine's does, and its state is
loaded into the sequence's stream: its text then equals the Engine's with the fast prompt path. Its
KV is never copied to another sequence, nor reused by a short prompt (the Engine's rule). The logit controls (penalties, logit
bias, --ignore-eos, a grammar) transform each sequence's rows with kernels/constrain.py, as the
Engine does, and logprobs come from the raw rows. Hidden-row drafters (draft-mtp, draft-eagle3)
are not served here yet.

BatchRunner drives a BatchEngine from one loop thread, and SeqEngine gives one of its sequences
the Engine's face (generate() -> Generation): `specrun serve -np N` serves its slots with them.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from .constrain import Constraints, VerifyPass
from .drafters import HIDDEN_TYPES, TargetView, draft_n_max, drafter_key, make_drafter
from .draftlen import DraftLength, PassCost, curve_of, curve_rows, expected_tokens, share_rows, ubatch_rows
from .engine import Engine, Generation, ask, resolve_seed, verify_mode
from .llama import MAX_EXACT_BATCH, Context, ContextParams, LlamaError, Model
from .params import NGRAM_TYPES, EngineParams, SpecParams
from .prefill import FastPrefill, fast_len
from .prefill_worker import PrefillHandle, PrefillWorker, uses_worker
from .sampling import sample
from .stats import DrafterStats, GenStats
from .types import (
    NO_STOPS,
    Draft,
    Drafter,
    DraftOptions,
    SamplingParams,
    Stops,
    TargetPass,
    TokenLogprob,
    common_prefix,
    draft_head,
    token_logprob,
)
from .verify import verify

log = logging.getLogger(__name__)

FA_TILE_Q = MAX_EXACT_BATCH + 1   # a sequence's rows in a ubatch from which flash attention tiles
PROBE_ROWS = 64                   # the longest pass the cost probe times (draftlen.curve_rows)
SHARE_MIN = 8                     # a prompt prefix worth copying from another sequence (tokens)
_SAMPLING_DEFAULT = SamplingParams()   # llama.cpp's defaults (temp 0.8), as Engine.generate's


def draft_budget(n_active: int, rows: int) -> int:
    """BatchParams.draft_rows' fixed rule: the longest draft of each generating sequence in a step,
    `rows` draft tokens shared by the n_active sequences, none once there are more sequences than
    rows. The default (draft_rows None) weighs each row instead (draftlen.share_rows)."""
    return rows // n_active if n_active else rows


@dataclass(frozen=True, slots=True)
class BatchParams:
    n_seq: int = 4              # sequences (slots) in the context
    n_ctx_seq: int = 4096       # KV cells of each sequence
    n_batch: int = 2048         # rows of one decode
    n_ubatch: int = 512         # prompt chunk (as the Engine's)
    n_threads: int = 0          # 0: default_threads()
    # None: each step's drafts are cut to the rows expected to pay at the batch's pass cost and each
    # sequence's acceptance (draftlen.share_rows); n: a fixed n rows shared (draft_budget; tests)
    draft_rows: int | None = None
    draft_model: str | None = None   # -md for draft-simple
    share_min: int = SHARE_MIN
    compact: bool = True        # keep the active sequences' KV streams side by side (_compact; 3+ sequences)
    fast_prefill: bool = False  # prompts of MIN_PROMPT+ tokens through the fast prompt context (as the Engine's)


@dataclass(slots=True)
class Request:
    """One generation: the prompt (int32 [n], 1 <= n < n_ctx_seq), up to n_predict tokens (-1: until
    end-of-generation or a full sequence), the sampling, and its speculation: spec's types, or
    explicit drafter objects (tests: they must be the request's own)."""

    prompt: Sequence[int]
    n_predict: int = -1
    sampling: SamplingParams = field(default_factory=SamplingParams)
    spec: SpecParams = field(default_factory=SpecParams)
    drafters: Sequence[Drafter] | None = None
    cancel: Callable[[], bool] | None = None
    seq: int = -1                   # only this sequence (a server slot's), once it is free; -1: the best free one
    fresh: bool = False             # evaluate the whole prompt: no KV reused, no prefix copied (cache_prompt false)
    logprobs: int | None = None     # None: off; n: each token's log-probability and its n likeliest alternatives
    stops: Stops = NO_STOPS         # where the caller ends the text: no draft token past one (draft_end)


class Handle:
    """A submitted request as it goes: tokens (every token emitted so far), stats (GenStats),
    logprobs (one TokenLogprob per token, when the request asked), done once it stopped
    (stats.stop says why). cancel() from any thread ends it at the next step."""

    def __init__(self, req: Request) -> None:
        self.request = req
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None if req.logprobs is None else []
        self.stats = GenStats()
        self.done = False
        self.error = ""                 # why it stopped with stop "error"
        self.seq = -1                   # its sequence while active
        self.cons: Constraints | None = None   # its logit controls' state (None: none)
        self.inbox: queue.SimpleQueue | None = None   # BatchRunner: what each step brought it
        self.n_posted = 0               # BatchRunner: logprobs already posted
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled or (self.request.cancel is not None and self.request.cancel())


class _Seq:
    """A sequence of the context: the tokens its KV holds (positions 0..len-1), and the request it
    serves, if any, with that request's state."""

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.stream = sid                  # its KV stream: llama.cpp's sequence id (BatchEngine._compact moves it)
        self.kv: list[int] = []
        self.h: Handle | None = None
        self.drafter_cache: dict[tuple, Drafter] = {}
        self.drafters: list[Drafter] = []
        self.lens: list[DraftLength] = []  # each drafter's acceptance and pending proposal (adaptive rows)
        self.prompt = np.zeros(0, dtype=np.int32)
        self.text: list[int] = []          # prompt + emitted tokens (ends with id_last once generating)
        self.wait: tuple[int, int] | None = None   # (source seq, tokens) to copy before evaluating
        self.fast_n = 0                    # the prompt its KV holds (or will) from the fast context; 0: none
        self.fast_logits: np.ndarray | None = None   # float32 [n_vocab]: that prompt's last logits
        self.fast_keep = -1                # the fast prompt is pending; its drafters follow from here (-1: none)
        self.which = -1                    # the drafter whose proposal the last draft was
        self.cons: Constraints | None = None       # the request's logit controls
        self.sampling = SamplingParams()
        self.spec = SpecParams()
        self.limit = 0
        self.t0 = 0.0
        self.t_gen0 = 0.0

    @property
    def prefilling(self) -> bool:
        return len(self.kv) < len(self.prompt)

    @property
    def ready(self) -> bool:
        """Its rows may go in this step: no prefix to copy first, no fast prompt pending."""
        return self.h is not None and self.wait is None and self.fast_keep < 0

    def planned(self) -> list[int]:
        """What the KV will hold: its request's prompt and text, or (idle) what it holds."""
        return self.text if self.h is not None else self.kv


class BatchEngine:
    """A target model and one context of params.n_seq sequences; requests in, tokens out.

    submit() is thread-safe; step() and close() belong to one thread. Each request's text is the
    same request's alone (Engine, exact mode; the fast prompt path with params.fast_prefill, else
    none) at temperature 0 and, seeded, under sample-and-match verification, whatever else is in
    the batch.

    prefill: the fast prompt context to use (another engine's prompt worker: SharedPrefill.handle());
    None with params.fast_prefill: one of its own (a worker where uses_worker says so)."""

    def __init__(self, model_path: str, params: BatchParams = BatchParams(), *, model: Model | None = None,
                 prefill: PrefillHandle | None = None) -> None:
        self.params = params
        self._own_model = model is None
        self.model = model if model is not None else Model(model_path, exact=True)
        self.ctx: Context | None = None
        self.prefill: FastPrefill | PrefillWorker | PrefillHandle | None = prefill
        try:
            # 3+ sequences can leave a gap between the active ones: a spare stream to close it (_compact)
            self.spare = params.n_seq if params.compact and params.n_seq >= 3 else None
            n_streams = params.n_seq + (self.spare is not None)
            self.ctx = Context(self.model, ContextParams(
                n_ctx=params.n_ctx_seq * n_streams, n_batch=params.n_batch, n_ubatch=params.n_ubatch,
                n_threads=params.n_threads, n_seq_max=n_streams, kv_unified=False))
            self.n_ctx_seq = self.ctx.n_ctx // n_streams   # llama.cpp rounds n_ctx up (to 256)
            if params.fast_prefill and prefill is None and not self.model.recurrent:
                self.prefill = (PrefillWorker if uses_worker(self.model) else FastPrefill)(
                    self.model, self.n_ctx_seq, params.n_threads, self.ctx.kv_rot, self.ctx.k_type)
        except BaseException:
            self.close()
            raise
        self.n_max_cap = min(MAX_EXACT_BATCH - 1, self.ctx.n_batch - 1)
        self.target = TargetView(self.model, self.ctx, self.n_ctx_seq, self.ctx.n_batch, params.n_threads, True,
                                 self.prefill is not None)
        self.seqs = [_Seq(i) for i in range(params.n_seq)]
        self.pass_cost = PassCost()     # t(rows) of the shared decodes (share_rows), probed once
        self.probed = False
        self.n_stepped = 0              # sequences the last step advanced (their rows decoded)
        self.n_moves = 0                # sequences moved to another stream (_compact)
        self._queue: deque[Handle] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)

    def close(self) -> None:
        for h in self.__dict__.get("_queue", ()):
            if h.cons is not None:
                h.cons.close()
        for s in self.__dict__.get("seqs", []):
            if s.cons is not None:
                s.cons.close()
                s.cons = None
            for d in s.drafter_cache.values():
                d.close()
            s.drafter_cache = {}
        if self.__dict__.get("prefill") is not None:
            self.prefill.close()
            self.prefill = None
        if self.__dict__.get("ctx") is not None:
            self.ctx.close()
            self.ctx = None
        if self.__dict__.get("_own_model") and self.__dict__.get("model") is not None:
            self.model.close()

    def __enter__(self) -> BatchEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- requests in -----------------------------------------------------------------------
    def submit(self, req: Request) -> Handle:
        """Queue a request (any thread). Bad requests are refused here, before any work."""
        n = len(req.prompt)
        if n == 0:
            raise SpecrunError("the prompt is empty")
        if n >= self.n_ctx_seq:
            raise SpecrunError(f"the prompt exceeds a sequence's context ({n} tokens, ctx {self.n_ctx_seq}); "
                               "raise -c or shorten the prompt")
        hidden = [t for t in req.spec.types if t in HIDDEN_TYPES]
        if hidden and req.drafters is None:
            raise SpecrunError(f"--spec-type {hidden[0]} reads the target's hidden rows, which the batched engine "
                               "does not export per sequence yet")
        if not -1 <= req.seq < self.params.n_seq:
            raise SpecrunError(f"sequence {req.seq} does not exist (0..{self.params.n_seq - 1})")
        h = Handle(req)
        # the controls' state (a grammar compiled, bias ids checked) in the caller's thread, before any work
        h.cons = Constraints.of(self.model, req.sampling, self.n_ctx_seq, np.asarray(req.prompt, dtype=np.int32))
        with self._wake:
            self._queue.append(h)
            self._wake.notify_all()
        return h

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a request is queued or active (a server loop's idle wait); True if one is."""
        with self._wake:
            return self._wake.wait_for(self.busy, timeout)

    def busy(self) -> bool:
        return bool(self._queue) or any(s.h is not None for s in self.seqs)

    def _drafters_of(self, s: _Seq, req: Request) -> list[Drafter]:
        if req.drafters is not None:
            return list(req.drafters)
        out = []
        for t in req.spec.types:
            key = drafter_key(t, req.spec)
            if key not in s.drafter_cache:
                s.drafter_cache[key] = make_drafter(t, self.target, req.spec, draft_path=self.params.draft_model)
            out.append(s.drafter_cache[key])
        return out

    def _admit(self, out: list) -> None:
        """Queued requests into free sequences: the one whose KV shares the longest prefix with the
        prompt (or the request's own sequence, once free); then, when another sequence holds (or is
        evaluating) a longer prefix of it, that prefix is copied from there (seq_cp) once it is in
        place. Requests that end here (n_predict 0, a drafter that cannot be built) go to out."""
        while True:
            free = [s for s in self.seqs if s.h is None]
            with self._lock:
                h = next((q for q in self._queue if q.request.seq < 0 or self.seqs[q.request.seq].h is None), None)
                if not free or h is None:
                    return
                self._queue.remove(h)
            req = h.request
            prompt = np.asarray(req.prompt, dtype=np.int32)
            s = max(free, key=lambda q: common_prefix(q.kv, prompt)) if req.seq < 0 else self.seqs[req.seq]
            s.h, h.seq, s.t0 = h, s.sid, time.perf_counter()
            s.sampling, s.spec, s.cons = resolve_seed(req.sampling), req.spec, h.cons
            s.limit = req.n_predict if req.n_predict >= 0 else self.n_ctx_seq
            try:
                s.drafters = self._drafters_of(s, req)
            except Exception as e:      # a drafter that cannot be built (a draft model's context): this request only
                h.error = str(e)
                out.append((h, []))
                self._finish(s, "error")
                continue
            h.stats = GenStats(n_prompt_total=len(prompt), exact=True, seed=s.sampling.seed,
                               drafters=[DrafterStats(d.spec_type) for d in s.drafters])
            s.lens = [DraftLength(max(1, min(draft_n_max(d.spec_type, s.spec), self.n_max_cap)), True,
                                  0 if d.spec_type in NGRAM_TYPES else 1) for d in s.drafters]
            for dl in s.lens:
                dl.start(self.pass_cost)
            if s.limit == 0:
                out.append((h, []))
                self._finish(s, "n_predict")
                continue
            n = len(prompt)
            s.prompt, s.text = prompt, prompt.tolist()
            fast = self.prefill is not None and fast_len(n) > 0
            held = 0 if req.fresh else common_prefix(s.kv, prompt)
            keep = min(held, n - 1)
            if s.fast_n and not fast:
                keep = 0                 # the fast context's positions: not what a fresh evaluation computes
            opts = DraftOptions(s.spec.p_min, s.sampling if s.spec.verify in ("auto", "rejection")
                                and not s.sampling.greedy else None)
            for d in s.drafters:
                keep = min(keep, d.begin(prompt, keep, opts))
            if fast:    # this very prompt loaded before (its last logits kept), or a hand-over (_fast_prompt)
                reuse = s.fast_n == n == held and s.fast_logits is not None
                self._trim(s, n if reuse else 0)
                if not reuse:
                    s.fast_n, s.fast_logits = n, None
                s.fast_keep, s.wait = keep, None
                h.stats.n_prompt = 0 if reuse else n
                continue
            s.fast_n, s.fast_logits = 0, None
            src, best = None, keep
            for o in self.seqs if not req.fresh else ():
                if o is not s and not o.fast_n:
                    c = min(common_prefix(o.planned(), prompt), len(prompt) - 1)
                    if c > best and c >= self.params.share_min:
                        src, best = o, c
            self._trim(s, keep)
            h.stats.n_prompt = len(prompt) - keep
            s.wait = (src.sid, best) if src is not None else None

    def _trim(self, s: _Seq, keep: int) -> None:
        if len(s.kv) > keep and not self.ctx.seq_rm_of(s.stream, keep, -1):
            raise LlamaError(f"could not roll sequence {s.sid} back to {keep} tokens")
        del s.kv[keep:]

    def _copy_prefixes(self) -> None:
        """Sequences waiting for a prefix another sequence evaluates: copied once it is there (whole
        stream, then trimmed: llama.cpp copies between streams whole), or given up when the source
        went another way."""
        for s in self.seqs:
            if s.h is None or s.wait is None:
                continue
            src, n = self.seqs[s.wait[0]], s.wait[1]
            have = common_prefix(src.kv, s.prompt)
            if src.fast_n:
                s.wait = None        # it took a fast prompt since: evaluate it here
            elif have >= n:
                self.ctx.seq_cp(src.stream, s.stream)
                if not self.ctx.seq_rm_of(s.stream, n, -1):
                    raise LlamaError(f"could not trim sequence {s.sid}'s copied prefix to {n} tokens")
                s.kv = src.kv[:n]
                for d in s.drafters:   # the drafters follow the copied rows (no hidden rows: none read them)
                    d.accept(TargetPass(np.asarray(s.kv, dtype=np.int32), 0, n, None))
                s.h.stats.n_prompt = len(s.prompt) - n
                s.wait = None
            elif src.h is None or common_prefix(src.planned(), s.prompt) < n:
                s.wait = None        # the source will not get there: evaluate it here

    # -- one step --------------------------------------------------------------------------
    def step(self) -> list[tuple[Handle, list[int]]]:
        """Advance every active sequence by one batched decode. Returns each request's new tokens
        (possibly none: a prompt chunk) with its handle; a handle is done when its request ended
        in this step (cancelled requests come back done, with no tokens)."""
        out: list[tuple[Handle, list[int]]] = []
        self.n_stepped = 0
        for s in self.seqs:
            if s.h is not None and s.h.cancelled:
                out.append((s.h, []))
                self._finish(s, "interrupted")
        with self._lock:
            gone = [h for h in self._queue if h.cancelled]
            for h in gone:
                self._queue.remove(h)
        for h in gone:
            h.stats.stop, h.done = "interrupted", True
            if h.cons is not None:
                h.cons.close()
            out.append((h, []))
        self._admit(out)
        self._copy_prefixes()
        for s in self.seqs:
            if s.h is not None and s.fast_keep >= 0 and not s.h.cancelled:
                self._fast_prompt(s, out)
                self.n_stepped += 1
        active = [s for s in self.seqs if s.ready]
        gen = [s for s in active if not s.prefilling]
        # (seq, tokens, pos0, outputs?, draft, its controls' states)
        rows: list[tuple[_Seq, list[int], int, bool, Draft | None, VerifyPass | None]] = []
        spare = self.ctx.n_batch - len(gen)       # rows left for drafts and prompt chunks
        if self.params.draft_rows is None:
            drafts = self._drafts(gen, spare)
        else:
            budget = draft_budget(len(gen), self.params.draft_rows)
            drafts = [self._propose(s, min(budget, self._room(s), spare // len(gen))) for s in gen]
        for s, draft in zip(gen, drafts, strict=True):
            vp = None
            if s.cons is not None:   # cut at the first token the constrained target cannot emit (as the Engine)
                vp = s.cons.verify_pass(draft)
                draft = vp.draft
            spare -= len(draft)
            rows.append((s, [s.text[-1], *draft.tokens.tolist()], len(s.text) - 1, True, draft, vp))
        for s in active:
            if not s.prefilling:
                continue
            lo = len(s.kv)
            chunk = s.prompt[lo:lo + self.params.n_ubatch].tolist()
            if len(chunk) >= FA_TILE_Q:       # its own decode: the tiled kernel for all its rows
                self._prompt_chunk(s, chunk, lo, out)
                self.n_stepped += 1
            elif len(chunk) <= spare:         # else at a later step
                rows.append((s, chunk, lo, False, None, None))
                spare -= len(chunk)
        if not rows:
            return out
        self._compact()                           # before the decode, which makes its copies
        rows.sort(key=lambda r: r[0].stream)      # llama.cpp's ubatches span consecutive sequence ids only
        self.n_stepped += len(rows)
        toks, pos, seqs, outs = [], [], [], []
        for s, t, p0, all_out, *_ in rows:
            toks += t
            pos += range(p0, p0 + len(t))
            seqs += [s.stream] * len(t)
            last = len(s.kv) + len(t) == len(s.prompt)
            outs += [True] * len(t) if all_out else [False] * (len(t) - 1) + [last]
        t0 = time.perf_counter()
        try:
            self.ctx.decode_seqs(toks, pos, seqs, outs)
        except LlamaError as e:               # llama.cpp left the memory as it was: fail these requests
            for s, *_, vp in rows:
                if vp is not None:
                    vp.close()
                self._fail(s, e, out)
            return out
        self.pass_cost.record_split(ubatch_rows([(s.stream, len(t)) for s, t, *_ in rows], self.ctx.n_ubatch),
                                    time.perf_counter() - t0)
        logits = self.ctx.outputs_rows()          # float32 [n_outputs, n_vocab], batch order
        i = 0
        for s, t, p0, all_out, draft, vp in rows:
            n_out = len(t) if all_out else int(len(s.kv) + len(t) == len(s.prompt))
            mine = logits[i:i + n_out]
            i += n_out
            if draft is None:
                self._prompt_done(s, t, p0, mine, out)
            else:
                try:
                    self._verified(s, draft, mine, out, vp)
                finally:
                    if vp is not None:
                        vp.close()
        return out

    def _compact(self) -> None:
        """The sequences with a request on consecutive streams. llama.cpp's ubatches take
        consecutive sequence ids only (ubatch_rows), so a gap between two of them would cost every
        step a pass more. Each one outside the window that holds most of them trades streams with
        an idle sequence inside it, KV and all: whole-stream copies through the spare stream, which
        llama.cpp makes at the next decode (so step() calls this just before its decode; nothing
        writes a stream in between). The bytes and cells move as they are, so every row after it
        is computed as before."""
        if self.spare is None:
            return
        act = sorted(s.stream for s in self.seqs if s.h is not None)
        n = len(act)
        if n == 0 or act[-1] - act[0] + 1 == n:
            return
        lo = max(range(self.params.n_seq - n + 1), key=lambda w: sum(w <= x < w + n for x in act))
        at = {s.stream: s for s in self.seqs}
        away = [s for s in self.seqs if s.h is not None and not lo <= s.stream < lo + n]
        holes = [at[x] for x in range(lo, lo + n) if at[x].h is None]
        for a, b in zip(away, holes, strict=True):
            if a.kv and b.kv:             # a's KV to the spare, b's to a's stream, a's to b's
                self.ctx.seq_cp(a.stream, self.spare)
                self.ctx.seq_cp(b.stream, a.stream)
                self.ctx.seq_cp(self.spare, b.stream)
                self.ctx.seq_rm_of(self.spare, -1, -1)
            elif a.kv or b.kv:            # one copy: the one that holds KV to the other's stream
                src, dst = (a, b) if a.kv else (b, a)
                self.ctx.seq_cp(src.stream, dst.stream)
                self.ctx.seq_rm_of(src.stream, -1, -1)
            a.stream, b.stream = b.stream, a.stream
            self.n_moves += 1

    def _room(self, s: _Seq) -> int:
        """The longest draft sequence s may verify now: tokens left, cells left, exact mode's cap."""
        n_past = len(s.text) - 1
        return max(0, min(s.limit - len(s.h.tokens) - 1, self.n_ctx_seq - n_past - 2, self.n_max_cap))

    def _drafts(self, gen: list[_Seq], spare: int) -> list[Draft]:
        """Each generating sequence's draft for this step: its drafter's proposal, cut to the rows
        expected to pay in the shared decode (share_rows: each sequence's acceptance, the batch's
        pass cost). A copy drafter (n-grams, suffix) is asked for its longest proposal and may be
        held back (0 rows; its proposal is still scored against the text); a model drafter drafts
        its own best length alone and keeps at least one row, so that its estimate learns."""
        room = spare // max(1, len(gen))
        cands = [self._candidate(s, min(self._room(s), room)) for s in gen]
        if not self.probed and any(len(c[1]) for c in cands):
            self._probe(gen)
        sids = [s.stream for s in gen]
        ks = share_rows([c[0] for c in cands], [len(c[1]) for c in cands], [c[2] for c in cands],
                        lambda k: self.step_cost(sids, k))
        for s, (_, _, _, i), k in zip(gen, cands, ks, strict=True):
            if i >= 0:                       # a copy drafter held back is asked again in a few steps
                s.lens[i].pace(k, s.h.stats.drafters[i].t_per_call, self.pass_cost)
        return [Draft.empty() if k == 0 else draft_head(d, k) for (_, d, _, _), k in zip(cands, ks, strict=True)]

    def step_cost(self, streams: Sequence[int], drafts: Sequence[int]) -> float:
        """Seconds of one decode where the sequence on streams[i] verifies 1 + drafts[i] rows: the
        ubatches llama.cpp makes of them, in stream order as step() sorts its rows (slots need not
        hold their streams in slot order), each priced by the pass-cost curve."""
        rows = sorted((sid, 1 + k) for sid, k in zip(streams, drafts, strict=True))
        return self.pass_cost.split_at(ubatch_rows(rows, self.ctx.n_ubatch))

    def _candidate(self, s: _Seq, room: int) -> tuple[list[float], Draft, int, int]:
        """(per-position acceptance rates, the draft it may make, its least rows, the copy drafter
        that made it or was asked last: -1 for none or a model drafter) of sequence s. A held-back
        copy drafter is asked only every few steps (DraftLength.pace). In the drafters' order, the
        first that drafts; but every copy drafter is asked, and the one whose best cut has the
        most expected tokens per second (DraftLength.best_cut) offers its whole candidate (as the Engine)."""
        if room <= 0 or not s.drafters:
            return [], Draft.empty(), 0, -1
        ctx = np.asarray(s.text, dtype=np.int32)
        several = sum(dl.k_min == 0 for dl in s.lens) > 1
        asked: list[tuple[int, int]] = []      # the copy drafters asked: (index, their best cut's length)
        best = None                            # the best copy drafter's (value, rates, tokens, index)
        for i, dl in enumerate(s.lens):
            if best is not None and dl.k_min:
                break                          # a copy drafter listed before it drafted
            if dl.k_min == 0 and not dl.ask():
                continue
            draft = self._ask(s, i, ctx, min(room, dl.cap if dl.k_min == 0 else max(1, dl.n)))
            if dl.k_min:                       # a model drafter: its draft as made
                if len(draft) and len(draft) >= s.spec.n_min:
                    s.which = i
                    return dl.acc.rates(len(draft)), draft, 1, -1
                continue
            if not len(draft) or len(draft) < s.spec.n_min:
                asked.append((i, 0))
                continue
            # the proposal is pending now (or continues the pending one): at least one candidate
            v, _, cut = dl.best_cut(draft.tokens, len(ctx), room, self.pass_cost, draft.kind) if several \
                else (0.0, [], draft.tokens)
            a, toks = max(dl.candidates(draft.tokens, len(ctx), draft.kind),
                          key=lambda c: expected_tokens(c[0], min(len(c[1]), room)))
            asked.append((i, len(cut)))
            if best is None or v > best[0]:
                best = (v, a, toks, i)
        chosen = best[3] if best is not None else asked[-1][0] if asked else -1
        for i, k in asked:                     # the others; _drafts paces the chosen one by its rows
            if i != chosen:
                s.lens[i].pace(k, s.h.stats.drafters[i].t_per_call, self.pass_cost)
        if best is None:
            return [], Draft.empty(), 0, chosen
        _, a, toks, i = best
        s.which = i
        return a, Draft(toks[:room]), 0, i

    def _probe(self, gen: list[_Seq]) -> None:
        """Time shared decodes of curve_rows(PROBE_ROWS) rows once, past a generating sequence's KV
        (removed again), so that share_rows knows what rows it has not chosen yet would cost."""
        s = next((q for q in gen if len(q.kv) + PROBE_ROWS < self.n_ctx_seq), None)
        if s is None or PROBE_ROWS > self.ctx.n_batch:
            return
        self.probed = True
        n = len(s.kv)
        fill = np.resize(np.asarray(s.kv or [self.model.bos], dtype=np.int32), PROBE_ROWS).tolist()
        times: dict[int, list[float]] = {r: [] for r in curve_rows(PROBE_ROWS)}
        for _ in range(2):
            for r, ts in times.items():
                t = time.perf_counter()
                self.ctx.decode_seqs(fill[:r], range(n, n + r), [s.stream] * r, [True] * r)
                ts.append(time.perf_counter() - t)
                if not self.ctx.seq_rm_of(s.stream, n, -1):
                    raise LlamaError(f"could not remove {r} probing rows of sequence {s.sid} at {n}")
        self.pass_cost.add(curve_of(times, n, fastest=True))   # as the Engine's probe

    def _propose(self, s: _Seq, k_cap: int) -> Draft:
        """The first non-empty proposal of the sequence's drafters (llama.cpp's order), at most k_cap."""
        if k_cap <= 0:
            return Draft.empty()
        ctx = np.asarray(s.text, dtype=np.int32)
        for i, d in enumerate(s.drafters):
            draft = self._ask(s, i, ctx, min(k_cap, draft_n_max(d.spec_type, s.spec)))
            if len(draft) and len(draft) >= s.spec.n_min:
                s.which = i
                return draft
        return Draft.empty()

    def _ask(self, s: _Seq, i: int, ctx: np.ndarray, cap: int) -> Draft:
        """Drafter i of sequence s's proposal of at most cap tokens after ctx, timed in its stats, cut
        after the first token where the text ends (draft_end)."""
        return ask(s.drafters[i], ctx, cap, s.h.stats.drafters[i], s.h.request.stops, self.model)

    def _prompt_chunk(self, s: _Seq, chunk: list[int], lo: int, out: list) -> None:
        last = lo + len(chunk) == len(s.prompt)
        try:
            self.ctx.decode_seqs(chunk, range(lo, lo + len(chunk)), [s.stream] * len(chunk),
                                 [False] * (len(chunk) - 1) + [last])
        except LlamaError as e:
            self._fail(s, e, out)
            return
        rows = self.ctx.outputs_rows() if last else None
        self._prompt_done(s, chunk, lo, rows, out)

    def _prompt_done(self, s: _Seq, chunk: list[int], lo: int, rows: np.ndarray | None, out: list) -> None:
        """A prompt chunk evaluated: the drafters see it; after the last one, the first token."""
        tp = TargetPass(np.asarray(chunk, dtype=np.int32), lo, len(chunk), None)
        for d in s.drafters:
            d.accept(tp)
        s.kv.extend(chunk)
        if not s.prefilling:
            self._first_token(s, rows[-1:], out)

    def _first_token(self, s: _Seq, rows: np.ndarray, out: list) -> None:
        """The prompt is in s's KV; rows: its last token's logits (float32 [1, n_vocab])."""
        last = rows[-1]
        tok = sample(last if s.cons is None else s.cons.row(last), s.sampling, len(s.prompt))
        s.t_gen0 = time.perf_counter()
        s.h.stats.t_prompt_s = s.t_gen0 - s.t0
        self._emit(s, [tok], out, rows)

    def _fast_prompt(self, s: _Seq, out: list) -> None:
        """Sequence s's prompt from the fast prompt context (its state loaded into s's stream), or
        this very prompt's state held from before; the drafters follow from s.fast_keep; the first
        token. Blocks the other sequences while the fast context evaluates. Cancelled meanwhile:
        nothing loaded (the next step ends the request). A model whose state cannot be handed
        over turns the fast path off for good (one log line), and s evaluates its prompt here."""
        h, n, keep = s.h, len(s.prompt), s.fast_keep
        if s.fast_logits is None:
            try:
                if h.request.fresh:       # cache_prompt false: no block of the fast context reused either
                    self.prefill.forget()
                state = self.prefill.state(s.prompt, lambda: h.cancelled)
                if state is None:
                    return
                self.ctx.state_set(state, s.stream)
            except SpecrunError as e:
                log.warning("fast prompt evaluation is off for this model: %s", e)
                self.prefill.close()
                self.prefill = None
                self._trim(s, 0)
                s.fast_n, s.fast_keep = 0, -1
                return
            s.fast_logits = self.prefill.logits
            st = h.stats
            st.n_prompt = st.n_prompt_fast = self.prefill.n_evaluated
            st.fast_kv_mib, st.fast_weights_mib, st.fast_process_mib = (
                self.prefill.kv_mib, self.prefill.weights_mib, self.prefill.process_mib)
        s.kv, s.fast_keep = s.prompt.tolist(), -1
        for lo in range(keep, n, self.params.n_ubatch):   # the drafters follow without target rows
            chunk = s.prompt[lo:lo + self.params.n_ubatch]
            for d in s.drafters:
                d.accept(TargetPass(chunk, lo, len(chunk), None))
        self._first_token(s, s.fast_logits[None, :], out)

    def _verified(self, s: _Seq, draft: Draft, rows: np.ndarray, out: list, vp: VerifyPass | None = None) -> None:
        """Sequence s's verify rows [id_last, d1..dk] came back (float32 [k + 1, n_vocab]): accept,
        roll back, emit. vp: the controls' states for the draft's rows (None: no controls)."""
        n_past = len(s.text) - 1                # id_last's position
        k = len(draft)
        mode = verify_mode(s.spec, s.sampling, draft)
        verdict = verify(draft, rows if vp is None else vp.rows(rows), s.sampling, n_past + 1, mode)
        n_keep = verdict.n_accepted + 1
        batch = [s.text[-1], *draft.tokens.tolist()]
        if s.drafters:
            tp = TargetPass(np.asarray(batch, dtype=np.int32), n_past, n_keep, None)
            for d in s.drafters:
                d.accept(tp)
        if n_keep < k + 1 and not self.ctx.seq_rm_of(s.stream, n_past + n_keep, -1):
            raise LlamaError(f"could not roll sequence {s.sid} back to {n_past + n_keep} tokens")
        s.kv.extend(batch[:n_keep])
        st = s.h.stats
        st.n_target_passes += 1
        if k:
            st.verify = mode
            st.drafters[s.which].record(k, verdict.n_accepted)
            if s.lens:
                s.lens[s.which].record(k, verdict.n_accepted, self.pass_cost)
        self._emit(s, verdict.tokens.tolist(), out, rows)
        for dl in s.lens:            # copy drafters: their pending proposals against the text
            dl.score(s.text, self.pass_cost)

    def _emit(self, s: _Seq, toks: list[int], out: list, rows: np.ndarray) -> None:
        """toks for s's request, cut at end-of-generation and its limit; rows: the raw logits rows
        they were sampled from (row j: token j's), for logprobs."""
        h = s.h
        stop = ""
        for j, t in enumerate(toks):
            if self.model.is_eog(t):
                toks, stop = toks[:j + 1], "eog"
                break
        left = s.limit - len(h.tokens)
        if len(toks) >= left:
            toks, stop = toks[:left], stop or "n_predict"
        h.tokens.extend(toks)
        s.text.extend(toks)
        if h.logprobs is not None:
            h.logprobs.extend(token_logprob(rows[j], t, h.request.logprobs) for j, t in enumerate(toks))
        if s.cons is not None:
            s.cons.accept(toks)
        h.stats.n_gen = len(h.tokens)
        h.stats.t_gen_s = time.perf_counter() - s.t_gen0
        if not stop and len(s.text) - 1 + 1 > self.n_ctx_seq - 1:
            stop = "ctx"
        out.append((h, toks))
        if stop:
            self._finish(s, stop)

    def _fail(self, s: _Seq, e: LlamaError, out: list) -> None:
        """A decode with s's rows failed: its request ends with stop "error" (handle.error says why);
        the KV past what s held is dropped, in case llama.cpp kept any."""
        self.ctx.seq_rm_of(s.stream, len(s.kv), -1)
        s.h.error = str(e)
        out.append((s.h, []))
        self._finish(s, "error")

    def _finish(self, s: _Seq, stop: str) -> None:
        """The request ends: its handle done; the sequence free, its KV kept for a later prompt."""
        h = s.h
        h.stats.stop = h.stats.stop or stop
        h.done = True
        if s.cons is not None:
            s.cons.close()
        s.h, s.wait, s.drafters, s.lens, s.cons = None, None, [], [], None
        s.text, s.fast_keep = [], -1

    # -- convenience -----------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> list[Handle]:
        """Submit every request and step until all are done (tests, scripts)."""
        hs = [self.submit(r) for r in requests]
        while not all(h.done for h in hs):
            self.step()
        return hs

    def cancel_all(self) -> None:
        """Cancel every request, active or queued (any thread): they end at the next step."""
        with self._lock:
            hs = [*self._queue, *(s.h for s in self.seqs if s.h is not None)]
        for h in hs:
            h.cancel()

    def fail_all(self, err: Exception) -> list[tuple[Handle, list[int]]]:
        """Something failed outside a decode (a bug, a rollback llama.cpp refused): every request,
        active or queued, ends with stop "error", and every sequence's KV is dropped (its token list
        can no longer be trusted). Returns the handles as step() does."""
        out: list[tuple[Handle, list[int]]] = []
        for s in self.seqs:
            if s.h is not None:
                s.h.error = str(err)
                out.append((s.h, []))
                self._finish(s, "error")
            self.ctx.seq_rm_of(s.stream, -1, -1)
            s.kv, s.fast_n, s.fast_logits = [], 0, None
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
        for h in queued:
            h.error, h.stats.stop, h.done = str(err), "error", True
            if h.cons is not None:
                h.cons.close()
            out.append((h, []))
        return out


def _snapshot(st: GenStats) -> GenStats:
    """A copy of a request's statistics that the loop's later steps do not change."""
    c = copy.copy(st)
    c.drafters = [replace(d, acc_per_pos=list(d.acc_per_pos)) for d in st.drafters]
    return c


@dataclass(frozen=True, slots=True)
class Step:
    """What one step brought a request (BatchRunner posts it to the handle's inbox)."""

    tokens: list[int]                       # the new tokens (possibly none)
    logprobs: list[TokenLogprob]            # theirs, when the request asked (else empty)
    stats: GenStats                         # the request's statistics after this step (a copy)
    done: bool                              # the request ended (stats.stop says why)


class BatchRunner:
    """A BatchEngine driven by one loop thread: submit() from any thread; each step's new tokens
    go to the handle's inbox as a Step. The thread starts with the first request and ends once no
    request is queued or active, as a slot's thread ends with its run (cli/server/slots.py: libgomp
    keeps a team of worker threads for every thread that ever decoded, for its lifetime)."""

    def __init__(self, engine: BatchEngine) -> None:
        self.engine = engine
        self.n_steps = 0                 # steps that decoded (each one or more decodes)
        self.n_seq_steps = 0             # sequences those steps advanced, summed (/ n_steps: the mean batch)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._go = threading.Event()     # cleared by pause()
        self._go.set()

    def pause(self) -> None:
        """Hold the loop before its next step (tests: requests queue up, then join one step together)."""
        self._go.clear()

    def resume(self) -> None:
        self._go.set()

    @property
    def n_queued(self) -> int:
        """Requests submitted and not yet in a sequence."""
        return len(self.engine._queue)

    def submit(self, req: Request) -> Handle:
        """Queue req (refused with SpecrunError before any work, as BatchEngine.submit)."""
        with self._lock:
            if self._closed:
                raise SpecrunError("the batched engine is closed")
            h = self.engine.submit(req)
            h.inbox = queue.SimpleQueue()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="specrun-batch", daemon=True)
                self._thread.start()
        return h

    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._lock:
                if not eng.busy():
                    self._thread = None
                    return
            self._go.wait()
            try:
                out = eng.step()
            except Exception as e:      # every request learns it; the loop goes on
                log.exception("a batched step failed; its requests end with an error")
                out = eng.fail_all(e)
            if eng.n_stepped:
                self.n_steps += 1
                self.n_seq_steps += eng.n_stepped
            for h, toks in out:
                lps = h.logprobs[h.n_posted:] if h.logprobs is not None else []
                h.n_posted += len(lps)
                h.inbox.put(Step(toks, lps, _snapshot(h.stats), h.done))

    def close(self) -> None:
        """Cancel every request, wait for the loop thread to end, close the engine. Idempotent."""
        with self._lock:
            self._closed = True
            t = self._thread
            self.engine.cancel_all()
        self._go.set()
        if t is not None:
            t.join()
        self.engine.close()


def _follow(h: Handle, st: GenStats, lp: list[TokenLogprob] | None) -> Iterator[list[int]]:
    """A request's tokens as its Steps come; st follows its statistics (n_gen: the tokens yielded
    so far). Closing it early cancels the request. A failed decode raises LlamaError."""
    done = False
    try:
        while not done:
            step: Step = h.inbox.get()
            done = step.done
            for f in GenStats.__slots__:
                setattr(st, f, getattr(step.stats, f))
            if lp is not None:
                lp.extend(step.logprobs)
            if done and st.stop == "error":
                raise LlamaError(h.error or "the batched decode failed")
            if step.tokens:
                yield step.tokens
    except GeneratorExit:
        st.stop = st.stop or "interrupted"
        raise
    finally:
        if not done:
            h.cancel()


class SeqEngine:
    """One sequence of a BatchRunner's engine with the face of an Engine that a server slot uses:
    generate() -> Generation, reset(), kv_tokens, model, n_ctx (the sequence's), n_max_cap,
    params and spec_types (the owner's), set_spec(). The owner is the Engine that loaded the model
    (it keeps the checks, --spec-type auto's calibration and the model); slot 0's close() closes
    the runner, then the owner."""

    def __init__(self, runner: BatchRunner, sid: int, owner: Engine) -> None:
        self.runner, self.sid, self.owner = runner, sid, owner
        self.model = owner.model
        self.params = owner.params
        self.spec = owner.params.spec
        self.n_ctx = runner.engine.n_ctx_seq
        self.n_max_cap = runner.engine.n_max_cap
        self.pass_cost = PassCost()
        self._fresh = False

    @property
    def spec_types(self) -> tuple[str, ...]:
        return self.owner.spec_types

    @property
    def kv_tokens(self) -> list[int]:
        """The tokens the sequence's KV holds (a copy)."""
        return list(self.runner.engine.seqs[self.sid].kv)

    def set_spec(self, spec: SpecParams) -> None:
        """The spec a request without its own runs with (--spec-type auto's choice)."""
        self.spec = spec
        self.params = replace(self.params, spec=spec)

    def reset(self) -> None:
        """The next request evaluates its whole prompt (the KV is only touched by the loop)."""
        self._fresh = True

    def tokenize(self, text: str, add_special: bool = True) -> np.ndarray:
        return self.model.tokenize(text, add_special=add_special)

    def generate(self, prompt: Sequence[int], n_predict: int = -1, sampling: SamplingParams = _SAMPLING_DEFAULT,
                 *, spec: SpecParams | None = None, drafters: Sequence[Drafter] | None = None,
                 cancel: Callable[[], bool] | None = None, logprobs: int | None = None,
                 stops: Stops = NO_STOPS) -> Generation:
        """Engine.generate's contract, served by the batch: requires 1 <= len(prompt) < n_ctx;
        a bad request raises SpecrunError here, before any work."""
        req = Request(prompt, n_predict, sampling, spec or self.spec, drafters, cancel, seq=self.sid,
                      fresh=self._fresh, logprobs=logprobs, stops=stops)
        h = self.runner.submit(req)
        self._fresh = False
        st = GenStats(n_prompt_total=len(prompt), exact=True)
        lp: list[TokenLogprob] | None = None if logprobs is None else []
        return Generation(_follow(h, st, lp), st, lp)

    def close(self) -> None:
        if self.sid == 0:
            self.runner.close()
            self.owner.close()


def batch_slots(owner: Engine, n: int, draft_rows: int | None = None) -> list[SeqEngine]:
    """n server slots over one batched context on owner's model: a sequence each, of owner's
    n_ctx cells, its n_batch and threads (all the batch's: a long prompt holds every slot, so
    owner's prompt worker runs on them too), owner's -md for draft-simple.
    Long prompts take the fast prompt path where owner does: through owner's prompt worker (one
    for the model), else a fast context of the batch's own over the same repacked weights; the
    worker starts (or the weights load) now.
    requires: owner in exact mode, no hidden-row spec types, not a recurrent model (batchable)."""
    p = owner.params
    shared = owner.share_prefill()
    engine = BatchEngine(owner.model.path, BatchParams(
        n_seq=n, n_ctx_seq=owner.n_ctx, n_batch=p.n_batch, n_threads=p.n_threads, draft_rows=draft_rows,
        draft_model=p.draft_model, fast_prefill=owner.fast is not None), model=owner.model,
        prefill=shared.handle() if shared is not None else None)
    owner.start_prefill()
    runner = BatchRunner(engine)
    return [SeqEngine(runner, i, owner) for i in range(n)]


def not_batchable(params: EngineParams, recurrent: bool = False) -> str:
    """Why requests under these engine params cannot share the batched context ("" if they can)."""
    hidden = [t for t in params.spec.types if t in HIDDEN_TYPES]
    if hidden:
        return f"--spec-type {hidden[0]} reads the target's hidden rows, which the batched decode does not export yet"
    if not params.exact:
        return "--no-exact: the batched decode runs exact mode's kernels only"
    if params.placement is not None:
        return "--rpc: the batched decode runs on this machine only"
    if recurrent:
        return "a recurrent or hybrid model rolls back through snapshots of one sequence"
    return ""
