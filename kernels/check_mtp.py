"""A greedy MTP-vs-target check on a real llama.cpp model: does the MTP head's argmax agree
with the target's at every position, and what does one decode of each cost."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrun.gguf_spec.spec import load_spec

from .llama import Context, ContextParams, Model
from .quantize import QuantizeError


@dataclass(frozen=True, slots=True)
class Agreement:
    """Greedy single-step acceptance: at n positions p, does argmax of the MTP row
    (x_p, p, h_{p-1}) equal argmax of the target's logits at p?"""

    n: int
    n_agree: int
    max_abs_dlogit: float

    @property
    def rate(self) -> float:
        return self.n_agree / self.n if self.n else 0.0


@dataclass(frozen=True, slots=True)
class MtpCheck:
    tokens: tuple[int, ...]            # the greedy sequence (prompt + generated)
    n_prompt: int
    greedy: Agreement                  # over the generated positions
    vocab: Agreement | None            # every token once, in a seeded random order
    t_target_ms: float | None          # median one-token target decode (with logits)
    t_mtp_ms: float | None             # median one-row MTP decode (with logits and h)

    @property
    def cost_ratio(self) -> float | None:
        """trunk:MTP cost, t_target / t_mtp."""
        if self.t_target_ms is None or not self.t_mtp_ms:
            return None
        return self.t_target_ms / self.t_mtp_ms


class _Pair:
    """A target context and an MTP draft context (MTP_NOTES §1) over kernels.llama's handles."""

    def __init__(self, model: Path, heads: Path | None, n_ctx: int, n_batch: int, n_threads: int):
        self._stack = ExitStack()
        self.n_batch = n_batch
        try:
            self.tm = self._stack.enter_context(Model(model, load_mtp=heads is None))
            self.hm = self._stack.enter_context(Model(heads, load_mtp=True)) if heads is not None else self.tm
            if self.hm.n_layer_nextn < 1:
                raise QuantizeError(f"{heads or model} has no MTP (nextn) layers")
            self.E = self.tm.n_embd_out
            if self.hm.n_embd_out != self.E:
                raise QuantizeError(f"MTP width {self.hm.n_embd_out} != target width {self.E}")
            cp = ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads,
                               n_threads_batch=n_threads)
            self.ct = self._stack.enter_context(Context(self.tm, replace(cp, nextn="all")))
            self.cm = self._stack.enter_context(Context(self.hm, replace(cp, mtp=True, nextn="outputs"),
                                                        ctx_other=self.ct))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> _Pair:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # [n, n_vocab] logits of every row (and [n, E] hidden rows)
    def target(self, tokens: Sequence[int], pos0: int, hidden: bool = False):
        self.ct.decode(tokens, pos0, "all")
        lg = self.ct.logits_rows().copy()
        return (lg, self.ct.nextn_rows().copy()) if hidden else lg

    # MTP rows (tokens[i], pos0 + i, hidden[i]) -> [n, n_vocab] logits
    def mtp(self, tokens: Sequence[int], pos0: int, hidden: np.ndarray) -> np.ndarray:
        self.cm.decode_with_hidden(tokens, pos0, hidden, logits="all")
        return self.cm.logits_rows().copy()

    def clear(self) -> None:
        self.ct.clear()
        self.cm.clear()

    def agreement(self, seq: Sequence[int], first: int) -> Agreement:
        """Decode seq from scratch in chunks; compare positions first .. len(seq)-1."""
        self.clear()
        lgs, hs = [], []
        for s in range(0, len(seq), self.n_batch):
            lg, h = self.target(seq[s:s + self.n_batch], s, hidden=True)
            lgs.append(lg)
            hs.append(h)
        lg_t, H = np.concatenate(lgs), np.concatenate(hs)
        h_prev = np.vstack([np.zeros((1, self.E), np.float32), H[:-1]])   # h_{p-1}, zeros at p=0
        lg_m = np.concatenate([self.mtp(seq[s:s + self.n_batch], s, h_prev[s:s + self.n_batch])
                               for s in range(0, len(seq), self.n_batch)])
        a, b = lg_t[first:], lg_m[first:]
        return Agreement(len(a), int((a.argmax(1) == b.argmax(1)).sum()), float(np.abs(a - b).max()))


def check_mtp(model: str | Path, heads: str | Path | None = None, *, prompt: Sequence[int] = (1, 2, 3, 4),
              n_gen: int = 64, vocab: bool = False, time_reps: int = 0, n_threads: int = 1,
              seed: int = 0) -> MtpCheck:
    """Greedy MTP-vs-target check on a real llama.cpp model.

    model: a GGUF with nextn layers (heads=None), or the target (trunk-only or full) with
    heads = an MTP-only GGUF. Generates n_gen greedy tokens one at a time after `prompt`, then
    compares MTP and target argmax at every generated position (`greedy`); `vocab` also runs
    every token id once in a seeded random order; time_reps > 0 times one-token decodes.
    n_threads defaults to 1: on a busy machine ggml's thread barriers dominate a one-token decode."""
    model = Path(model)
    heads = Path(heads) if heads is not None else None
    spec = load_spec(model)
    if not spec.has_trunk:
        raise QuantizeError(f"{model} has no trunk (an MTP-only file?); pass the full or trunk-only "
                            "model, and the heads file as `heads`")
    n_vocab = spec.vocab.size if spec.vocab is not None else 0
    n_ctx = (max(len(prompt) + n_gen + time_reps + 3, n_vocab if vocab else 0) + 256) // 256 * 256
    with _Pair(model, heads, n_ctx, 64, n_threads) as pair:
        seq = list(prompt)
        lg = pair.target(seq, 0)[-1]
        for _ in range(n_gen):
            seq.append(int(lg.argmax()))
            lg = pair.target(seq[-1:], len(seq) - 1)[-1]
        greedy = pair.agreement(seq, len(prompt))   # leaves both caches filled to len(seq) - 1
        t_t = t_m = None
        if time_reps > 0:
            pos, tt, tm = len(seq), [], []
            h = np.zeros((1, pair.E), np.float32)
            for r in range(time_reps + 3):             # 3 warm-up decodes
                tok = [seq[r % len(seq)]]
                t0 = time.perf_counter()
                pair.target(tok, pos + r)
                t1 = time.perf_counter()
                pair.mtp(tok, pos + r, h)
                t2 = time.perf_counter()
                if r >= 3:
                    tt.append(t1 - t0)
                    tm.append(t2 - t1)
            t_t, t_m = statistics.median(tt) * 1e3, statistics.median(tm) * 1e3
        vocab_agree = None
        if vocab:
            perm = np.random.default_rng(seed).permutation(n_vocab).tolist()
            vocab_agree = pair.agreement(perm, 1)
    return MtpCheck(tuple(seq), len(prompt), greedy, vocab_agree, t_t, t_m)
