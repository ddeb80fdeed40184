"""Drafters that force the verifier through one branch (tests only); they implement
kernels.types.Drafter like the real ones. And FixedCost, a pass cost that no timing moves."""

from __future__ import annotations

import numpy as np

from specrun.kernels.draftlen import PassCost
from specrun.kernels.types import Draft, DraftOptions, TargetPass


class ShiftedDraft:
    """Always wrong: another drafter's proposal with every token id shifted by one. Under greedy
    verification with the target itself as the inner drafter, nothing is ever accepted."""

    def __init__(self, inner, n_vocab: int) -> None:
        self.inner, self.n_vocab = inner, n_vocab
        self.spec_type = inner.spec_type
        self.needs_hidden = inner.needs_hidden

    def begin(self, prompt: np.ndarray, n_keep: int, opts: DraftOptions) -> int:
        return self.inner.begin(prompt, n_keep, opts)

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        d = self.inner.propose(ctx, n_max)
        return Draft(((d.tokens + 1) % self.n_vocab).astype(np.int32), None)

    def accept(self, tp: TargetPass) -> None:
        self.inner.accept(tp)

    def close(self) -> None:
        self.inner.close()


class OracleDraft:
    """Proposes a known continuation (e.g. plain decoding's own output): always right. spec_type:
    a copy drafter's name ("ngram-simple", "suffix") makes the engines treat its proposals as free."""

    needs_hidden = False

    def __init__(self, reference: list[int], n_prompt: int, spec_type: str = "oracle") -> None:
        self.reference, self.n_prompt, self.spec_type = reference, n_prompt, spec_type

    def begin(self, prompt: np.ndarray, n_keep: int, opts: DraftOptions) -> int:
        return n_keep

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        i = len(ctx) - self.n_prompt          # index in reference of the token after id_last
        return Draft(np.asarray(self.reference[i:i + n_max], dtype=np.int32), None)

    def accept(self, tp: TargetPass) -> None:
        pass

    def close(self) -> None:
        pass


class FirstRightDraft(ShiftedDraft):
    """Another drafter's proposal with every token after the first shifted by one id: right at its
    first token, then wrong (a copy that ends at once, when the inner one is always right)."""

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft:
        t = self.inner.propose(ctx, n_max).tokens.copy()
        t[1:] = (t[1:] + 1) % self.n_vocab
        return Draft(t.astype(np.int32), None)


class FixedCost(PassCost):
    """The prior's line t(r) = 1 + r / 4, whatever the passes took: a test then checks the lengths
    and drafters the engine picks, not this machine's timings (a 2-core CI runner's steeper verify
    curve once kept the oracle's mean draft under 10). Set it as an engine's pass_cost."""

    __slots__ = ()

    def record(self, rows: int, seconds: float) -> None:
        pass
