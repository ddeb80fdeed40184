"""The fast prompt context: long prompts evaluated with llama.cpp's fast batch kernels, then handed
to the exact decode context.

Exact mode's decode context keeps a Q8_0 KV cache, so that a one-token decode and a verify row
take the same flash-attention kernel (README, "Why the output is exactly the model's"). For a
prompt that cache is the slow part: flash attention over an F16 cache runs its tiled kernel on
many-row batches, about twice as fast over 1,500 tokens on this CPU. So a second context over the
same weights (no second copy: the memory cost is its KV cache and compute buffer) evaluates the
prompt's whole 512-token blocks with an F16 cache, and its sequence state is re-encoded to Q8_0
(kernels/kvstate.py) and loaded into the exact context, which evaluates the rest of the prompt
and everything after it.

Two rules keep every result a function of the tokens alone, never of what the caches held before
(so that the answer to a prompt is the same fresh, after a chat turn, or on a server slot that
served another request):
- the fast context evaluates exactly positions [0, fast_len(n)): whole blocks of 512 tokens
  aligned at absolute positions, one llama_decode each, and never the prompt's last token;
- it reuses only whole blocks it evaluated itself for the same tokens, and the exact context
  reuses its cache only when it was loaded from the same fast_len (Engine._prefill).
Speculative and plain decoding share this path, so speculative output still equals plain output
token for token; what the fast rows change is the prompt's KV (F16 attention, re-quantized),
about as much as a different KV cache type does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .kvstate import f16_to_q8_0
from .llama import Context, ContextParams, Model
from .types import common_prefix

BLOCK = 512          # tokens per fast decode, aligned at absolute positions


def fast_len(n_prompt: int) -> int:
    """The prompt positions [0, fast_len) the fast context evaluates: its whole aligned blocks,
    leaving at least the last token (whose logits start the generation) to the exact context.
    0 below BLOCK + 1 tokens."""
    return max(n_prompt - 1, 0) // BLOCK * BLOCK


class FastPrefill:
    """A second context over an exact-mode Model with an F16 KV cache, created at first use and
    sized to the longest head asked for so far (in steps of 2x, at most n_ctx_max), so that its
    memory follows the prompts actually given: kv_mib.

    state(head) -> the exact context's state for the prompt head (len a multiple of BLOCK).
    """

    def __init__(self, model: Model, n_ctx_max: int, n_threads: int, rot: tuple[int, int]) -> None:
        self.model, self.n_ctx_max, self.n_threads, self.rot = model, n_ctx_max, n_threads, rot
        self.ctx: Context | None = None
        self.tokens: list[int] = []          # the tokens whose blocks the fast context holds
        self.n_evaluated = 0                 # tokens the last state() call evaluated (not reused)

    @property
    def kv_mib(self) -> float:
        return self.ctx.kv_mib if self.ctx is not None else 0.0

    def forget(self) -> None:
        """Drop the blocks held (the context stays allocated)."""
        if self.ctx is not None:
            self.ctx.clear()
        self.tokens = []

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
        self.ctx, self.tokens = None, []

    def state(self, head: np.ndarray, cancel: Callable[[], bool]) -> bytes | None:
        """Evaluate head (int32 [k * BLOCK]) block by block, reusing the leading blocks already held
        for the same tokens, and return seq 0's state re-encoded for the exact (Q8_0) context.
        None when cancel() returned True between two blocks (the blocks done are kept).
        Raises KVStateError / LlamaError when the hand-over cannot work for this model."""
        assert len(head) % BLOCK == 0 and len(head) < self.n_ctx_max, len(head)
        if self.ctx is None or self.ctx.n_ctx < len(head):
            n_ctx = min(max(len(head), 2 * self.ctx.n_ctx if self.ctx else 0), self.n_ctx_max)
            self.close()
            self.ctx = Context(self.model, ContextParams(n_ctx=n_ctx, n_batch=BLOCK, n_ubatch=BLOCK,
                                                         n_threads=self.n_threads, kv_f16=True))
        keep = min(common_prefix(self.tokens, head), len(head)) // BLOCK * BLOCK
        if keep < len(self.tokens):
            if not self.ctx.seq_rm(keep, -1):
                self.ctx.clear()
                keep = 0
            del self.tokens[keep:]
        self.n_evaluated = len(head) - keep
        for s in range(keep, len(head), BLOCK):
            self.ctx.decode(head[s:s + BLOCK], s, "none")
            self.tokens.extend(head[s:s + BLOCK].tolist())
            if s + BLOCK < len(head) and cancel():
                return None
        return f16_to_q8_0(self.ctx.state_get(), self.rot)

