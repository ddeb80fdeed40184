"""The speculative generation loop over one target context.

    id_last = sample(prefill(prompt))                      # position n_past = len(prompt)
    loop:
        draft   = first non-empty proposal of the drafters  # llama.cpp's order: n-grams first
                                                            # (adaptive copy drafters: the best one)
        logits  = target.decode([id_last, d1..dk])          # ONE pass, k+1 output rows
        verdict = verify(draft, logits)                     # accepted d1..dn + one target token
        target.seq_rm(n_past + n + 1)                       # roll back the rejected rows
        drafters.accept(pass); emit verdict.tokens; id_last = verdict.tokens[-1]

What the output is, exactly: every emitted token at absolute position pos takes its random draw
from a stream keyed by (seed, pos), and in exact mode a verify row's logits are bit-identical to
one-token decoding (quantized weights; F16/F32 matrices differ by rounding, see the stats line).
So with `--spec-verify match` (and `auto` at temperature 0, or with a drafter that has no
distribution: n-grams) the output equals `--spec-type none` token for token. With
`--spec-verify rejection` (and `auto` at temperature > 0 with `draft` or `draft-mtp`) it is
speculative sampling: the output follows the model's distribution exactly, but is a different
sample from the one plain decoding draws with the same seed.

The engine keeps the conversation's KV cache between calls: a new prompt that extends the tokens
already in the cache only evaluates the new tokens (chat turns, server slots).
"""

from __future__ import annotations

import ctypes
import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from .constrain import Constraints, VerifyPass
from .drafters import HIDDEN_TYPES, TargetView, draft_n_max, drafter_key, make_drafter
from .draftlen import DraftLength, PassCost, VerifyCost, curve_of, curve_rows
from .llama import MAX_EXACT_BATCH, Context, ContextParams, LlamaError, Model
from .params import IN_ORDER, NGRAM_TYPES, SPEC_TYPE, EngineParams, SpecParams, no_mtp_heads
from .prefill import FastPrefill, RowsWanted, fast_len
from .prefill_worker import PrefillHandle, PrefillWorker, SharedPrefill, uses_worker
from .sampling import sample
from .stats import DrafterStats, GenStats
from .types import (
    LLAMA_DEFAULT_SEED,
    NO_STOPS,
    Draft,
    Drafter,
    DraftOptions,
    SamplingParams,
    Stops,
    TargetPass,
    TokenLogprob,
    Verdict,
    common_prefix,
    draft_end,
    draft_head,
    token_logprob,
)
from .verify import verify

log = logging.getLogger(__name__)

_SAMPLING_DEFAULT = SamplingParams()  # llama.cpp's defaults (temp 0.8)


def verify_mode(spec: SpecParams, sampling: SamplingParams, draft: Draft) -> str:
    """'match' (sample the target, accept while equal) or 'rejection' (speculative sampling)."""
    if spec.verify != "auto":
        return spec.verify
    return "rejection" if not sampling.greedy and draft.probs is not None else "match"


def resolve_seed(sampling: SamplingParams) -> SamplingParams:
    """A random seed for llama.cpp's 'random' marker, so the stats can say which one was used."""
    if sampling.seed == LLAMA_DEFAULT_SEED:
        return replace(sampling, seed=random.SystemRandom().randrange(0, 2**32 - 1))
    return sampling


def _never() -> bool:
    return False


class Generation:
    """One generation in progress. Iterate it for the emitted tokens (lists, in order); `stats`
    fills as it goes and is final once the iteration ends or close() stops it early. logprobs:
    one TokenLogprob per emitted token, in order, when generate() was asked for them (else None)."""

    def __init__(self, steps: Iterator[list[int]], stats: GenStats, logprobs: list[TokenLogprob] | None = None) -> None:
        self._steps = steps
        self.stats = stats
        self.logprobs = logprobs

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> list[int]:
        return next(self._steps)

    def close(self) -> None:
        self._steps.close()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def ask(d: Drafter, ctx: np.ndarray, cap: int, ds: DrafterStats, stops: Stops, model: Model) -> Draft:
    """d's proposal of at most cap tokens after ctx (int32 [n]), timed and counted in ds, cut after
    the first token where the text ends (draft_end). A longer proposal is a SpecrunError."""
    t = time.perf_counter()
    draft = d.propose(ctx, cap)
    ds.n_call_draft += 1
    ds.t_draft_s += time.perf_counter() - t
    if len(draft) > cap:
        raise SpecrunError(f"the {d.spec_type} drafter proposed {len(draft)} tokens when asked for at most {cap}")
    return draft_head(draft, draft_end(draft.tokens, ctx, stops, model.piece, model.is_eog))


def _free_proposals(d: Drafter) -> bool:
    """Whether a drafter's proposal is only a lookup in the tokens (the n-gram drafters), so that a
    draft may be made and scored without verifying it (adaptive length 0, its proposals scored whole)."""
    return d.spec_type in NGRAM_TYPES


