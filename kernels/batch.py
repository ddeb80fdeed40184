"""Many requests in one target context: one llama_decode per step for the rows of every sequence.

    submit(request) -> Handle            # any thread: queued for a free sequence (seq_id)
    step():                              # one thread (the server's loop)
        admit queued requests into free sequences (their KV reused, or a shared prefix copied)
        rows = for each active sequence: a prompt chunk, or [id_last, d1..dk] (its draft, k may be 0)
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
Engine's exact path does (EngineParams.fast_prefill False); hidden-row drafters (draft-mtp,
draft-eagle3) and logit controls (penalties, bias, grammar) are not served here yet.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from .drafters import HIDDEN_TYPES, TargetView, draft_n_max, drafter_key, make_drafter
from .draftlen import PassCost
from .engine import resolve_seed, verify_mode
from .llama import MAX_EXACT_BATCH, Context, ContextParams, LlamaError, Model
from .params import SpecParams
from .sampling import sample
from .stats import DrafterStats, GenStats
from .types import Draft, Drafter, DraftOptions, SamplingParams, TargetPass, common_prefix
from .verify import verify

FA_TILE_Q = MAX_EXACT_BATCH + 1   # a sequence's rows in a ubatch from which flash attention tiles
SHARE_MIN = 8                     # a prompt prefix worth copying from another sequence (tokens)


def draft_budget(n_active: int, rows: int) -> int:
    """The longest draft of each generating sequence in a step: `rows` draft tokens shared by the
    n_active sequences, none once there are more sequences than rows (every row of a large batch
    is then a one-token step). A fixed rule; the adaptive one (expected tokens per unit of step
    time, draftlen.PassCost of the batch) is not built yet."""
    return rows // n_active if n_active else rows


@dataclass(frozen=True, slots=True)
class BatchParams:
    n_seq: int = 4              # sequences (slots) in the context
    n_ctx_seq: int = 4096       # KV cells of each sequence
    n_batch: int = 2048         # rows of one decode
    n_ubatch: int = 512         # prompt chunk (as the Engine's)
    n_threads: int = 0          # 0: default_threads()
    draft_rows: int = 16        # draft tokens a step verifies, all sequences together (draft_budget)
    draft_model: str | None = None   # -md for draft-simple
    share_min: int = SHARE_MIN


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


class Handle:
    """A submitted request as it goes: tokens (every token emitted so far), stats (GenStats),
    done once it stopped (stats.stop says why). cancel() from any thread ends it at the next step."""

    def __init__(self, req: Request) -> None:
        self.request = req
        self.tokens: list[int] = []
        self.stats = GenStats()
        self.done = False
        self.error = ""                 # why it stopped with stop "error"
        self.seq = -1                   # its sequence while active
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
        self.kv: list[int] = []
        self.h: Handle | None = None
        self.drafter_cache: dict[tuple, Drafter] = {}
        self.drafters: list[Drafter] = []
        self.prompt = np.zeros(0, dtype=np.int32)
        self.text: list[int] = []          # prompt + emitted tokens (ends with id_last once generating)
        self.wait: tuple[int, int] | None = None   # (source seq, tokens) to copy before evaluating
        self.which = -1                    # the drafter whose proposal the last draft was
        self.sampling = SamplingParams()
        self.spec = SpecParams()
        self.limit = 0
        self.t0 = 0.0
        self.t_gen0 = 0.0

    @property
    def prefilling(self) -> bool:
        return len(self.kv) < len(self.prompt)

    def planned(self) -> list[int]:
        """What the KV will hold: its request's prompt and text, or (idle) what it holds."""
        return self.text if self.h is not None else self.kv


