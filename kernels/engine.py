"""The speculative generation loop over one target context.

    id_last = sample(prefill(prompt))                      # position n_past = len(prompt)
    loop:
        draft   = first non-empty proposal of the drafters  # llama.cpp's order: n-grams first
        logits  = target.decode([id_last, d1..dk])          # ONE pass, k+1 output rows
        verdict = verify(draft, logits)                     # accepted d1..dn + one target token
        target.seq_rm(n_past + n + 1)                       # roll back the rejected rows
        emit verdict.tokens; id_last = verdict.tokens[-1]

Every emitted token at absolute position pos takes its random draw from a stream keyed by
(seed, pos), and in exact mode the verify rows are bit-identical to one-token decoding, so the
output equals `--spec-type none` token for token.

The engine also keeps the conversation's KV cache between calls: a new prompt that extends the
tokens already in the cache only evaluates the new tokens (chat turns).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from .llama import MAX_EXACT_BATCH, Context, ContextParams, LlamaError, Model
from .sampling import sample
from .stats import DrafterStats, GenStats
from .types import LLAMA_DEFAULT_SEED, Draft, SamplingParams
from .verify import verify

log = logging.getLogger(__name__)

SPEC_TYPES = ("none", "draft-simple", "draft-mtp", "ngram-simple")
SPEC_ALIASES = {"draft": "draft-simple"}
_ORDER = {"ngram-simple": 0, "draft-simple": 1, "draft-mtp": 2}  # llama.cpp: n-grams first


def parse_spec_types(text: str) -> tuple[str, ...]:
    """'ngram-simple,draft' -> ('ngram-simple', 'draft-simple'), in llama.cpp's order."""
    out: list[str] = []
    for raw in (t.strip() for t in text.split(",")):
        name = SPEC_ALIASES.get(raw, raw)
        if name not in SPEC_TYPES:
            valid = ", ".join([*SPEC_TYPES, *SPEC_ALIASES])
            raise SpecrunError(f"unknown spec type '{raw}'; valid types: {valid}")
        if name != "none" and name not in out:
            out.append(name)
    return tuple(sorted(out, key=_ORDER.__getitem__))


@dataclass(frozen=True, slots=True)
class SpecParams:
    """llama.cpp's --spec-* options (defaults as its common.h)."""

    types: tuple[str, ...] = ()
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.0
    ngram_size_n: int = 12
    ngram_size_m: int = 48
    ngram_min_hits: int = 1
    verify: str = "auto"       # auto | match | rejection
    adaptive: bool = False     # adapt each drafter's n-max to its acceptance (within 1..n_max)


@dataclass(frozen=True, slots=True)
class EngineParams:
    n_ctx: int = 4096
    n_batch: int = 2048
    n_threads: int = 0
    exact: bool = True
    spec: SpecParams = field(default_factory=SpecParams)
    draft_model: str | None = None     # -md: a draft GGUF (draft-simple) or MTP heads (draft-mtp)


@dataclass(frozen=True, slots=True)
class TargetPass:
    """One target decode: tokens int32 [n] at positions pos0..; hidden float32 [n, n_embd_out]
    (the rows MTP heads read) or None when no drafter needs them. Views valid until the next decode."""

    tokens: np.ndarray
    pos0: int
    hidden: np.ndarray | None


_SAMPLING_DEFAULT = SamplingParams()  # llama.cpp's defaults (temp 0.8)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    a, b = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(a != b)
    return int(diff[0]) if diff.size else n


