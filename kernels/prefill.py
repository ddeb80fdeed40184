"""The fast prompt context: prompts of MIN_PROMPT tokens or more evaluated with llama.cpp's fast
batch kernels, then handed to the exact decode context.

Exact mode's decode context keeps Q8_0 K rows over weights that are not repacked, so that a
one-token decode and a verify row take the same kernels (README, "Why the output is exactly the
model's"). For a prompt both are the slow part: flash attention over an all-F16 cache runs its tiled
kernel on many-row batches (about twice as fast over 1,500 tokens on this CPU), and repacked
weights run llama.cpp's gemm kernels (Q4_0, Q4_K, IQ4_NL on x86). So a second context, over the
same file loaded again with repacked weights (Model.repacked(): shared by every engine over that
model, its memory is the repacked copy, repacked_mib; the rest maps the same file pages) and with
an F16 cache, evaluates all of such a prompt; its sequence state's K rows are re-encoded to Q8_0
(kernels/kvstate.py) and it is loaded into the exact context, which evaluates everything after
the prompt. The prompt's last token's logits, which start the generation, come from the fast
context too. A file with nothing to repack on this
CPU, or a second load that fails (one warning), keeps the exact model's weights for it.

Two rules keep every result a function of the tokens alone, never of what the caches held before
(so that the answer to a prompt is the same fresh, after a chat turn, or on a server slot that
served another request):
- the fast context evaluates positions [0, fast_len(n)) as the blocks fast_blocks(n): 512
  tokens each, then at most one each of 256, 128 and 64, each aligned at a multiple of its size
  and evaluated by one llama_decode (a batch's rows are computed alike only in a batch of the
  same shape), then the prompt's last 1..64 tokens (its tail) in one more llama_decode;
- it reuses only leading blocks it evaluated itself, with the same bounds, for the same tokens,
  never a tail, and the exact context reuses its cache only when it was loaded with this very
  prompt, whose last logits it kept (Engine._prefill).
Speculative and plain decoding share this path, so speculative output still equals plain output
token for token; what the fast rows change is the prompt's KV (repacked matmuls, F16 attention,
K re-quantized), about as much as a different KV cache type does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .kvstate import quantize_k
from .llama import Context, ContextParams, LlamaError, Model
from .types import common_prefix

log = logging.getLogger(__name__)

BLOCK = 512          # tokens per fast decode (llama-server's n_ubatch), aligned at absolute positions
MIN_BLOCK = 64       # the smallest: flash attention's tiled kernel needs 64 rows (GGML_FA_TILE_Q)
MIN_PROMPT = 256     # shorter prompts stay on the exact path (the hand-over's fixed costs; see fast_len)


def fast_len(n_prompt: int) -> int:
    """The prompt positions [0, fast_len) the fast context evaluates in aligned blocks: all but
    the last 1..MIN_BLOCK tokens (the tail, one decode of its own), rounded down to a multiple of
    MIN_BLOCK. 0 for prompts under MIN_PROMPT tokens: below it the fast path is no faster than the
    exact one (docs/design.md, "The fast prompt path"; benchmarks/prompt_kernels.py)."""
    return (n_prompt - 1) // MIN_BLOCK * MIN_BLOCK if n_prompt >= MIN_PROMPT else 0


def fast_blocks(end: int) -> list[tuple[int, int]]:
    """[(start, size)] of the decodes that evaluate positions [0, end) (end a multiple of
    MIN_BLOCK): blocks of BLOCK, then the largest halves that fit, each aligned at its size.
    fast_blocks(960) == [(0, 512), (512, 256), (768, 128), (896, 64)]."""
    assert end % MIN_BLOCK == 0, end
    out, s, size = [], 0, BLOCK
    while s < end:
        while s + size > end:
            size //= 2
        out.append((s, size))
        s += size
    return out


@dataclass(frozen=True, slots=True)
class RowsWanted:
    """The target rows an EAGLE-3 draft reads, asked of the fast context beside the state: the
    inputs of `layers` (Context.export_layer_inputs, in that order) at prompt positions start..n-1,
    handed to on_rows(pos0, rows) decode by decode in position order; rows float32
    [m, len(layers) * n_embd] for positions pos0..pos0+m-1. The blocks before `start` may be reused;
    the one holding it is evaluated again (its rows are a function of the tokens, as a fresh
    evaluation's)."""

    layers: tuple[int, ...]
    start: int
    on_rows: Callable[[int, np.ndarray], None]


class FastPrefill:
    """A second context, over the exact-mode Model's repacked twin with an F16 KV cache, created at
    first use and sized to the longest head asked for so far (in steps of 2x, at most n_ctx_max), so
    that its memory follows the prompts actually given: kv_mib, plus the twin's weights_mib.

    state(prompt, cancel) -> the exact context's state for the prompt (MIN_PROMPT tokens or more),
    and in self.logits the logits of its last token.
    """

    def __init__(self, model: Model, n_ctx_max: int, n_threads: int, rot: tuple[int, int],
                 k_type: str = "q8_0") -> None:
        self.model, self.n_ctx_max, self.n_threads, self.rot = model, n_ctx_max, n_threads, rot
        self.k_type = k_type                 # the exact context's K rows (Context.k_type)
        self.ctx: Context | None = None
        self.weights: Model | None = None    # the model its context runs: model.repacked(), or model
        self.tokens: list[int] = []          # the tokens whose blocks the fast context holds
        self.blocks: list[tuple[int, int]] = []   # their (start, size), as fast_blocks made them
        self.n_tail = 0                      # tokens after them in the context (the last tail; never reused)
        self.n_evaluated = 0                 # tokens the last state() call evaluated (not reused)
        self.logits: np.ndarray | None = None    # float32 [n_vocab]: the last tail's last row (a copy)

    @property
    def kv_mib(self) -> float:
        return self.ctx.kv_mib if self.ctx is not None else 0.0

    process_mib = 0.0        # it runs in this process (kernels/prefill_worker.py: in a child of its own)

    @property
    def weights_mib(self) -> float:
        """The repacked weights' memory (shared with the other engines over the same model)."""
        return self.weights.repacked_mib if self.weights is not None else 0.0

    def start(self) -> None:
        """Load the repacked twin now (a server, at load) rather than at the first long prompt."""
        self._weights()

    def _weights(self) -> Model:
        if self.weights is None:
            try:
                self.weights = self.model.repacked()
            except LlamaError as e:
                log.warning("the fast prompt context keeps the weights not repacked: %s", e)
                self.weights = self.model
        return self.weights

    def forget(self) -> None:
        """Drop the blocks held (the context stays allocated)."""
        if self.ctx is not None:
            self.ctx.clear()
        self.tokens, self.blocks, self.n_tail, self.logits = [], [], 0, None

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
        self.ctx, self.tokens, self.blocks, self.n_tail, self.logits = None, [], [], 0, None

    def state(self, prompt: np.ndarray, cancel: Callable[[], bool], rows: RowsWanted | None = None
              ) -> bytes | None:
        """Evaluate prompt (int32 [n], n >= MIN_PROMPT): its head prompt[:fast_len(n)] as
        fast_blocks, reusing the leading blocks already held with the same bounds and tokens, then
        its tail (the last 1..MIN_BLOCK tokens; the last row's logits go to self.logits), and
        return seq 0's state re-encoded for the exact context (K rows in Q8_0). rows: the layer
        inputs to hand out on the way (RowsWanted). None when cancel() returned True between two
        decodes (the blocks done are kept). Raises KVStateError / LlamaError when the hand-over
        cannot work for this model."""
        need = len(prompt)
        head, tail = prompt[:fast_len(need)], prompt[fast_len(need):]
        assert len(head) and need < self.n_ctx_max, need
        if self.ctx is None or self.ctx.n_ctx < need:
            n_ctx = min(max(need, 2 * self.ctx.n_ctx if self.ctx else 0, BLOCK), self.n_ctx_max)   # n_batch <= n_ctx
            self.close()
            self.ctx = Context(self._weights(), ContextParams(n_ctx=n_ctx, n_batch=BLOCK, n_ubatch=BLOCK,
                                                         n_threads=self.n_threads, kv_f16=True, n_outputs_max=1))
        if rows is not None and not set(rows.layers) <= set(self.ctx.layer_inp):
            self.ctx.export_layer_inputs(rows.layers)
        blocks = fast_blocks(len(head))
        same = common_prefix(self.tokens, head)
        if rows is not None:
            same = min(same, rows.start)     # the blocks whose rows are wanted are evaluated again
        n_keep = 0                           # leading blocks held as a fresh evaluation makes them
        while (n_keep < min(len(blocks), len(self.blocks)) and self.blocks[n_keep] == blocks[n_keep]
               and sum(blocks[n_keep]) <= same):
            n_keep += 1
        keep = blocks[n_keep - 1][0] + blocks[n_keep - 1][1] if n_keep else 0
        if keep < len(self.tokens) + self.n_tail:
            if not self.ctx.seq_rm(keep, -1):
                self.ctx.clear()
                keep, n_keep = 0, 0
            del self.tokens[keep:]
        del self.blocks[n_keep:]
        self.n_tail, self.logits = 0, None
        self.n_evaluated = need - keep
        for s, size in blocks[n_keep:]:
            if s > keep and cancel():
                return None
            self.ctx.decode(head[s:s + size], s, "none")
            self.tokens.extend(head[s:s + size].tolist())
            self.blocks.append((s, size))
            self._hand_rows(rows, s, size)
        if len(head) > keep and cancel():
            return None
        self.ctx.decode(tail, len(head), "last")
        self.n_tail, self.logits = len(tail), self.ctx.logits_rows()[-1].copy()
        self._hand_rows(rows, len(head), len(tail))
        return quantize_k(self.ctx.state_get(), self.rot, self.k_type)

    def _hand_rows(self, rows: RowsWanted | None, pos0: int, n: int) -> None:
        """The last decode's (positions pos0..pos0+n-1) wanted rows to rows.on_rows."""
        if rows is not None and pos0 + n > rows.start:
            skip = max(rows.start - pos0, 0)
            rows.on_rows(pos0 + skip, self.ctx.layer_rows(rows.layers)[skip:])
