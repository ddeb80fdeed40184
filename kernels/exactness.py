"""Self-check: are a position's target logits bit-identical alone and inside a verify batch?

Two contexts over the same model evaluate the same prompt; one then decodes n tokens one at a
time (plain decoding), the other decodes them as one batch of n rows (a verify pass). Exactness
holds when every row is identical bit for bit. Run it with a prompt longer than 256 tokens to
cover flash attention's split-KV path (README: "Why the output is exactly the model's").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .llama import Context, ContextParams, Model
from .params import KVParams


@dataclass(frozen=True, slots=True)
class ExactReport:
    n_rows: int                  # batch rows compared (= n_max + 1)
    n_identical: int             # rows bit-identical to one-token decoding
    max_abs_diff: float          # largest |logit difference| over all rows
    n_argmax_flips: int          # rows whose argmax differs
    n_context: int               # tokens in the KV before the compared rows

    @property
    def exact(self) -> bool:
        return self.n_identical == self.n_rows


def check_exact(model: Model, prompt: np.ndarray, n_rows: int, *, n_threads: int = 0,
                kv: KVParams | None = None) -> ExactReport:
    """Compare plain one-token decoding with one n_rows-row batch after `prompt` (int32 [n]).
    The rows' tokens are the plain greedy continuation, as in a fully accepted draft. kv: the KV
    cache and attention of a model loaded with exact=False (an exact model keeps its own)."""
    n_ctx = len(prompt) + n_rows + 8
    kv = kv or KVParams()
    params = ContextParams(n_ctx=n_ctx, n_batch=max(512, n_rows), n_threads=n_threads, n_rs_seq=n_rows,
                           type_k=kv.type_k, type_v=kv.type_v, flash_attn=kv.flash_attn)
    with Context(model, params) as plain, Context(model, params) as batched:
        for ctx in (plain, batched):
            ctx.decode_chunks(prompt, 0)
        tok = int(np.argmax(plain.logits_rows()[-1]))
        toks, rows = [], []
        for i in range(n_rows):
            toks.append(tok)
            plain.decode([tok], len(prompt) + i, "all")
            r = plain.logits_rows()[0].copy()                      # [n_vocab]
            rows.append(r)
            tok = int(np.argmax(r))
        batched.decode(np.asarray(toks, dtype=np.int32), len(prompt), "all")
        B = batched.logits_rows()                                 # [n_rows, n_vocab]
        P = np.stack(rows)                                        # [n_rows, n_vocab]
        same = [bool(np.array_equal(B[i], P[i])) for i in range(n_rows)]
        flips = int(np.sum(np.argmax(B, axis=1) != np.argmax(P, axis=1)))
        return ExactReport(n_rows, sum(same), float(np.max(np.abs(B - P))), flips, len(prompt))
