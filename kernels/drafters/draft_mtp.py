"""`draft-mtp`: the Multi-Token-Prediction heads stored in the GGUF draft for the model itself.

Sequence as llama.cpp's common_speculative_impl_draft_mtp (common/speculative.cpp):
  * The MTP row at position p carries token x_p and the target's hidden row h_{p-1} (its
    final-norm output); its logits predict x_{p+1}. h_{-1} is zeros.
  * accept(tp): every target pass (prompt chunks and verify passes) hands over the positions the
    target keeps, with their hidden rows, so the MTP KV covers the whole sequence.
  * propose(): writes the MTP rows of those positions and (id_last, n_past, h_{n_past-1}) in one
    batch, then chains the MTP's own hidden row through up to n_max steps and drops the draft rows
    from the MTP KV again; the row of id_last stays (the next pass's first kept row is the same).
    llama.cpp's accept() writes the kept rows, and its draft loop evaluates id_last's row again
    each pass: here one llama_decode and one row fewer per pass, the same rows.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import numpy as np
from llama_cpp import llama_cpp_ext as X

from specrun.gguf_spec.errors import SpecrunError

from ..llama import Context, ContextParams, Model
from ..params import SpecParams
from ..types import Draft, DraftOptions, TargetPass, common_prefix
from .base import DraftRows, TargetView, draft_steps

log = logging.getLogger(__name__)


class DraftMTP:
    spec_type: ClassVar[str] = "draft-mtp"
    needs_hidden: ClassVar[bool] = True

    @classmethod
    def from_spec(cls, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                  heads_path: str | None = None) -> DraftMTP:
        """A drafter with spec's settings (what drafters.make_drafter calls)."""
        return cls(target, heads_path)

    def __init__(self, target: TargetView, heads_path: str | None = None) -> None:
        """heads_path: an MTP-only GGUF (`specrun extract-mtp`); None: the target's own heads."""
        self._own_model = heads_path is not None
        if heads_path is not None:
            self.model = Model(heads_path, exact=target.exact, load_mtp=True)
            tm = target.model
            why = None
            if self.model.n_layer_nextn <= 0:
                why = "no MTP heads in this file; write one with `specrun extract-mtp MODEL.gguf -o HEADS.gguf`"
            elif self.model.n_embd_out != tm.n_embd_out or self.model.n_vocab != tm.n_vocab:
                why = (f"MTP heads of width {self.model.n_embd_out} / vocab {self.model.n_vocab} do not fit the "
                       f"target ({tm.n_embd_out} / {tm.n_vocab}); extract the heads from this model's own GGUF")
            if why:
                self.model.close()
                raise SpecrunError(f"{heads_path}: {why}")
        else:
            self.model = target.model
        self.n_heads = self.model.n_layer_nextn
        try:
            # every row's hidden state (see propose): llama.cpp keeps n_batch x n_embd floats for
            # them, so rows are written in batches of at most 512 (its default ubatch)
            self.ctx = Context(self.model, ContextParams(
                n_ctx=target.n_ctx, n_batch=min(target.n_batch, 512), n_threads=target.n_threads,
                mtp=True, nextn="all"), ctx_other=target.ctx)
        except BaseException:
            if self._own_model:
                self.model.close()
            raise
        E = self.model.n_embd_out
        self.H = np.zeros((target.n_ctx + 1, E), dtype=np.float32)   # [n_ctx + 1, E]: H[p + 1] = h_p
        self.toks: list[int] = []     # the target's tokens at positions 0..len-1; H holds h_p for each
        self.kv = DraftRows(self.ctx, 0, "MTP")     # row p: (x_p, H[p] = h_{p-1}) at position p
        self.opts = DraftOptions()

    def close(self) -> None:
        self.ctx.close()
        if self._own_model:
            self.model.close()

    def _head(self, i: int) -> None:
        if self.n_heads > 1:
            X.llama_set_nextn_layer_offset(self.ctx.ptr, min(i, self.n_heads - 1))

    def begin(self, prompt: np.ndarray, n_keep: int, opts: DraftOptions) -> int:
        """The target may reuse only the positions whose hidden rows the MTP has seen."""
        self.opts = opts
        return min(n_keep, common_prefix(self.toks, prompt))

    def accept(self, tp: TargetPass) -> None:
        """The target decoded tp.tokens at tp.pos0.. and keeps the first tp.n_keep rows."""
        p0, n_keep = tp.pos0, tp.n_keep
        if p0 > len(self.toks):
            # positions the MTP never saw (heads switched on mid-conversation): their target hidden
            # rows are unknown, so the MTP KV cannot be completed; drafting stays off until reset.
            log.info("draft-mtp: %d positions without hidden rows; drafting paused", p0 - len(self.toks))
            return
        del self.toks[p0:]
        self.H[p0 + 1: p0 + 1 + n_keep] = tp.hidden[:n_keep]
        self.toks.extend(tp.tokens[:n_keep].tolist())
        self.kv.changed(p0 + 1)            # H[p0 + 1] = h_{p0}

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        n_past = len(ctx) - 1                    # position of id_last
        if n_max <= 0 or len(self.toks) != n_past or n_past + n_max >= self.ctx.n_ctx:
            return Draft.empty()
        tok = int(ctx[-1])
        # rows 0..n_past, logits of (id_last, h_{n_past-1}). The context exports every row's hidden
        # state (nextn "all"): with outputs only, llama.cpp's MTP graph hands back a batch's first rows
        self._head(0)
        self.kv.write(self.toks, tok, self.H, self.ctx.n_batch, "last")
        # then rows (d_i, the last step's own hidden row) at n_past + i
        d = draft_steps(self.ctx, self.opts, n_max, n_past, self.ctx.n_vocab, chained=True,
                        on_step=self._head if self.n_heads > 1 else None)
        if not self.ctx.seq_rm(n_past + 1, -1):
            raise SpecrunError(f"MTP context could not drop its draft rows after position {n_past}")
        return d
