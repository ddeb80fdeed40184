"""Each step's draft length from what a pass costs and how often the drafter is right
(--spec-draft-adaptive).

A draft of k tokens whose tokens are each accepted with probability a (given the ones before
were) yields, with the target's own token, E(k) = 1 + a + ... + a^k tokens per pass; the pass
costs t(k + 1), a target decode of k + 1 rows. The length that pays is the k in [0, cap] that
maximizes E(k) / t(k + 1), at least 1 (so that the estimate keeps learning; one extra row costs
little). On a verbatim copy a -> 1 and the longest draft pays; on a partial one the rows past the
likely rejection are wasted and k drops.

    PassCost   t(r): seconds of a target pass of r rows, learned from the engine's own passes
               (a running mean per r, a least-squares line t = c0 + c1 * r through them; before
               any data the line 1 + r / 4, the ratio of a 17-row verify to one token on a CPU)
    Acceptance a: accepted draft tokens / (accepted + first rejections), decayed by DECAY per
               draft so that it follows the text (a copy starts, a copy ends)
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.8          # weight of the past per draft in the acceptance estimate
PRIOR = (1.0, 1.0)   # (accepted, rejected): a = 0.5 before the first draft


@dataclass(slots=True)
class PassCost:
    """t(r) from observed target passes. record() after each pass; at(r) any time."""

    sums: dict[int, list[float]] = field(default_factory=dict)   # r -> [n, mean seconds]

    def record(self, rows: int, seconds: float) -> None:
        n, mean = self.sums.get(rows, (0, 0.0))
        n = min(n + 1, 32)                       # a running mean that keeps following the machine
        self.sums[rows] = [n, mean + (seconds - mean) / n]

    def line(self) -> tuple[float, float]:
        """(c0, c1) of t(r) = c0 + c1 * r, least squares over the per-r means (one point:
        through it with the prior's slope ratio)."""
        pts = [(r, m) for r, (_, m) in self.sums.items()]
        if not pts:
            return 1.0, 0.25
        if len(pts) == 1:
            r, m = pts[0]
            return m / (1 + 0.25 * r), 0.25 * m / (1 + 0.25 * r)
        n = len(pts)
        mr = sum(r for r, _ in pts) / n
        mt = sum(t for _, t in pts) / n
        var = sum((r - mr) ** 2 for r, _ in pts)
        c1 = max(sum((r - mr) * (t - mt) for r, t in pts) / var, 0.0)
        return max(mt - c1 * mr, 1e-9), c1

    def at(self, rows: int) -> float:
        c0, c1 = self.line()
        return c0 + c1 * rows


@dataclass(slots=True)
class Acceptance:
    acc: float = PRIOR[0]
    rej: float = PRIOR[1]

    def record(self, n_drafted: int, n_accepted: int) -> None:
        """One verified draft: n_accepted of its n_drafted tokens (a rejection if fewer)."""
        self.acc = DECAY * self.acc + n_accepted
        self.rej = DECAY * self.rej + (n_accepted < n_drafted)

    @property
    def rate(self) -> float:
        return self.acc / (self.acc + self.rej)


def expected_tokens(a: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens per pass of a k-token draft."""
    return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


def best_length(a: float, cost: PassCost, cap: int) -> int:
    """The k in [1, cap] with the most expected tokens per second (the shortest on ties)."""
    c0, c1 = cost.line()
    best, best_k = 0.0, 1
    for k in range(1, cap + 1):
        v = expected_tokens(a, k) / (c0 + c1 * (k + 1))
        if v > best * (1 + 1e-9):
            best, best_k = v, k
    return best_k