class Engine:
    """A target model and context, plus the drafters of the chosen spec types.

    generate(prompt, n_predict, sampling) yields lists of emitted tokens as they are accepted;
    self.stats holds the statistics of the last generation (also when it was interrupted).
    """

    def __init__(self, model_path: str, params: EngineParams = EngineParams(), *,
                 model: Model | None = None, drafters: Sequence | None = None) -> None:
        """model: an already loaded Model to share (server slots); the engine then does not close it.
        drafters: explicit drafter objects (tests), instead of those params.spec.types name."""
        self.params = params
        spec = params.spec
        # draft-mtp reads the heads of the main GGUF, or of -md HEADS.gguf when no draft model uses -md
        self._heads_from_md = bool(params.draft_model) and "draft-simple" not in spec.types
        needs_mtp = "draft-mtp" in spec.types and not self._heads_from_md
        self._own_model = model is None
        self.model = model if model is not None else Model(model_path, exact=params.exact, load_mtp=needs_mtp)
        self.ctx = None
        self._cache: dict[tuple, object] = {}
        if needs_mtp and self.model.n_layer_nextn <= 0:
            self.close()
            raise SpecrunError(f"{model_path}: the model has no MTP heads, so --spec-type draft-mtp is not "
                               f"available; run `specrun inspect {model_path}` to see what it holds, "
                               "or pass MTP heads with -md HEADS.gguf")
        n_ctx = params.n_ctx or self.model.n_ctx_train
        # Hybrid (recurrent) models roll back through n_rs_seq snapshots: the longest draft it allows.
        self.n_max_cap = max(spec.n_max, 16)
        if params.exact:
            self.n_max_cap = min(self.n_max_cap, MAX_EXACT_BATCH - 1)
        self.mtp_enabled = "draft-mtp" in spec.types or (self.model.load_mtp and self.model.n_layer_nextn > 0)
        self.ctx = Context(self.model, ContextParams(
            n_ctx=n_ctx, n_batch=max(params.n_batch, self.n_max_cap + 1), n_threads=params.n_threads,
            n_rs_seq=self.n_max_cap, nextn="all" if self.mtp_enabled else None))
        self.n_ctx = self.ctx.n_ctx
        self.kv_tokens: list[int] = []      # tokens held in the target KV at positions 0..n-1
        self._explicit = list(drafters) if drafters is not None else None
        try:
            self.drafters = self._explicit if self._explicit is not None else self.drafters_for(spec)
        except Exception:
            self.close()
            raise
        self.stats = GenStats()
        self.exact_caveat: str | None = None   # set by callers that know the weight types (cli)

    # -- set-up ------------------------------------------------------------------------------
    def max_draft(self, n_max: int) -> int:
        return min(n_max, self.n_max_cap)

    def drafters_for(self, spec: SpecParams) -> list:
        """The drafters of spec.types (llama.cpp's order), built once and cached by their settings."""
        out = []
        for t in spec.types:
            if t == "ngram-simple":
                key = (t, spec.ngram_size_n, spec.ngram_size_m, spec.ngram_min_hits)
            else:
                key = (t,)
            d = self._cache.get(key)
            if d is None:
                d = self._cache[key] = self._make_drafter(t, spec)
            if hasattr(d, "p_min"):
                d.p_min = spec.p_min
            out.append(d)
        return out

    def _make_drafter(self, t: str, spec: SpecParams):
        if t == "ngram-simple":
            from .ngram import NgramSimple
            return NgramSimple(spec.ngram_size_n, spec.ngram_size_m, spec.ngram_min_hits)
        if t == "draft-simple":
            if not self.params.draft_model:
                raise SpecrunError("--spec-type draft needs a draft model: add -md DRAFT.gguf "
                                   "(a small model of the same family)")
            from .draft_model import DraftModel
            return DraftModel(self, self.params.draft_model)
        if t == "draft-mtp":
            if not self.mtp_enabled:
                raise SpecrunError("draft-mtp was not enabled when the model was loaded; restart with "
                                   "--spec-type draft-mtp")
            from .draft_mtp import DraftMTP
            return DraftMTP(self, self.params.draft_model if self._heads_from_md else None)
        raise SpecrunError(f"unknown spec type '{t}'")

    def set_spec(self, spec: SpecParams) -> None:
        """Switch spec types for the next generations (chat /spec); builds the drafters now."""
        drafters = self.drafters_for(spec)
        self.params = replace(self.params, spec=spec)
        self.drafters = drafters

    def close(self) -> None:
        for d in getattr(self, "_cache", {}).values():
            if hasattr(d, "close"):
                d.close()
        self._cache = {}
        if getattr(self, "ctx", None) is not None:
            self.ctx.close()
        if getattr(self, "_own_model", False) and getattr(self, "model", None) is not None:
            self.model.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def tokenize(self, text: str, add_special: bool = True) -> np.ndarray:
        return self.model.tokenize(text, add_special=add_special)

    def reset(self) -> None:
        self.ctx.clear()
        self.kv_tokens = []

    # -- target passes -----------------------------------------------------------------------
    def _target_pass(self, tokens, pos0: int) -> TargetPass:
        """The last target decode (tokens at pos0..) with its hidden rows, when exported."""
        hidden = self.ctx.nextn_rows() if self.ctx.params.nextn else None
        return TargetPass(np.asarray(tokens, dtype=np.int32), pos0, hidden)

    def _decode(self, tokens: np.ndarray, pos0: int, logits: str) -> TargetPass:
        self.ctx.decode(tokens, pos0, logits)
        return self._target_pass(tokens, pos0)

    def _observe(self, drafters, tp: TargetPass, n_keep: int) -> None:
        for d in drafters:
            if hasattr(d, "observe"):
                d.observe(tp, n_keep)

    def _prefill(self, prompt: np.ndarray, drafters) -> np.ndarray:
        """Bring the KV cache to hold the prompt (reusing the common prefix) and return the logits row of
        its last token (a view, valid until the next decode)."""
        n = len(prompt)
        if self.ctx.pos_max() + 1 != len(self.kv_tokens):
            # an interrupt between a decode and its bookkeeping: trust nothing, start over
            log.info("KV cache (%d) and its token list (%d) disagree; clearing", self.ctx.pos_max() + 1,
                     len(self.kv_tokens))
            self.reset()
        keep = min(common_prefix(self.kv_tokens, prompt), n - 1)
        for d in drafters:  # a drafter that follows the target's positions (MTP) must see them all
            if hasattr(d, "n_synced"):
                keep = min(keep, d.n_synced())
        keep = self.ctx.keep_prefix(keep, len(self.kv_tokens))
        self.kv_tokens = list(prompt[:keep])
        for d in drafters:
            d.begin(prompt)
        self.stats.n_prompt = n - keep

        def on_chunk(chunk, pos0: int) -> None:
            self._observe(drafters, self._target_pass(chunk, pos0), len(chunk))
            self.kv_tokens.extend(int(t) for t in chunk)

        self.ctx.decode_chunks(prompt[keep:], keep, on_chunk)
        return self.ctx.logits_rows()[-1]

    # -- the loop ----------------------------------------------------------------------------
    def resolve_sampling(self, sampling: SamplingParams) -> SamplingParams:
        if sampling.seed == LLAMA_DEFAULT_SEED:
            return replace(sampling, seed=random.SystemRandom().randrange(0, 2**32 - 1))
        return sampling

    @staticmethod
    def verify_mode(spec: SpecParams, sampling: SamplingParams, draft: Draft) -> str:
        mode = spec.verify
        if mode == "auto":
            mode = "rejection" if not sampling.greedy and draft.probs is not None else "match"
        return mode

    def generate(self, prompt: Sequence[int], n_predict: int = -1,
                 sampling: SamplingParams = _SAMPLING_DEFAULT, *,
                 spec: SpecParams | None = None, drafters: Sequence | None = None) -> Iterator[list[int]]:
        """Yield emitted tokens (lists, in order) until end-of-generation, n_predict tokens
        (-1: until the context is full) or the context is full.

        requires: 1 <= len(prompt) < n_ctx.  The random draw of the token at absolute
        position pos comes from the stream (sampling.seed, pos): seeded output is reproducible
        and independent of the spec type.
        """
        prompt = np.asarray(prompt, dtype=np.int32)
        if len(prompt) == 0:
            raise SpecrunError("the prompt is empty; give some text with -p or -f")
        if len(prompt) >= self.n_ctx:
            raise SpecrunError(f"the prompt exceeds the context size ({len(prompt)} tokens, ctx {self.n_ctx}); "
                               "raise -c or shorten the prompt")
        if drafters is not None:          # explicit drafter objects (tests), with spec's numbers
            spec = spec or self.params.spec
        elif spec is None:
            spec, drafters = self.params.spec, self.drafters
        else:
            drafters = self._explicit if self._explicit is not None else self.drafters_for(spec)
        n_max = self.max_draft(spec.n_max)
        sampling = self.resolve_sampling(sampling)
        sample_drafts = spec.verify in ("auto", "rejection") and not sampling.greedy
        for d in drafters:
            if hasattr(d, "sampling"):
                d.sampling = sampling if sample_drafts else None
        st = self.stats = GenStats(n_prompt_total=len(prompt), exact=self.params.exact, seed=sampling.seed,
                                   exact_caveat=self.exact_caveat,
                                   drafters=[DrafterStats(d.spec_type) for d in drafters])
        limit = n_predict if n_predict >= 0 else self.n_ctx
        ctx_tokens = list(prompt)
        n_cur = [n_max] * len(drafters)     # per-drafter draft length (adaptive) or n_max
        n_emitted = 0
        t0 = time.perf_counter()
        t_gen0 = None
        try:
            if limit == 0:
                st.stop = "n_predict"
                return
            logits = self._prefill(prompt, drafters)
            n_past = len(prompt)
            id_last = sample(logits, sampling, n_past)
            t_gen0 = time.perf_counter()
            st.t_prompt_s = t_gen0 - t0
            ctx_tokens.append(id_last)
            n_emitted = 1
            yield [id_last]
            if self.model.is_eog(id_last):
                st.stop = "eog"
                return
            while True:
                if n_emitted >= limit:
                    st.stop = "n_predict"
                    return
                if n_past + 1 > self.n_ctx - 1:
                    st.stop = "ctx"
                    return
                k_cap = min(n_max, limit - n_emitted - 1, self.n_ctx - n_past - 2)
                draft, which = Draft.empty(), -1
                if k_cap > 0:
                    ctx_arr = np.asarray(ctx_tokens, dtype=np.int32)
                    for i, d in enumerate(drafters):
                        td = time.perf_counter()
                        st.drafters[i].n_call_draft += 1
                        cap = min(k_cap, n_cur[i])
                        dd = d.propose(ctx_arr, cap)
                        st.drafters[i].t_draft_s += time.perf_counter() - td
                        if len(dd) > cap:
                            dd = Draft(dd.tokens[:cap], None if dd.probs is None else dd.probs[:cap])
                        if len(dd) > 0 and len(dd) >= spec.n_min:
                            draft, which = dd, i
                            break
                k = len(draft)
                batch = np.empty(k + 1, dtype=np.int32)
                batch[0] = id_last
                batch[1:] = draft.tokens
                tp = self._decode(batch, n_past, "all")
                st.n_target_passes += 1
                mode = self.verify_mode(spec, sampling, draft)
                if k > 0:
                    st.verify = mode     # how drafts were verified (empty drafts are plain steps)
                verdict = verify(draft, self.ctx.logits_rows(), sampling, n_past + 1, mode)
                n_acc = verdict.n_accepted
                keep = n_past + n_acc + 1
                if n_acc < k and not self.ctx.seq_rm(keep, -1):
                    raise LlamaError(f"could not roll the KV cache back to {keep} tokens after a partial "
                                     f"accept ({n_acc}/{k}); n_rs_seq = {self.ctx.params.n_rs_seq}")
                self.kv_tokens.extend(int(t) for t in batch[:n_acc + 1])
                self._observe(drafters, tp, n_acc + 1)
                if which >= 0:
                    st.drafters[which].record(k, n_acc)
                    if spec.adaptive:  # grow after a fully accepted draft, shrink after a rejection
                        n_cur[which] = min(n_max, n_cur[which] + 2) if n_acc == k else max(1, n_cur[which] - 1)
                out = [int(t) for t in verdict.tokens]
                for i, d in enumerate(drafters):
                    d.accept(n_acc if i == which else 0, verdict.tokens.copy())
                n_past = keep
                id_last = out[-1]
                stop = None
                for j, t in enumerate(out):
                    if self.model.is_eog(t):
                        out, stop = out[:j + 1], "eog"
                        break
                if n_emitted + len(out) > limit:
                    out, stop = out[:limit - n_emitted], "n_predict"
                ctx_tokens.extend(out)
                n_emitted += len(out)
                yield out
                if stop:
                    st.stop = stop
                    return
        except GeneratorExit:
            st.stop = "interrupted"
            raise
        finally:
            st.n_gen = n_emitted
            if t_gen0 is not None:
                st.t_gen_s = time.perf_counter() - t_gen0
            else:
                st.t_prompt_s = time.perf_counter() - t0

