"""Dataclasses that cross module boundaries inside kernels and out to the CLI.

Vocabulary follows llama.cpp's common/speculative.cpp: target / draft, id_last (the last
emitted token, not yet decoded by the target), n_past (its position), n_draft, n_accept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

LLAMA_DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's "random seed" marker


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """llama.cpp's defaults. temp <= 0 means greedy (argmax, first index on ties)."""

    temp: float = 0.8
    top_k: int = 40          # <= 0: whole vocabulary
    top_p: float = 0.95      # 1.0: off
    min_p: float = 0.05      # 0.0: off
    seed: int = LLAMA_DEFAULT_SEED

    @property
    def greedy(self) -> bool:
        return self.temp <= 0.0


@dataclass(frozen=True, slots=True)
class Draft:
    """What a drafter proposes for the positions after id_last.

    tokens: int32 [k], k may be 0 (no draft this step).
    probs:  float32 [k, n_vocab], the drafter's distribution q at each drafted position (after
            the same temperature/top-k/top-p/min-p transforms as the target), or None for a
            deterministic proposer (n-grams, greedy drafting): one-hot q.
    """

    tokens: np.ndarray
    probs: np.ndarray | None = None

    @staticmethod
    def empty() -> Draft:
        return Draft(np.zeros(0, dtype=np.int32), None)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, slots=True)
class Verdict:
    """Outcome of verifying one draft.

    n_accepted: how many draft tokens were accepted (0..k).
    tokens:     int32 [n_accepted + 1]: the accepted draft tokens, then one token from the
                target: the *recovered* token at the first rejection, or the *bonus* token when
                all k were accepted.  Example: draft [a, b, c], target samples [a, x, ...] ->
                n_accepted=1, tokens=[a, x] (x recovered).  Draft [a, b], target [a, b, y] ->
                n_accepted=2, tokens=[a, b, y] (y bonus).
    """

    n_accepted: int
    tokens: np.ndarray


class Drafter(Protocol):
    """One lifecycle for every drafter (llama.cpp's begin / draft / accept).

    begin(prompt):          a new sequence starts; prompt = every token the target has seen.
    propose(ctx, n_max):    ctx = prompt + emitted tokens so far, ending with id_last (int32 [n]);
                            returns at most n_max tokens to follow id_last.
    accept(n_accepted, emitted): the target accepted n_accepted of the last draft and emitted
                            `emitted` (int32 [n_accepted + 1]); drafters with state roll back.
    """

    spec_type: ClassVar[str]

    def begin(self, prompt: np.ndarray) -> None: ...

    def propose(self, ctx: np.ndarray, n_max: int) -> Draft: ...

    def accept(self, n_accepted: int, emitted: np.ndarray) -> None: ...