class BatchEngine:
    """A target model and one context of params.n_seq sequences; requests in, tokens out.

    submit() is thread-safe; step() and close() belong to one thread. Each request's text is the
    same request's alone (Engine, exact mode, no fast prompt path) at temperature 0 and, seeded,
    under sample-and-match verification, whatever else is in the batch."""

    def __init__(self, model_path: str, params: BatchParams = BatchParams(), *, model: Model | None = None) -> None:
        self.params = params
        self._own_model = model is None
        self.model = model if model is not None else Model(model_path, exact=True)
        self.ctx: Context | None = None
        try:
            self.ctx = Context(self.model, ContextParams(
                n_ctx=params.n_ctx_seq * params.n_seq, n_batch=params.n_batch, n_ubatch=params.n_ubatch,
                n_threads=params.n_threads, n_seq_max=params.n_seq, kv_unified=False))
        except BaseException:
            self.close()
            raise
        self.n_ctx_seq = self.ctx.n_ctx // params.n_seq   # llama.cpp rounds n_ctx up (to 256)
        self.n_max_cap = min(MAX_EXACT_BATCH - 1, self.ctx.n_batch - 1)
        self.target = TargetView(self.model, self.ctx, self.n_ctx_seq, self.ctx.n_batch, params.n_threads, True)
        self.seqs = [_Seq(i) for i in range(params.n_seq)]
        self.pass_cost = PassCost()     # t(rows) of the shared decodes (for an adaptive budget)
        self._queue: deque[Handle] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)

    def close(self) -> None:
        for s in self.__dict__.get("seqs", []):
            for d in s.drafter_cache.values():
                d.close()
            s.drafter_cache = {}
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
        if req.sampling.constrained:
            raise SpecrunError("penalties, logit bias, --ignore-eos and grammars are not served by the batched "
                               "engine yet")
        hidden = [t for t in req.spec.types if t in HIDDEN_TYPES]
        if hidden and req.drafters is None:
            raise SpecrunError(f"--spec-type {hidden[0]} reads the target's hidden rows, which the batched engine "
                               "does not export per sequence yet")
        h = Handle(req)
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

    def _admit(self) -> None:
        """Queued requests into free sequences: the one whose KV shares the longest prefix with the
        prompt; then, when another sequence holds (or is evaluating) a longer prefix of it, that
        prefix is copied from there (seq_cp) once it is in place."""
        while True:
            free = [s for s in self.seqs if s.h is None]
            with self._lock:
                if not free or not self._queue:
                    return
                h = self._queue.popleft()
            req = h.request
            prompt = np.asarray(req.prompt, dtype=np.int32)
            s = max(free, key=lambda q: common_prefix(q.kv, prompt))
            s.h, h.seq, s.t0 = h, s.sid, time.perf_counter()
            s.sampling, s.spec = resolve_seed(req.sampling), req.spec
            s.limit = req.n_predict if req.n_predict >= 0 else self.n_ctx_seq
            try:
                s.drafters = self._drafters_of(s, req)
            except BaseException:
                self._finish(s, "error")
                raise
            h.stats = GenStats(n_prompt_total=len(prompt), exact=True, seed=s.sampling.seed,
                               drafters=[DrafterStats(d.spec_type) for d in s.drafters])
            if s.limit == 0:
                self._finish(s, "n_predict")
                continue
            s.prompt, s.text = prompt, prompt.tolist()
            keep = min(common_prefix(s.kv, prompt), len(prompt) - 1)
            opts = DraftOptions(s.spec.p_min, s.sampling if s.spec.verify in ("auto", "rejection")
                                and not s.sampling.greedy else None)
            for d in s.drafters:
                keep = min(keep, d.begin(prompt, keep, opts))
            src, best = None, keep
            for o in self.seqs:
                if o is not s:
                    c = min(common_prefix(o.planned(), prompt), len(prompt) - 1)
                    if c > best and c >= self.params.share_min:
                        src, best = o, c
            self._trim(s, keep)
            h.stats.n_prompt = len(prompt) - keep
            s.wait = (src.sid, best) if src is not None else None

    def _trim(self, s: _Seq, keep: int) -> None:
        if len(s.kv) > keep and not self.ctx.seq_rm_of(s.sid, keep, -1):
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
            if have >= n:
                self.ctx.seq_cp(src.sid, s.sid)
                if not self.ctx.seq_rm_of(s.sid, n, -1):
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
        for s in self.seqs:
            if s.h is not None and s.h.cancelled:
                out.append((s.h, []))
                self._finish(s, "interrupted")
        self._admit()
        self._copy_prefixes()
        active = [s for s in self.seqs if s.h is not None and s.wait is None]
        gen = [s for s in active if not s.prefilling]
        budget = draft_budget(len(gen), self.params.draft_rows)
        rows: list[tuple[_Seq, list[int], int, bool, Draft | None]] = []   # (seq, tokens, pos0, outputs?, draft)
        n_rows = 0
        spare = self.ctx.n_batch - len(gen)       # rows left for drafts and prompt chunks
        for s in gen:
            draft = self._propose(s, min(budget, self._room(s), spare))
            spare -= len(draft)
            rows.append((s, [s.text[-1], *draft.tokens.tolist()], len(s.text) - 1, True, draft))
            n_rows += len(draft) + 1
        for s in active:
            if not s.prefilling:
                continue
            lo = len(s.kv)
            chunk = s.prompt[lo:lo + self.params.n_ubatch].tolist()
            if len(chunk) >= FA_TILE_Q:       # its own decode: the tiled kernel for all its rows
                self._prompt_chunk(s, chunk, lo, out)
            elif len(chunk) <= spare:         # else at a later step
                rows.append((s, chunk, lo, False, None))
                n_rows += len(chunk)
                spare -= len(chunk)
        if not rows:
            return out
        toks, pos, seqs, outs = [], [], [], []
        for s, t, p0, all_out, _ in rows:
            toks += t
            pos += range(p0, p0 + len(t))
            seqs += [s.sid] * len(t)
            last = len(s.kv) + len(t) == len(s.prompt)
            outs += [True] * len(t) if all_out else [False] * (len(t) - 1) + [last]
        t0 = time.perf_counter()
        try:
            self.ctx.decode_seqs(toks, pos, seqs, outs)
        except LlamaError as e:               # llama.cpp left the memory as it was: fail these requests
            for s, *_ in rows:
                self._fail(s, e, out)
            return out
        self.pass_cost.record(n_rows, time.perf_counter() - t0)
        logits = self.ctx.outputs_rows()          # float32 [n_outputs, n_vocab], batch order
        i = 0
        for s, t, p0, all_out, draft in rows:
            n_out = len(t) if all_out else int(len(s.kv) + len(t) == len(s.prompt))
            mine = logits[i:i + n_out]
            i += n_out
            if draft is None:
                self._prompt_done(s, t, p0, mine, out)
            else:
                self._verified(s, draft, mine, out)
        return out

    def _room(self, s: _Seq) -> int:
        """The longest draft sequence s may verify now: tokens left, cells left, exact mode's cap."""
        n_past = len(s.text) - 1
        return max(0, min(s.limit - len(s.h.tokens) - 1, self.n_ctx_seq - n_past - 2, self.n_max_cap))

    def _propose(self, s: _Seq, k_cap: int) -> Draft:
        """The first non-empty proposal of the sequence's drafters (llama.cpp's order), at most k_cap."""
        if k_cap <= 0:
            return Draft.empty()
        ctx = np.asarray(s.text, dtype=np.int32)
        for i, d in enumerate(s.drafters):
            cap = min(k_cap, draft_n_max(d.spec_type, s.spec))
            t = time.perf_counter()
            draft = d.propose(ctx, cap)
            st = s.h.stats.drafters[i]
            st.n_call_draft += 1
            st.t_draft_s += time.perf_counter() - t
            if len(draft) > cap:
                raise SpecrunError(f"the {d.spec_type} drafter proposed {len(draft)} tokens when asked for at most {cap}")
            if len(draft) and len(draft) >= s.spec.n_min:
                s.which = i
                return draft
        return Draft.empty()

    def _prompt_chunk(self, s: _Seq, chunk: list[int], lo: int, out: list) -> None:
        last = lo + len(chunk) == len(s.prompt)
        try:
            self.ctx.decode_seqs(chunk, range(lo, lo + len(chunk)), [s.sid] * len(chunk),
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
        if s.prefilling:
            return
        h = s.h
        n_past = len(s.prompt)
        tok = sample(rows[-1], s.sampling, n_past)
        s.t_gen0 = time.perf_counter()
        h.stats.t_prompt_s = s.t_gen0 - s.t0
        self._emit(s, [tok], out)

    def _verified(self, s: _Seq, draft: Draft, rows: np.ndarray, out: list) -> None:
        """Sequence s's verify rows [id_last, d1..dk] came back: accept, roll back, emit."""
        n_past = len(s.text) - 1                # id_last's position
        k = len(draft)
        mode = verify_mode(s.spec, s.sampling, draft)
        verdict = verify(draft, rows, s.sampling, n_past + 1, mode)
        n_keep = verdict.n_accepted + 1
        batch = [s.text[-1], *draft.tokens.tolist()]
        if s.drafters:
            tp = TargetPass(np.asarray(batch, dtype=np.int32), n_past, n_keep, None)
            for d in s.drafters:
                d.accept(tp)
        if n_keep < k + 1 and not self.ctx.seq_rm_of(s.sid, n_past + n_keep, -1):
            raise LlamaError(f"could not roll sequence {s.sid} back to {n_past + n_keep} tokens")
        s.kv.extend(batch[:n_keep])
        st = s.h.stats
        st.n_target_passes += 1
        if k:
            st.verify = mode
            st.drafters[s.which].record(k, verdict.n_accepted)
        self._emit(s, verdict.tokens.tolist(), out)

    def _emit(self, s: _Seq, toks: list[int], out: list) -> None:
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
        self.ctx.seq_rm_of(s.sid, len(s.kv), -1)
        s.h.error = str(e)
        out.append((s.h, []))
        self._finish(s, "error")

    def _finish(self, s: _Seq, stop: str) -> None:
        """The request ends: its handle done; the sequence free, its KV kept for a later prompt."""
        h = s.h
        h.stats.stop = h.stats.stop or stop
        h.done = True
        s.h, s.wait, s.drafters = None, None, []
        s.text = []

    # -- convenience -----------------------------------------------------------------------
    def run(self, requests: Sequence[Request]) -> list[Handle]:
        """Submit every request and step until all are done (tests, scripts)."""
        hs = [self.submit(r) for r in requests]
        while not all(h.done for h in hs):
            self.step()
        return hs
