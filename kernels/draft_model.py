"""`draft-simple` (alias `draft`): a second, smaller GGUF drafts in its own context.

propose(ctx, n_max): bring the draft KV to ctx (reusing the common prefix, rolling back what the
target rejected), then draft up to n_max tokens one at a time: greedy top-1, stopping when its
probability is below p_min; or, for rejection verification at temperature > 0, sampled from the
draft distribution q (kept in Draft.probs).
"""

from __future__ import annotations

import logging
from typing import ClassVar

import numpy as np

from specrun.gguf_spec.errors import IncompatibleDraft

from .llama import Context, ContextParams, Model
from .sampling import inverse_cdf, position_rng, transform
from .types import Draft, SamplingParams

log = logging.getLogger(__name__)

_DRAFT_STREAM = 3  # random stream of draft sampling, apart from the target's (0, 1, 2)


def softmax_max(logits: np.ndarray) -> tuple[int, float]:
    """(argmax, its probability at temperature 1) of float32 [n_vocab] logits."""
    i = int(np.argmax(logits))
    m = float(logits[i])
    return i, 1.0 / float(np.exp(logits.astype(np.float64) - m).sum())


def draft_token(logits: np.ndarray, sampling: SamplingParams | None, p_min: float,
                pos: int) -> tuple[int | None, np.ndarray | None]:
    """One drafted token from a drafter's logits (float32 [n_vocab]) for absolute position pos.

    sampling set and not greedy: drawn from q = transform(logits) with the draft stream of
    (seed, pos); returns (token, q as float32 [n_vocab]). Otherwise greedy top-1, or (None, None)
    when its probability is below p_min (stop drafting)."""
    if sampling is not None and not sampling.greedy:
        q = transform(logits, sampling)                                # [n_vocab] float64
        u = position_rng(sampling.seed, pos, _DRAFT_STREAM).random()
        return int(inverse_cdf(q, u)), q.astype(np.float32)
    tok, p = softmax_max(logits) if p_min > 0 else (int(np.argmax(logits)), 1.0)
    return (None, None) if p < p_min else (tok, None)


class DraftModel:
    spec_type: ClassVar[str] = "draft-simple"

    def __init__(self, engine, path: str) -> None:
        from specrun.gguf_spec.compat import check_draft_compatible
        from specrun.gguf_spec.spec import load_spec

        compat = check_draft_compatible(load_spec(engine.model.path), load_spec(path))
        if not compat.ok:
            raise IncompatibleDraft(f"draft model {path} cannot draft for {engine.model.path}: {compat.reason}")
        self.p_min = engine.params.spec.p_min
        self.model = Model(path, exact=engine.params.exact)
        if self.model.n_vocab > engine.model.n_vocab:
            log.info("draft vocab %d > target %d: draft tokens beyond the target's are never proposed",
                     self.model.n_vocab, engine.model.n_vocab)
        self.n_vocab_target = engine.model.n_vocab
        self.ctx = Context(self.model, ContextParams(n_ctx=engine.n_ctx, n_batch=engine.ctx.n_batch,
                                                     n_threads=engine.params.n_threads))
        self.kv: list[int] = []
        self.sampling: SamplingParams | None = None   # set by the engine when drafts are sampled

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def begin(self, prompt: np.ndarray) -> None:
        pass  # the KV is synchronised lazily in propose()

    def _sync(self, ctx: np.ndarray) -> None:
        """Make the draft KV hold ctx[:-1] and decode ctx[-1] (id_last) with logits."""
        from .engine import common_prefix

        keep = self.ctx.keep_prefix(min(common_prefix(self.kv, ctx), len(ctx) - 1), len(self.kv))
        del self.kv[keep:]
        self.ctx.decode_chunks(ctx[keep:], keep)
        self.kv.extend(int(t) for t in ctx[keep:])

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        if len(ctx) + n_max >= self.ctx.n_ctx:
            return Draft.empty()
        self._sync(ctx)
        toks: list[int] = []
        qs: list[np.ndarray] = []
        pos = len(ctx)  # position of the first drafted token
        while True:
            lg = self.ctx.logits_rows()[-1][: self.n_vocab_target]
            tok, q = draft_token(lg, self.sampling, self.p_min, pos + len(toks))
            if tok is None:
                break
            if q is not None:
                qs.append(q)
            toks.append(tok)
            if len(toks) >= n_max:
                break
            self.ctx.decode([tok], pos + len(toks) - 1, "last")
            self.kv.append(tok)
        tokens = np.asarray(toks, dtype=np.int32)
        return Draft(tokens, np.stack(qs) if qs else None)

    def accept(self, n_accepted: int, emitted: np.ndarray) -> None:
        pass  # rejected tokens are rolled back at the next propose()

