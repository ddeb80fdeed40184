"""Drafters that force the verifier through one branch (tests only)."""

from __future__ import annotations

import numpy as np

from specrun.kernels.types import Draft


class ShiftedDraft:
    """Always wrong: another drafter's proposal with every token id shifted by one. Under greedy
    verification with the target itself as the inner drafter, nothing is ever accepted."""

    def __init__(self, inner, n_vocab: int) -> None:
        self.inner, self.n_vocab = inner, n_vocab
        self.spec_type = inner.spec_type

    def begin(self, prompt: np.ndarray) -> None:
        self.inner.begin(prompt)

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        d = self.inner.propose(ctx, n_max)
        return Draft(((d.tokens + 1) % self.n_vocab).astype(np.int32), None)

    def accept(self, n_accepted: int, emitted: np.ndarray) -> None:
        self.inner.accept(n_accepted, emitted)

    def observe(self, tp, n_keep: int) -> None:
        if hasattr(self.inner, "observe"):
            self.inner.observe(tp, n_keep)

    def n_synced(self) -> int:
        return self.inner.n_synced() if hasattr(self.inner, "n_synced") else 1 << 30


class OracleDraft:
    """Proposes a known continuation (e.g. plain decoding's own output): always right."""

    spec_type = "oracle"

    def __init__(self, reference: list[int], n_prompt: int) -> None:
        self.reference, self.n_prompt = reference, n_prompt

    def begin(self, prompt: np.ndarray) -> None:
        pass

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        i = len(ctx) - self.n_prompt          # index in reference of the token after id_last
        return Draft(np.asarray(self.reference[i:i + n_max], dtype=np.int32), None)

    def accept(self, n_accepted: int, emitted: np.ndarray) -> None:
        pass
