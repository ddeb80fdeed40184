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

from specrun.gguf_spec.compat import check_draft_compatible
from specrun.gguf_spec.errors import IncompatibleDraft, SpecrunError
from specrun.gguf_spec.spec import load_spec

from ..llama import Context, ContextParams, Model
from ..params import SpecParams
from ..prefill import FastPrefill, fast_len
from ..types import Draft, DraftOptions, TargetPass, common_prefix
from .base import TargetView, draft_steps

log = logging.getLogger(__name__)


class DraftModel:
    spec_type: ClassVar[str] = "draft-simple"
    needs_hidden: ClassVar[bool] = False

    @classmethod
    def from_spec(cls, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                  heads_path: str | None = None) -> DraftModel:
        """A drafter with spec's settings (what drafters.make_drafter calls)."""
        return cls(target, draft_path)

    def __init__(self, target: TargetView, path: str) -> None:
        compat = check_draft_compatible(load_spec(target.model.path), load_spec(path))
        if not compat.ok:
            raise IncompatibleDraft(f"draft model {path} cannot draft for {target.model.path}: {compat.reason}")
        self.model = Model(path, exact=target.exact)
        if self.model.n_vocab > target.model.n_vocab:
            log.info("draft vocab %d > target %d: draft tokens beyond the target's are never proposed",
                     self.model.n_vocab, target.model.n_vocab)
        self.n_vocab_target = target.model.n_vocab
        try:
            self.ctx = Context(self.model, ContextParams(n_ctx=target.n_ctx, n_batch=target.n_batch,
                                                         n_threads=target.n_threads))
        except BaseException:
            self.model.close()
            raise
        self.kv: list[int] = []            # tokens in the draft KV at positions 0..len-1
        self.opts = DraftOptions()
        # the target's rule for long prompts, so that a draft with the target's weights holds the
        # target's KV (and accepts everything at temperature 0) and a small one evaluates fast too
        self.fast = (FastPrefill(self.model, target.n_ctx, target.n_threads, self.ctx.kv_rot, self.ctx.k_type)
                     if target.fast_prefill and not self.model.recurrent else None)
        self._restored = 0                 # the prompt length a hand-over loaded into self.ctx; 0: none
        self._draft_at = -1                # position of the last draft's first token (-1: none pending)

    def close(self) -> None:
        if self.fast is not None:
            self.fast.close()
        self.ctx.close()
        self.model.close()

    def begin(self, prompt: np.ndarray, n_keep: int, opts: DraftOptions) -> int:
        """A long prompt comes from the fast prompt context now, all of it (never rolled back below
        it afterwards); anything else is brought to the draft KV lazily, in propose(): any prefix
        will do."""
        self.opts, self._draft_at = opts, -1
        n = len(prompt)
        fast = fast_len(n) if self.fast is not None else 0
        if fast and (self._restored != n or common_prefix(self.kv, prompt) < n):
            self.ctx.clear()
            self.kv, self._restored = [], 0
            try:
                self.ctx.state_set(self.fast.state(prompt, lambda: False))
                self.kv, self._restored = prompt.tolist(), n
            except SpecrunError as e:
                log.warning("fast prompt evaluation is off for the draft model: %s", e)
                self.fast.close()
                self.fast = None
        elif not fast and self._restored:
            self.ctx.clear()
            self.kv, self._restored = [], 0
        return n_keep

    def _sync(self, ctx: np.ndarray) -> None:
        """Make the draft KV hold ctx[:-1] and decode ctx[-1] (id_last) with logits."""
        keep = self.ctx.keep_prefix(min(common_prefix(self.kv, ctx), len(ctx) - 1), len(self.kv))
        del self.kv[keep:]
        self.ctx.decode_chunks(ctx[keep:], keep)
        self.kv.extend(int(t) for t in ctx[keep:])

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        if n_max <= 0 or len(ctx) + n_max >= self.ctx.n_ctx:
            return Draft.empty()
        self._sync(ctx)
        if self.model.recurrent:     # a hybrid draft model rolls its drafted tokens back to here
            self.ctx.checkpoint()
        self._draft_at = len(ctx)  # position of the first drafted token
        d = draft_steps(self.ctx, self.opts, n_max, len(ctx) - 1, self.n_vocab_target, chained=False)
        self.kv.extend(int(t) for t in d.tokens[:n_max - 1])   # what the steps decoded (draft_steps)
        return d

    def accept(self, tp: TargetPass) -> None:
        """Forget the drafted tokens the target rejected, so the next propose() re-syncs from the
        last accepted one (llama.cpp's draft-simple does the same through its prompt cache). Only
        after a draft: a prompt chunk keeps the cached tokens past it for propose() to reuse."""
        end, at = tp.pos0 + tp.n_keep, self._draft_at
        self._draft_at = -1
        if 0 <= at <= end and end >= self._restored and len(self.kv) > end \
                and self.kv[tp.pos0:end] == [int(t) for t in tp.tokens[:tp.n_keep]]:
            # a hybrid draft model goes back to its checkpoint before the draft (the next propose()
            # evaluates the accepted tokens again), or, without one, starts over
            del self.kv[self.ctx.keep_prefix(end, len(self.kv)):]
