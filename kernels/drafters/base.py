"""What every drafter shares: the narrow view of the target it is built with, and the rule
that turns a drafter's logits into one drafted token."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..llama import Context, Model
from ..sampling import inverse_cdf, position_rng, transform
from ..types import SamplingParams

_DRAFT_STREAM = 3  # random stream of draft sampling, apart from the target's (0, 1, 2)


@dataclass(frozen=True, slots=True)
class TargetView:
    """What a drafter may know of the target: its weights (vocabulary, width, MTP heads), its
    context (an MTP context links to it as ctx_other), and the sizes to build its own contexts with.
    Never the engine: drafters learn about the target's passes only through accept()."""

    model: Model
    ctx: Context
    n_ctx: int
    n_batch: int
    n_threads: int
    exact: bool
    fast_prefill: bool = False   # the target evaluates long prompts through kernels/prefill.py


def softmax_max(logits: np.ndarray) -> tuple[int, float]:
    """(argmax, its probability at temperature 1) of float32 [n_vocab] logits."""
    i = int(np.argmax(logits))
    m = float(logits[i])
    return i, 1.0 / float(np.exp(logits.astype(np.float64) - m).sum())


def draft_token(logits: np.ndarray, sampling: SamplingParams | None, p_min: float,
                pos: int) -> tuple[int | None, np.ndarray | None]:
    """One drafted token from a drafter's logits (float32 [n_vocab]) for absolute position pos.

    sampling set and not greedy: drawn from q = transform(logits) with the draft stream of
    (seed, pos); returns (token, q as float32 [n_vocab]). Otherwise greedy top-1, or (None, None)
    when its probability is below p_min (stop drafting)."""
    if sampling is not None and not sampling.greedy:
        q = transform(logits, sampling)                                # [n_vocab] float64
        u = position_rng(sampling.seed, pos, _DRAFT_STREAM).random()
        return int(inverse_cdf(q, u)), q.astype(np.float32)
    tok, p = softmax_max(logits) if p_min > 0 else (int(np.argmax(logits)), 1.0)
    return (None, None) if p < p_min else (tok, None)