class Engine:
    """A target model and context, plus the drafters of the chosen spec types."""

    def __init__(self, model_path: str, params: EngineParams | None = None, *, model: Model | None = None,
                 prefill: SharedPrefill | None = None) -> None:
        """model: an already loaded Model to share (server slots); the engine then does not close it.
        prefill: another engine's prompt worker to share (share_prefill()), where this engine takes
        the fast prompt path."""
        self.params = params = params or EngineParams()
        spec = params.spec
        # draft-mtp reads the heads of the main GGUF, or of -md HEADS.gguf when no draft model / EAGLE-3 uses -md
        kinds = [SPEC_TYPE[t] for t in spec.types if t in SPEC_TYPE]   # another name: make_drafter says so
        self._heads_path = params.draft_model if params.draft_model and not any(k.md for k in kinds) else None
        needs_mtp = any(k.mtp_heads for k in kinds) and self._heads_path is None
        self._own_model = model is None
        self.model = model if model is not None else Model(model_path, exact=params.exact, load_mtp=needs_mtp,
                                                                    placement=params.placement)
        self.ctx = None
        self._drafters: dict[tuple, Drafter] = {}
        if needs_mtp and self.model.n_layer_nextn <= 0:
            self.close()
            raise no_mtp_heads(model_path)
        # the longest draft: every n-gram type's own bound (a request may switch to any of them) and
        # the model drafters' n-max; exact mode keeps verify batches under flash attention's 64-row
        # tiled kernel
        self.n_max_cap = max(16, spec.n_max, *(draft_n_max(t, spec) for t in NGRAM_TYPES))
        if params.exact:
            self.n_max_cap = min(self.n_max_cap, MAX_EXACT_BATCH - 1)
        self.mtp_enabled = any(k.mtp_heads for k in kinds) or (self.model.load_mtp and self.model.n_layer_nextn > 0)
        try:
            if not params.n_ctx and self.model.n_ctx_train <= 0:    # llama.cpp reads context_length as int32
                raise SpecrunError(f"{model_path}: -c 0 takes the model's training context, and llama.cpp reads "
                                   f"{self.model.n_ctx_train} from the file's context_length; give a size, "
                                   "e.g. -c 4096")
            self.ctx = Context(self.model, ContextParams(
                n_ctx=params.n_ctx or self.model.n_ctx_train, n_batch=max(params.n_batch, self.n_max_cap + 1),
                n_threads=params.n_threads, n_rs_seq=self._rollback(spec), nextn="all" if self.mtp_enabled else None,
                type_k=params.kv.type_k, type_v=params.kv.type_v, flash_attn=params.kv.flash_attn))
            self.n_ctx = self.ctx.n_ctx
            # llama.cpp caps n_batch at the n_ctx asked for (-c 16: 16, in a context that holds 256):
            # a verify pass is one batch, so no draft may be longer than n_batch - 1
            self.n_max_cap = min(self.n_max_cap, self.ctx.n_batch - 1)
            self.kv_tokens: list[int] = []      # tokens held in the target KV at positions 0..n-1
            # prompts of MIN_PROMPT+ tokens: all of them through the fast prompt context (repacked
            # weights, F16 KV), handed over to the exact context; not for MTP (hidden rows) nor
            # recurrent memory
            self.fast: FastPrefill | PrefillWorker | PrefillHandle | None = None
            if (params.exact and params.fast_prefill and not self.mtp_enabled
                    and params.placement is None      # over RPC the state copy would cross the network
                    and not self.model.recurrent):
                # in a child process where the file has matrices llama.cpp's tiled kernel takes
                worker = params.prefill_worker if params.prefill_worker is not None else uses_worker(self.model)
                if prefill is not None and worker:
                    self.fast = prefill.handle()
                else:
                    self.fast = (PrefillWorker if worker else FastPrefill)(self.model, self.n_ctx, params.n_threads,
                                                                           self.ctx.kv_rot, self.ctx.k_type)
            self._restored = 0   # the prompt length the exact context was loaded with by a hand-over; 0: none
            self._prompt_logits: np.ndarray | None = None   # float32 [n_vocab]: that prompt's last logits
            self.pass_cost = PassCost()   # t(rows) of this engine's target passes (adaptive draft length)
            self.target = TargetView(self.model, self.ctx, self.n_ctx, self.ctx.n_batch, params.n_threads,
                                     params.exact, self.fast is not None)
            self.drafters = self.drafters_for(spec)
        except BaseException:
            self.close()
            raise

    # -- set-up ------------------------------------------------------------------------------
    def drafters_for(self, spec: SpecParams) -> list[Drafter]:
        """The drafters of spec.types (llama.cpp's order), built once and cached by their settings."""
        if not self.mtp_enabled and any(t in SPEC_TYPE and SPEC_TYPE[t].mtp_heads for t in spec.types):
            raise SpecrunError("draft-mtp was not enabled when the model was loaded; restart with "
                               "--spec-type draft-mtp")
        out = []
        for t in spec.types:
            key = drafter_key(t, spec)
            if key not in self._drafters:
                self._drafters[key] = make_drafter(t, self.target, spec, draft_path=self.params.draft_model,
                                                   heads_path=self._heads_path)
            out.append(self._drafters[key])
        return out

    @property
    def spec_types(self) -> tuple[str, ...]:
        """The spec types this engine can build, in llama.cpp's order: every n-gram type, the types
        that draft with -md among those it runs, and draft-mtp when its heads are loaded."""
        return tuple(t.name for t in IN_ORDER if not t.model or (t.mtp_heads and self.mtp_enabled)
                     or (not t.mtp_heads and t.name in self.params.spec.types))

    def set_spec(self, spec: SpecParams) -> None:
        """Switch spec types for the next generations (chat /spec, auto's choice); builds the drafters
        now. A hybrid model's context is made again (its cached prompt dropped) when the new types
        roll back another number of tokens (_rollback)."""
        drafters = self.drafters_for(spec)      # a spec that cannot run changes nothing
        if self.model.recurrent and (need := self._rollback(spec)) != self.ctx.params.n_rs_seq:
            self._remake_ctx(need)
            drafters = self.drafters_for(spec)
        self.drafters = drafters
        self.params = replace(self.params, spec=spec)

    def _rollback(self, spec: SpecParams, drafters: Sequence[Drafter] = ()) -> int:
        """The recurrent-state snapshots a hybrid model's context keeps (llama.cpp's n_rs_seq): the
        longest draft of the drafters that read the target's rows (draft-mtp, draft-eagle3: their
        contexts follow the target's, so its rollback must be in place), within the cap; 0 for the
        others, as llama.cpp's need_n_rs_seq. Every decode writes the snapshots (each a copy of the
        state), so each one costs time on every token (docs/design.md, "Hybrid models"): n-gram and
        draft-model drafts longer than the snapshots are verified behind a checkpoint instead
        (_step). Other models ignore it."""
        hidden = ([d.spec_type for d in drafters if d.needs_hidden] if drafters
                  else [t for t in spec.types if t in HIDDEN_TYPES])
        return max((min(draft_n_max(t, spec), self.n_max_cap) for t in hidden), default=0)

    def _remake_ctx(self, n_rs_seq: int) -> None:
        """The target context again with n_rs_seq snapshots (a hybrid model's rollback depth). Its KV
        and every cached drafter go (drafters read the target's context); the pass costs start over."""
        self._drop_drafters()
        params = replace(self.ctx.params, n_rs_seq=n_rs_seq)
        self.ctx.close()
        self.ctx = None
        self.ctx = Context(self.model, params)
        self.kv_tokens = []
        self._restored, self._prompt_logits = 0, None
        self.pass_cost = PassCost()
        self.target = replace(self.target, ctx=self.ctx)
        log.info("target context made again with %d recurrent-state snapshots (rollback depth)", n_rs_seq)

    def start_prefill(self) -> None:
        """Start the prompt worker, or load the in-process fast context's repacked twin, now (a
        server, at load) rather than at the first long prompt."""
        w = self.fast.worker if isinstance(self.fast, PrefillHandle) else self.fast
        if w is not None:
            w.start()

    def share_prefill(self) -> SharedPrefill | None:
        """This engine's prompt worker made shareable (Engine(..., prefill=) for the other slots over
        the same model), or None when it has none (its fast prompt context, if any, stays its own)."""
        if isinstance(self.fast, PrefillHandle):
            return self.fast.shared
        if not isinstance(self.fast, PrefillWorker):
            return None
        shared = SharedPrefill(self.fast)
        self.fast = shared.handle()
        return shared

    def _drop_drafters(self) -> None:
        """Close every cached drafter; none is made until asked for again."""
        for d in self.__dict__.get("_drafters", {}).values():
            d.close()
        self._drafters, self.drafters = {}, []

    def close(self) -> None:
        self._drop_drafters()
        if self.__dict__.get("fast") is not None:
            self.fast.close()
        if self.__dict__.get("ctx") is not None:
            self.ctx.close()
        if self.__dict__.get("_own_model") and self.__dict__.get("model") is not None:
            self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tokenize(self, text: str, add_special: bool = True) -> np.ndarray:
        return self.model.tokenize(text, add_special=add_special)

    def reset(self, drafters: bool = False) -> None:
        """Forget every cached prompt (the fast prompt context's blocks too); memory stays allocated.
        drafters: the cached drafters go too, and what they keep of earlier requests (suffix's global
        tree), made again as in a fresh process."""
        if drafters:
            self._drop_drafters()
            self.drafters = self.drafters_for(self.params.spec)
        self.ctx.clear()
        self.kv_tokens = []
        self._restored, self._prompt_logits = 0, None
        if self.fast is not None:
            self.fast.forget()

    # -- the loop ----------------------------------------------------------------------------
    def generate(self, prompt: Sequence[int], n_predict: int = -1, sampling: SamplingParams = _SAMPLING_DEFAULT,
                 *, spec: SpecParams | None = None, drafters: Sequence[Drafter] | None = None,
                 cancel: Callable[[], bool] | None = None, logprobs: int | None = None,
                 stops: Stops = NO_STOPS) -> Generation:
        """Start generating after prompt: the tokens come by iterating the Generation, until
        end-of-generation, n_predict tokens (-1: no limit) or a full context.

        requires: 1 <= len(prompt) < n_ctx; spec.n_max <= n_max_cap when it names a model drafter.
        Draft lengths as llama.cpp's: --spec-draft-n-max bounds draft-model and MTP drafts, size_m
        bounds n-gram drafts; then the room left in the context and the tokens left to generate.
        spec: None = the engine's own; drafters: explicit drafter objects (tests), with spec's numbers.
        cancel: polled between prompt chunks (n_ubatch tokens each) and target passes; once it
        returns True the generation ends with stop "interrupted" (a long prompt stops mid-way).
        logprobs: None = off; n >= 0: Generation.logprobs gets each emitted token's log-probability
        under the target and its n most likely alternatives (from the rows the verify pass computed).
        stops: where the caller will end the text (stop strings, stop tokens); no draft token past
        one is verified (types.draft_end). The caller still stops the generation itself.
        The random draw of the token at absolute position pos comes from the stream (sampling.seed,
        pos): seeded output is reproducible and, under sample-and-match, independent of the spec type.
        The logit controls in sampling (penalties, logit bias, --ignore-eos, a grammar) transform every
        row with the state of the tokens before it (kernels.constrain), so they keep that property;
        a grammar that does not parse or a bad logit bias is a SpecrunError here, before any work.
        """
        prompt = np.asarray(prompt, dtype=np.int32)
        if len(prompt) == 0:
            raise SpecrunError("the prompt is empty; give some text with -p or -f")
        if len(prompt) >= self.n_ctx:
            raise SpecrunError(f"the prompt exceeds the context size ({len(prompt)} tokens, ctx {self.n_ctx}); "
                               "raise -c or shorten the prompt")
        spec = spec or self.params.spec
        explicit = drafters is not None
        need = self._rollback(spec, drafters or ()) if self.model.recurrent else 0
        if need > self.ctx.params.n_rs_seq:
            # a longer draft than the context can roll back (a request's own spec types): make it
            # again, deeper, once; drafters that read the old context cannot follow
            if explicit and any(d.needs_hidden for d in drafters):
                raise SpecrunError(f"these drafters need {need} tokens of rollback and "
                                   f"the target context keeps {self.ctx.params.n_rs_seq}; build the engine with "
                                   "their spec types")
            self._remake_ctx(need)
            self.drafters = self.drafters_for(self.params.spec)
        if drafters is None:
            drafters = self.drafters if spec is self.params.spec else self.drafters_for(spec)
        for d in drafters:
            if not _free_proposals(d) and spec.n_max > self.n_max_cap:   # n-gram drafts: cut at the cap
                exact_cap = self.params.exact and self.n_max_cap == MAX_EXACT_BATCH - 1
                why = (" (exact mode verifies at most 63 rows)" if exact_cap
                       else f" (it was started with --spec-draft-n-max {self.params.spec.n_max})")
                fix = "--no-exact, whose verify passes have no such bound" if exact_cap else \
                    "restart with a larger --spec-draft-n-max"
                raise SpecrunError(f"draft n-max {spec.n_max} is above this engine's cap of {self.n_max_cap}{why}; "
                                   f"ask for at most {self.n_max_cap}, or {fix}")
        sampling = resolve_seed(sampling)
        cons = Constraints.of(self.model, sampling, self.n_ctx, prompt)
        st = GenStats(n_prompt_total=len(prompt), exact=self.params.exact, seed=sampling.seed,
                      exact_caveat=self.params.exact_caveat if self.params.exact else None,
                      drafters=[DrafterStats(d.spec_type) for d in drafters])
        limit = n_predict if n_predict >= 0 else self.n_ctx
        lp: list[TokenLogprob] | None = None if logprobs is None else []
        return Generation(self._run(prompt, limit, sampling, spec, list(drafters), st, cancel or _never, lp, logprobs,
                                    cons, stops), st, lp)

    def _run(self, prompt: np.ndarray, limit: int, sampling: SamplingParams, spec: SpecParams,
             drafters: list[Drafter], st: GenStats, cancel: Callable[[], bool],
             lp: list[TokenLogprob] | None, n_top: int | None, cons: Constraints | None,
             stops: Stops) -> Iterator[list[int]]:
        sample_drafts = spec.verify in ("auto", "rejection") and not sampling.greedy
        opts = DraftOptions(spec.p_min, sampling if sample_drafts else None)
        # each drafter's longest draft (n-grams: size_m, models: n_max), within the engine's cap; an
        # n-gram copy longer than the cap (exact mode: 62 tokens) is cut there
        n_lim = [min(draft_n_max(d.spec_type, spec), self.n_max_cap) for d in drafters]
        # each drafter's draft length: its limit, or (--spec-draft-adaptive) what pays at its running
        # acceptance; adaptive n-gram drafters may be held back, their whole proposals scored instead
        lens = [DraftLength(n, spec.adaptive, 0 if spec.adaptive and _free_proposals(d) else 1)
                for d, n in zip(drafters, n_lim, strict=True)]
        for dl in lens:
            dl.start(self.pass_cost)
        n_emitted, t0, t_gen0 = 0, time.perf_counter(), None
        # a hybrid model's drafts past its snapshots go behind a checkpoint (_step), unless a drafter
        # reads the target's rows (its context cannot be restored with the target's)
        ckpt_ok = self.model.recurrent and not any(d.needs_hidden for d in drafters)
        replay: list[int] = []      # tokens to evaluate again after a checkpoint restore (_step)
        try:
            if limit == 0:
                st.stop = "n_predict"
                return
            if spec.adaptive and drafters and len(self.pass_cost.sums) < 3:
                self._measure_pass_cost(min(max(n_lim) + 1, self.n_max_cap + 1))
                t0 = time.perf_counter()   # a once-per-engine probe, as loading: not the prompt's time
            n_past = len(prompt)
            logits = self._prefill(prompt, drafters, opts, st, cancel)
            if logits is None:
                st.stop = "interrupted"
                return
            id_last = sample(logits if cons is None else cons.row(logits), sampling, n_past)
            if cons is not None:
                cons.accept([id_last])
            if lp is not None:
                lp.append(token_logprob(logits, id_last, n_top))
            t_gen0 = time.perf_counter()
            st.t_prompt_s = t_gen0 - t0
            # the text so far, int32 [n_text] in a buffer for the whole context: drafters and the draft
            # lengths read views of it, which appending never changes; appended to through ctypes
            # (numpy's slice assignment costs more right after a decode)
            text_c = (ctypes.c_int32 * (self.n_ctx + 1))()
            text, n_text = np.ctypeslib.as_array(text_c), len(prompt) + 1
            text[:n_text - 1], text[n_text - 1] = prompt, id_last
            n_emitted = st.n_gen = 1         # n_gen follows the tokens as they go (a server's /slots reads it)
            if self.model.is_eog(id_last) or limit == 1:
                st.stop = "eog" if self.model.is_eog(id_last) else "n_predict"
            yield [id_last]
            while not st.stop:
                if n_emitted >= limit or n_past + 1 > self.n_ctx - 1 or cancel():
                    st.stop = "n_predict" if n_emitted >= limit else "ctx" if n_past + 1 > self.n_ctx - 1 \
                        else "interrupted"
                    return
                k_cap = min(limit - n_emitted - 1, self.n_ctx - n_past - 2)   # llama-server's n_draft_max
                if self.model.recurrent and (replay or not ckpt_ok):   # what the context can roll back
                    k_cap = min(k_cap, self.ctx.params.n_rs_seq, self.n_max_cap - len(replay))
                draft, which = self._propose(drafters, text[:n_text], k_cap, lens, spec.n_min, st, stops)
                vp = None
                if cons is not None:     # cut at the first token the constrained target cannot emit
                    vp = cons.verify_pass(draft)
                    draft, which = vp.draft, which if len(vp.draft) else -1
                try:
                    verdict, replay = self._step(id_last, n_past, draft, sampling, spec, drafters, vp, replay)
                finally:
                    if vp is not None:
                        vp.close()
                st.n_target_passes += 1
                st.n_restores += bool(replay)
                if which >= 0:
                    st.verify = verify_mode(spec, sampling, draft)   # empty drafts are plain steps
                    st.drafters[which].record(len(draft), verdict.n_accepted)
                    lens[which].record(len(draft), verdict.n_accepted, self.pass_cost)
                n_past += verdict.n_accepted + 1
                out = verdict.tokens.tolist()
                id_last = out[-1]
                for j, t in enumerate(out):
                    if self.model.is_eog(t):
                        out, st.stop = out[:j + 1], "eog"
                        break
                if n_emitted + len(out) >= limit:
                    out, st.stop = out[:limit - n_emitted], st.stop or "n_predict"
                if lp is not None:       # row j of the verify pass is the distribution of emitted token j
                    rows = self.ctx.logits_rows()
                    lp.extend(token_logprob(rows[j], t, n_top) for j, t in enumerate(out))
                text_c[n_text:n_text + len(out)] = out
                n_text += len(out)
                for dl in lens:                  # the pending proposals the new tokens decide
                    dl.score(text[:n_text], self.pass_cost)
                if cons is not None:
                    cons.accept(out)
                n_emitted += len(out)
                st.n_gen = n_emitted
                yield out
        except GeneratorExit:
            st.stop = st.stop or "interrupted"
            raise
        finally:
            if cons is not None:
                cons.close()
            st.n_gen = n_emitted
            if t_gen0 is not None:
                st.t_gen_s = time.perf_counter() - t_gen0
            else:
                st.t_prompt_s = time.perf_counter() - t0

    def _measure_pass_cost(self, max_rows: int, rounds: int = 2) -> None:
        """Time target passes of draftlen.curve_rows(max_rows) rows past the KV cache's end
        (measure_passes): what --spec-draft-adaptive needs to know before any draft was long.
        `rounds` rounds, the fastest per row count (noise only adds time, and a row count the
        policy then avoids is never timed again), into pass_cost. Once per engine, unless seeded
        (seed_pass_cost: auto's calibration), and not counted as prompt time. Its cost:
        docs/design.md, "The pass-cost curve"."""
        if len(self.kv_tokens) + max_rows >= self.n_ctx:
            return
        curve = self.measure_passes(curve_rows(max_rows), np.asarray(self.kv_tokens, dtype=np.int32), rounds,
                                    fastest=True)
        self.pass_cost.add(curve)
        self._log_pass_cost(curve.rows)

    def measure_passes(self, rows: Sequence[int], prefix: np.ndarray, rounds: int, *, warmup: bool = False,
                       fastest: bool = False, on_round: Callable[[int], None] | None = None) -> VerifyCost:
        """The one way target passes are timed: for each of `rows` (ascending), one decode of that many
        rows with logits past prefix (int32 [n0], the tokens in the KV cache at positions 0..n0-1),
        then removed again, as a rejected draft's rows are (a hybrid model's through a checkpoint of
        its state before them). The rows are prefix's tokens again (its first token: a BOS when
        empty). `rounds` rounds, interleaved so that drift hits every row count alike, after one
        untimed round when warmup; on_round(i) after each. Returns draftlen.curve_of the times: per
        row count the median, or the fastest.
        requires: n0 + rows[-1] <= n_ctx."""
        n = len(prefix)
        fill = np.resize(prefix if n else np.asarray([self.model.bos], dtype=np.int32), rows[-1]).astype(np.int32)
        if self.model.recurrent and n:       # a hybrid model goes back through a checkpoint
            self.ctx.checkpoint()
        times: dict[int, list[float]] = {int(r): [] for r in rows}
        for i in range(rounds + warmup):
            for r in rows:
                t = time.perf_counter()
                self.ctx.decode(fill[:r], n, "all")
                dt = time.perf_counter() - t
                if self.model.recurrent:
                    if n:
                        self.ctx.restore()
                    else:
                        self.ctx.clear()
                elif not self.ctx.seq_rm(n, -1):
                    raise LlamaError(f"could not remove {r} measuring rows at {n}")
                if i >= warmup:
                    times[int(r)].append(dt)
            if on_round:
                on_round(i)
        return curve_of(times, n, fastest)

    def seed_pass_cost(self, curve: VerifyCost) -> None:
        """Start the adaptive draft length's pass-cost curve anew from a measured one. auto hands over
        its calibration's curve (median of 5 interleaved rounds), so the first adaptive generation
        measures nothing; the engine's own passes refine it from there."""
        self.pass_cost = PassCost.of(curve)
        self._log_pass_cost(curve.rows)

    def _log_pass_cost(self, rows: Sequence[int]) -> None:
        log.info("target pass cost: %s", ", ".join(f"{r} rows {self.pass_cost.at(r) * 1e3:.1f} ms" for r in rows))

    def _propose(self, drafters: list[Drafter], ctx: np.ndarray, k_cap: int, lens: list[DraftLength], n_min: int,
                 st: GenStats, stops: Stops = NO_STOPS) -> tuple[Draft, int]:
        """A proposal of at least max(1, n_min) tokens, and its drafter's index (-1: none). A proposal
        ends at the first token where the text would end (draft_end). In llama.cpp's order, the first
        drafter with one; but adaptive drafters with free proposals (n-grams, suffix) are all asked,
        each for its longest draft, of which its DraftLength takes the part worth verifying (0: held
        back, and then asked only every few steps: DraftLength.pace), and the cut with the most
        expected tokens per second of them is drafted. Each whole proposal is scored against the
        text the target then emits, drafted or not."""
        if k_cap <= 0:
            return Draft.empty(), -1
        best: tuple[float, Draft, int] | None = None     # the best free drafter's (value, cut, index)
        for i, d in enumerate(drafters):
            dl = lens[i]
            if best is not None and not dl.free:
                break                          # a free drafter listed before it drafted
            cap = min(k_cap, dl.cap if dl.free else dl.n)
            if cap <= 0 or not dl.ask():
                continue
            draft = ask(d, ctx, cap, st.drafters[i], stops, self.model)
            if dl.free:
                v, _, toks = dl.best_cut(draft.tokens, len(ctx), cap, self.pass_cost, draft.kind)
                dl.pace(len(toks), st.drafters[i].t_per_call, self.pass_cost)
                if len(toks) and len(toks) >= n_min and (best is None or v > best[0]):
                    best = (v, Draft(toks), i)   # n-grams: no probs
            elif len(draft) > 0 and len(draft) >= n_min:
                return draft, i
        return (best[1], best[2]) if best is not None else (Draft.empty(), -1)

    def _step(self, id_last: int, n_past: int, draft: Draft, sampling: SamplingParams, spec: SpecParams,
              drafters: list[Drafter], vp: VerifyPass | None = None,
              replay: Sequence[int] = ()) -> tuple[Verdict, list[int]]:
        """One target pass over [id_last, d1..dk] at positions n_past..: verify the draft, roll back
        the rejected rows, tell every drafter what the target kept. vp: the logit controls' states
        for this draft's rows (row i read with the state after d1..di), or None.

        A hybrid model rolls back through its n_rs_seq snapshots; a longer draft is verified behind
        a checkpoint of its recurrent state, and a partial accept past the snapshots restores it:
        the kept tokens [id_last, d1..da] are then returned as `replay`, to be evaluated again in
        front of the next pass (at positions n_past - len(replay)..; output rows only from id_last
        on, and drafters see only those), as llama-server replays them. Returns (verdict, replay)."""
        k, r = len(draft), len(replay)
        batch = [*replay, id_last, *draft.tokens.tolist()] if k else [*replay, id_last]
        ckpt = self.model.recurrent and k > self.ctx.params.n_rs_seq
        if ckpt:
            self.ctx.checkpoint()
        t = time.perf_counter()
        self.ctx.decode(batch, n_past - r, r)
        self.pass_cost.record(r + k + 1, time.perf_counter() - t)
        rows = self.ctx.logits_rows()             # float32 [k + 1, n_vocab]
        verdict = verify(draft, rows if vp is None else vp.rows(rows), sampling, n_past + 1,
                         verify_mode(spec, sampling, draft))
        n_keep = verdict.n_accepted + 1
        if drafters:
            tp = self._target_pass(np.asarray(batch, dtype=np.int32), n_past - r, r + n_keep, r)
            for d in drafters:
                d.accept(tp)
        if n_keep < k + 1 and ckpt and k + 1 - n_keep > self.ctx.params.n_rs_seq:
            self.ctx.restore()                    # back to n_past - r; the logits rows stay
            return verdict, batch[:r + n_keep]
        if n_keep < k + 1 and not self.ctx.seq_rm(n_past + n_keep, -1):
            raise LlamaError(f"could not roll the KV cache back to {n_past + n_keep} tokens after a partial "
                             f"accept ({verdict.n_accepted}/{k}); n_rs_seq = {self.ctx.params.n_rs_seq}")
        self.kv_tokens.extend(batch[:r + n_keep])
        return verdict, []

    def _target_pass(self, tokens: np.ndarray, pos0: int, n_keep: int, skip: int = 0) -> TargetPass:
        """The last target decode (tokens at pos0.., the first n_keep kept), with the rows the
        context exports: hidden (MTP), the extract layers' inputs (EAGLE-3); without its first
        `skip` tokens (replayed ones, which the drafters have seen)."""
        hidden = self.ctx.nextn_rows()[skip:] if self.ctx.params.nextn else None
        features = self.ctx.layer_rows(self.ctx.layer_inp)[skip:] if self.ctx.layer_inp else None
        return TargetPass(tokens[skip:], pos0 + skip, n_keep - skip, hidden, features)

    def _prefill(self, prompt: np.ndarray, drafters: list[Drafter], opts: DraftOptions, st: GenStats,
                 cancel: Callable[[], bool]) -> np.ndarray | None:
        """Bring the KV cache to hold the prompt (reusing the common prefix the target and every
        drafter can keep) and return the logits row of its last token (a view, valid until the
        next decode); None when cancel() stopped it between two chunks (the chunks evaluated stay
        in the cache, ready for a retry).

        With the fast prompt context (prompts of MIN_PROMPT tokens or more), all of the prompt and
        its last logits come from it (kernels/prefill.py), and nothing is evaluated here; the cache
        is reused only where it was computed the way a fresh evaluation of this prompt computes it,
        so the result never depends on the history."""
        n = len(prompt)
        if self.ctx.pos_max() + 1 != len(self.kv_tokens):
            # an interrupt between a decode and its bookkeeping: trust nothing, start over
            log.info("KV cache (%d) and its token list (%d) disagree; clearing", self.ctx.pos_max() + 1,
                     len(self.kv_tokens))
            self.reset()
        fast = fast_len(n) if self.fast is not None else 0
        held = common_prefix(self.kv_tokens, prompt)
        keep = min(held, n - 1)
        if self._restored and not fast:
            keep = 0                        # positions computed another way than a fresh run would
        for d in drafters:
            keep = min(keep, d.begin(prompt, keep, opts))
        st.n_prompt = n - keep

        def on_chunk(chunk: np.ndarray, pos0: int) -> bool:
            if pos0 + len(chunk) > keep:     # the drafters' rows from their keep on
                tp = self._target_pass(np.asarray(chunk, dtype=np.int32), pos0, len(chunk), max(keep - pos0, 0))
                for d in drafters:
                    d.accept(tp)
            self.kv_tokens.extend(chunk.tolist())
            return not cancel()

        rows = None        # the rows a drafter reads at every prompt position (EAGLE-3's extract layers'
        if fast and any(d.needs_hidden for d in drafters):   # inputs): the fast context's, as it evaluates
            def on_rows(pos0: int, features: np.ndarray) -> None:
                tp = TargetPass(prompt[pos0:pos0 + len(features)], pos0, len(features), None, features)
                for d in drafters:
                    d.accept(tp)
            rows = RowsWanted(self.ctx.layer_inp, keep, on_rows)
        if fast:
            # this very prompt handed over before (its logits kept; and no rows wanted past the
            # drafters' keep), or a hand-over now; never roll a loaded state back below its last
            # position (sliding-window layers keep only the window below it)
            if self._restored == n == held and self._prompt_logits is not None and rows is None:
                self.ctx.keep_prefix(n, len(self.kv_tokens))
                del self.kv_tokens[n:]
                st.n_prompt = 0
            elif not self._hand_over(prompt, cancel, st, rows):
                return None
            else:
                st.n_prompt = st.n_prompt_fast
            start = len(self.kv_tokens)     # n, or fast_len when the hand-over failed for good
            if rows is not None and start == n:   # the drafters have all of the prompt already
                keep = start
            for s in range(keep, start, self.ctx.n_ubatch):   # the drafters follow without target rows
                chunk = prompt[s:min(s + self.ctx.n_ubatch, start)]
                for d in drafters:
                    d.accept(TargetPass(chunk, s, len(chunk), None))
            if self._prompt_logits is not None:
                return self._prompt_logits
            st.n_prompt = n
        else:
            start = keep = self.ctx.keep_prefix(keep, len(self.kv_tokens))
            st.n_prompt = n - keep      # a hybrid model may have gone back further (a checkpoint, or 0)
            self.kv_tokens = prompt[:keep].tolist()
        self._restored, self._prompt_logits = 0, None

        if self.model.recurrent and start < n - 1:
            # a hybrid model cannot roll back into a prompt: keep a checkpoint before its last token,
            # where a request with the same prompt, or a chat turn that re-renders the reply after
            # it, takes over (as llama-server's context checkpoints near a prompt's end)
            if not self.ctx.decode_chunks(prompt[start:n - 1], start, on_chunk, chunk=self.ctx.n_ubatch):
                return None
            self.ctx.checkpoint(prompt=True)
            start = n - 1
        if not self.ctx.decode_chunks(prompt[start:], start, on_chunk, chunk=self.ctx.n_ubatch):
            return None
        return self.ctx.logits_rows()[-1]

    def _hand_over(self, prompt: np.ndarray, cancel: Callable[[], bool], st: GenStats,
                   rows: RowsWanted | None = None) -> bool:
        """Load the exact context with the fast context's state for the whole prompt (fast_len
        tokens in blocks, then the tail) and keep its last logits; rows: the layer inputs the
        drafters read, handed out by the fast context on the way. False when cancel() stopped it.
        A model whose state cannot be handed over turns the fast path off for good (one log line)
        and the head is evaluated here like the rest (the drafters that read rows pause drafting
        for this prompt)."""
        self.ctx.clear()
        self.kv_tokens, self._restored, self._prompt_logits = [], 0, None
        try:
            state = self.fast.state(prompt, cancel, rows)
            if state is None:
                return False
            self.ctx.state_set(state)
        except SpecrunError as e:
            log.warning("fast prompt evaluation is off for this model: %s", e)
            self.fast.close()
            self.fast = None
            head = prompt[:fast_len(len(prompt))]
            self.ctx.decode_chunks(head, 0, chunk=self.ctx.n_ubatch)
            self.kv_tokens = head.tolist()
            return True
        self.kv_tokens, self._restored, self._prompt_logits = prompt.tolist(), len(prompt), self.fast.logits
        st.n_prompt_fast, st.fast_kv_mib, st.fast_weights_mib, st.fast_process_mib = (
            self.fast.n_evaluated, self.fast.kv_mib, self.fast.weights_mib, self.fast.process_mib)
        return True
