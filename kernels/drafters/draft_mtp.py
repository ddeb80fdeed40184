"""`draft-mtp`: the Multi-Token-Prediction heads stored in the GGUF draft for the model itself.

Sequence as llama.cpp's common_speculative_impl_draft_mtp (common/speculative.cpp):
  * The MTP row at position p carries token x_p and the target's hidden row h_{p-1} (its
    final-norm output); its logits predict x_{p+1}. h_{-1} is zeros.
  * accept(tp): every target pass (prompt chunks and verify passes) feeds the MTP context the
    positions the target keeps, with their hidden rows, so the MTP KV covers the whole sequence.
  * propose(): from (id_last, n_past, h_{n_past-1}) chain the MTP's own hidden row through up to
    n_max steps, then drop the draft rows from the MTP KV again.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import numpy as np
from llama_cpp import llama_cpp_ext as X

from specrun.gguf_spec.errors import SpecrunError

from ..llama import Context, ContextParams, Model
from ..types import Draft, DraftOptions, TargetPass
from .base import DraftTokens, TargetView

log = logging.getLogger(__name__)


class DraftMTP:
    spec_type: ClassVar[str] = "draft-mtp"
    needs_hidden: ClassVar[bool] = True

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
            self.ctx = Context(self.model, ContextParams(
                n_ctx=target.n_ctx, n_batch=target.n_batch, n_threads=target.n_threads,
                mtp=True, nextn="outputs"), ctx_other=target.ctx)
        except BaseException:
            if self._own_model:
                self.model.close()
            raise
        E = self.model.n_embd_out
        self.H = np.zeros((target.n_ctx + 1, E), dtype=np.float32)   # [n_ctx + 1, E]: H[p + 1] = h_p
        self.fed: list[int] = []      # tokens in the MTP KV at positions 0..len-1
        self.opts = DraftOptions()

    def close(self) -> None:
        self.ctx.close()
        if self._own_model:
            self.model.close()

    def _head(self, i: int) -> None:
        if self.n_heads > 1:
            X.llama_set_nextn_layer_offset(self.ctx.ptr, min(i, self.n_heads - 1))

    def begin(self, prompt: np.ndarray, n_keep: int, opts: DraftOptions) -> int:
        """The target may reuse only the positions whose MTP rows are in the MTP KV."""
        self.opts = opts
        return min(n_keep, len(self.fed))

    def accept(self, tp: TargetPass) -> None:
        """The target decoded tp.tokens at tp.pos0.. and keeps the first tp.n_keep rows."""
        p0, n_keep = tp.pos0, tp.n_keep
        if p0 < len(self.fed):
            if not self.ctx.seq_rm(p0, -1):
                raise SpecrunError(f"MTP context could not roll back to {p0} tokens")
            del self.fed[p0:]
        if p0 > len(self.fed):
            # positions the MTP never saw (heads switched on mid-conversation): their target hidden
            # rows are unknown, so the MTP KV cannot be completed; drafting stays off until reset.
            log.info("draft-mtp: %d positions without hidden rows; drafting paused", p0 - len(self.fed))
            return
        self.H[p0 + 1: p0 + 1 + n_keep] = tp.hidden[:n_keep]
        toks = tp.tokens[:n_keep]
        for s in range(0, n_keep, self.ctx.n_batch):
            n = min(self.ctx.n_batch, n_keep - s)
            self._head(0)
            self.ctx.decode_with_hidden(toks[s:s + n], p0 + s, self.H[p0 + s: p0 + s + n], logits="none")
        self.fed.extend(int(t) for t in toks)

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        n_past = len(ctx) - 1                    # position of id_last
        if n_max <= 0 or len(self.fed) != n_past or n_past + n_max >= self.ctx.n_ctx:
            return Draft.empty()
        tok = int(ctx[-1])
        d = DraftTokens(self.opts.sampling, self.opts.p_min)
        for i in range(n_max):
            self._head(i)
            if i == 0:     # (id_last, h_{n_past - 1})
                self.ctx.decode_with_hidden([tok], n_past, self.H[n_past: n_past + 1], logits="last")
            else:          # (d_i, the last step's own hidden row)
                self.ctx.decode_chained(tok, n_past + i)
            if (tok := d.add(self.ctx.logits_rows()[0], n_past + 1 + i)) is None:
                break
        if not self.ctx.seq_rm(n_past, -1):
            raise SpecrunError(f"MTP context could not drop its draft rows after position {n_past}")
        return d.draft()
