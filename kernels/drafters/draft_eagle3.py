"""`draft-eagle3`: an EAGLE-3 draft (-md EAGLE3.gguf, architecture eagle3) reading three of the
target's layers.

Sequence as llama.cpp's common_speculative_impl_draft_eagle3 (common/speculative.cpp):
  * The draft's constructor turns on the export of the inputs of the target's three extract layers
    (low, mid, high); every target pass, prompt chunks and verify passes alike, hands them over
    as TargetPass.features, float32 [n, 3 * n_embd_target].
  * Its encoder (fc, and an RMS norm first when norm_before_fc) fuses a position's features into
    g_p, n_embd_draft wide.
  * Its decoder row at position p is (x_{p+1}, g_p): the next token with the features of p. So the
    last position the target evaluated has no row until the token after it is known; propose()
    writes it (the "deferred boundary" of llama.cpp) with id_last and the g of n_past - 1.
  * Its output at position p predicts x_{p+2}; the row's pre-norm state (t_h_nextn) is the g of the
    next draft row (d_i, p + i). Its logits are the target's vocabulary wide: a draft whose head
    covers fewer tokens maps them through d2t inside llama.cpp's graph (the rest are -inf).
  * accept(): the rows the target keeps get their g from the encoder (llama.cpp encodes the whole
    verify batch and drops the rejected rows; encoding only the kept ones is equivalent).
    propose() then writes their decoder rows and the boundary row in one batch: it knows id_last,
    where llama.cpp's accept() does not and decodes the boundary row as a draft step of its own
    (one llama_decode fewer per pass here, same rows). It drops its draft rows again.
Like draft-mtp it needs the target's rows of every prompt position, so an engine with draft-eagle3
never takes the fast prompt path (kernels/prefill.py), whose handed-over KV state comes without them.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import numpy as np

from specrun.gguf_spec.compat import check_eagle3_compatible
from specrun.gguf_spec.errors import IncompatibleDraft, SpecrunError
from specrun.gguf_spec.spec import load_spec

from ..llama import Context, ContextParams, Model
from ..params import SpecParams
from ..types import Draft, DraftOptions, TargetPass, common_prefix
from .base import DraftRows, TargetView, draft_steps

log = logging.getLogger(__name__)

FOLD_ROWS = 32    # the most rows written in the batch that ends with the boundary row (all out)


class DraftEagle3:
    spec_type: ClassVar[str] = "draft-eagle3"
    needs_hidden: ClassVar[bool] = True

    @classmethod
    def from_spec(cls, target: TargetView, spec: SpecParams, *, draft_path: str | None = None,
                  heads_path: str | None = None) -> DraftEagle3:
        """A drafter with spec's settings (what drafters.make_drafter calls)."""
        return cls(target, draft_path)

    def __init__(self, target: TargetView, path: str) -> None:
        """path: the EAGLE-3 GGUF. Checked against the target's file first (llama.cpp aborts the
        process on an extract layer beyond the target's layers and on several other mismatches)."""
        compat = check_eagle3_compatible(load_spec(target.model.path), load_spec(path))
        if not compat.ok:
            raise IncompatibleDraft(f"EAGLE-3 draft {path} cannot draft for {target.model.path}: {compat.reason}")
        # over RPC beside the target: its graph reads the target's token embeddings, which llama.cpp
        # may place on a worker (a tied output), and a local graph cannot use a worker's buffer
        self.model = Model(path, exact=target.exact, placement=target.model.placement)
        try:
            self.layers = self.model.target_layer_ids()           # low, mid, high
            if len(self.layers) != 3 or self.model.n_vocab != target.model.n_vocab:
                raise SpecrunError(f"{path}: llama.cpp reads {len(self.layers)} extract layers and a vocab of "
                                   f"{self.model.n_vocab} from it; an EAGLE-3 draft for {target.model.path} needs 3 "
                                   f"and {target.model.n_vocab}")
            self.ctx = Context(self.model, ContextParams(n_ctx=target.n_ctx, n_batch=target.n_batch,
                                                         n_threads=target.n_threads, nextn="outputs"),
                               ctx_other=target.ctx)
            if self.ctx.hidden_width != self.model.n_embd_out:
                self.ctx.close()
                raise SpecrunError(f"{path}: its decoder rows are {self.model.n_embd_out} wide (n_embd_out) but "
                                   f"llama.cpp's batches read {self.ctx.hidden_width} per row (n_embd_inp); specrun "
                                   "cannot feed this draft, convert it with n_embd_out equal to n_embd")
        except BaseException:
            self.model.close()
            raise
        target.ctx.export_layer_inputs(self.layers)
        self.E = self.model.n_embd_out
        self.G = np.zeros((min(target.n_ctx, 1024), self.E), dtype=np.float32)  # [>= n_ctx seen, E]: G[p] = g_p
        self.toks: list[int] = []     # the target's tokens at positions 0..len-1, each with its g in G
        self.kv = DraftRows(self.ctx, 1, "EAGLE-3")   # row p: (x_{p+1}, G[p]) at position p
        self.opts = DraftOptions()

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def begin(self, prompt: np.ndarray, n_keep: int, opts: DraftOptions) -> int:
        """The target may reuse only the positions whose features the draft has seen."""
        self.opts = opts
        return min(n_keep, common_prefix(self.toks, prompt))

    def accept(self, tp: TargetPass) -> None:
        """The target decoded tp.tokens at tp.pos0.. and keeps the first tp.n_keep rows."""
        p0, n_keep = tp.pos0, tp.n_keep
        if p0 > len(self.toks) or tp.features is None:
            # positions whose target rows the draft never saw: its KV cannot be completed, so
            # drafting stays off until a prompt is evaluated again from where it lost track
            log.info("draft-eagle3: positions %d.. without target features; drafting paused", len(self.toks))
            del self.toks[min(p0, len(self.toks)):]
            return
        del self.toks[p0:]
        if p0 + n_keep > len(self.G):
            self.G = np.resize(self.G, (max(2 * len(self.G), p0 + n_keep), self.E))
        self.G[p0:p0 + n_keep] = self.ctx.encode_rows(tp.features[:n_keep])
        self.toks.extend(tp.tokens[:n_keep].tolist())
        self.kv.changed(p0)

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        n_past = len(ctx) - 1                    # position of id_last
        if n_max <= 0 or n_past < 1 or len(self.toks) != n_past or n_past + n_max >= self.ctx.n_ctx:
            return Draft.empty()
        tok = int(ctx[-1])
        # rows 0..n_past-1, logits of the boundary row (every row of the batch out: llama.cpp's eagle3
        # decoder graph selects no output rows; each costs a copy of n_vocab floats and room in the
        # output buffer, so after a long prompt the rows before the last FOLD_ROWS go first)
        self.kv.write(self.toks, tok, self.G, FOLD_ROWS, "all")
        # then rows (d_i, the last row's pre-norm state) at n_past + i - 1
        d = draft_steps(self.ctx, self.opts, n_max, n_past, self.ctx.n_vocab, chained=True, shift=1)
        if not self.ctx.seq_rm(n_past, -1):
            raise SpecrunError(f"EAGLE-3 context could not drop its draft rows after position {n_past}")
        return d
