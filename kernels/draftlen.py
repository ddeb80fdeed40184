"""Each step's draft length from what a pass costs and how often the drafter is right
(--spec-draft-adaptive).

A draft of k tokens whose i-th token is accepted with probability a_i (given the ones before
were) yields, with the target's own token, E(k) = 1 + a_1 + a_1 a_2 + ... tokens per pass; the pass
costs t(k + 1), a target decode of k + 1 rows. The length that pays is the k in [0, cap] that
maximizes E(k) / t(k + 1); at least 1 for a model drafter (so that the estimate keeps learning;
one extra row costs little), and 0 allowed for an n-gram drafter, whose proposals are free: it is
always asked for its longest draft, the length that pays is cut from it (0: held back, a plain
step), and the whole proposal is scored against the tokens the target then emits, so the estimate
follows the text, past the cut and without any verify rows while held back. A proposal that
continues a copy seen right for j tokens is judged from position j on. On a verbatim copy
a_i -> 1 and the longest draft pays; on a partial one the rows past the likely rejection are
wasted and k drops; on text that n-grams do not predict the drafter is silent.

Proposals are free only next to a pass: suffix's search takes a fraction of a millisecond. So
while a free drafter is held back it is asked only every few steps, often enough that its
proposals take at most HELD_SHARE of the plain steps' time (DraftLength.pace); it drafts
again at the first proposal that pays.

    VerifyCost the measured cost of target passes of r rows (Engine.measure_passes, the one way
               passes are timed): auto's calibration reads it as D(r), and PassCost starts from it
    PassCost   t(r): seconds of a target pass of r rows, learned from the engine's own passes
               (a running mean per r, linear between them; before any data the line 1 + r / 4),
               times a level that every pass moves (the context grows, the machine drifts).
               It starts from a VerifyCost: the engine's probe of a few pass sizes, once before its
               first adaptive generation (passes of the lengths it is not choosing would never be
               seen otherwise), or auto's calibration curve. A pass is one ubatch; a batched
               decode over several sequences may run as several (ubatch_rows), and costs their sum
    Acceptance a_i: by draft position, P(token i accepted | tokens before it were), decayed by
               DECAY per draft so that it follows the text (a copy starts, a copy ends);
               E(k) = 1 + a_1 + a_1 a_2 + ... + a_1..a_k (expected_tokens, which auto's calibration
               predicts with too). Prior: 0.5, and for n-gram drafters 0.9
               past a copy's first token (a copy that starts right tends to stay right). A
               proposal that starts where the last one was right to its end continues that copy:
               judged, and scored, from the copy's second token on
"""

from __future__ import annotations

import heapq
import statistics
from bisect import bisect_left
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .types import common_prefix

DECAY = 0.8          # weight of the past per draft in the acceptance estimate
PRIOR = (1.0, 1.0)   # (accepted, rejected): a = 0.5 before the first draft
PRIOR_COPY = (4.0, 0.0)   # free (n-gram) drafters, past a copy's first token: rate 0.9 with PRIOR's first
LEVEL_W = 0.5        # weight of one pass in PassCost's level (its noise moves every t(r) alike)
SHAPE_W = 1 / 16     # ... and in its shape, base(r)
HELD_SHARE = 0.01    # a held-back free drafter's proposals: at most this share of the plain steps' time
MAX_IDLE = 16        # ... and it is asked at least every MAX_IDLE + 1 steps
# The pass sizes timed before t(r) is used (the engine's probe, auto's calibration), those up to the
# longest pass; t(r) is linear between them. Both sides of every 4th row: llama.cpp's CPU matmuls take
# the rows in blocks of 4 on x86, and the row past a block costs most, so a draft of 4k - 1 tokens
# pays where one more does not. Probing every such size, not only powers of 2, keeps a size first
# seen live in line with the probed ones. The measurements: docs/design.md, "The pass-cost curve".
CURVE_ROWS = (1, 2, 4, 5, 8, 9, 12, 13, 16, 17, 32, 33, 64)


def curve_rows(max_rows: int) -> list[int]:
    """The pass sizes to time for t(r) up to max_rows (>= 1): CURVE_ROWS below it, and max_rows."""
    return sorted({*(r for r in CURVE_ROWS if r < max_rows), max_rows})


def ubatch_rows(seq_rows: Sequence[tuple[int, int]], n_ubatch: int) -> list[int]:
    """The rows of each ubatch llama.cpp runs for one decode over a KV stream per sequence
    (llama_batch_allocr::split_equal, sequential). seq_rows: (sequence id, rows) in batch order, a
    sequence's rows together. A ubatch takes the first sequence with rows left, then each later one
    whose id is one more than the last taken, and the same number of rows from each: as many as all
    of them have left, within n_ubatch. Each ubatch reads every weight once more, so one-token rows
    share a ubatch only over consecutive ids, and a draft longer than its neighbours' adds ubatches.
    ubatch_rows([(0, 1), (1, 5), (2, 1)], 512) == [3, 4]; ubatch_rows([(0, 1), (2, 1)], 512) == [1, 1]."""
    left = [[sid, n] for sid, n in seq_rows if n > 0]
    out: list[int] = []
    while left:
        take = [left[0]]
        for q in left[1:]:
            if q[0] == take[-1][0] + 1:
                take.append(q)
        m = max(1, min(min(q[1] for q in take), n_ubatch // len(take)))
        for q in take:
            q[1] -= m
        out.append(m * len(take))
        left = [q for q in left if q[1] > 0]
    return out


@dataclass(frozen=True, slots=True)
class VerifyCost:
    """The measured cost of target passes: D(r), the seconds of one decode of r rows with logits (a
    verify pass of r - 1 drafts) at KV depth `depth`. All tuples are [len(rows)], rows ascending.
    Made by curve_of from Engine.measure_passes' times; auto's calibration predicts from it and
    the adaptive length's PassCost starts from it."""

    rows: tuple[int, ...]
    s: tuple[float, ...]          # the curve: the median (or the fastest) per row count, made
                                  # non-decreasing in rows (what at() and PassCost read)
    s_min: tuple[float, ...]
    s_max: tuple[float, ...]
    depth: int = 0
    s_median: tuple[float, ...] = ()   # the medians as measured (empty: s); a pass of more rows can be
                                       # cheaper (Gemma 3 270M: 12 rows below 9, a block of 4 rows each)

    @property
    def measured(self) -> tuple[float, ...]:
        """[len(rows)] median seconds as measured, before the non-decreasing step."""
        return self.s_median or self.s

    def at(self, r: float) -> float:
        """D(r) in seconds, linear between measured rows (and beyond the last, on its slope)."""
        rows, s = self.rows, self.s
        if len(rows) == 1 or r <= rows[0]:
            return s[0]
        for i in range(1, len(rows)):
            if r <= rows[i] or i == len(rows) - 1:
                r0, r1, s0, s1 = rows[i - 1], rows[i], s[i - 1], s[i]
                return s0 + (s1 - s0) * (r - r0) / (r1 - r0)
        raise AssertionError("unreachable")


def curve_of(times: Mapping[int, Sequence[float]], depth: int = 0, fastest: bool = False) -> VerifyCost:
    """A VerifyCost from each row count's timed passes ({rows: seconds of each round}). The curve is
    the median per row count, or the fastest (the engine's two-round probe: the median of two is
    their mean, which one slow pass moves, and noise only adds time), made non-decreasing: noise
    must not make more rows look cheaper."""
    rows = tuple(sorted(times))
    med = [statistics.median(times[r]) for r in rows]
    curve = [min(times[r]) for r in rows] if fastest else list(med)
    for i in range(1, len(curve)):
        curve[i] = max(curve[i], curve[i - 1])
    return VerifyCost(rows, tuple(curve), tuple(min(times[r]) for r in rows), tuple(max(times[r]) for r in rows),
                      depth, tuple(med))


@dataclass(slots=True)
class PassCost:
    """t(r) from observed target passes, as a shape times a level: t(r) = scale * base(r).
    record() after each pass; at(r) any time.

    The level follows what a pass costs now, the shape how the rows add up, more slowly. A pass
    of a row count seen before moves the level (scale) by LEVEL_W of the way to seconds /
    base(rows), then base(rows) by SHAPE_W of the way to seconds / scale; a count's first pass
    sets its base(rows). So the plain steps at a longer context raise the whole curve, not t(1)
    alone: a curve probed near position 0 and read deep into a long context (where every pass
    costs more) would otherwise set a stale t(17) against a fresh t(1) and call long drafts cheap.
    The shape itself can change with depth too (SmolLM2's long passes grow dearer than its short
    ones: docs/benchmarks.md, "Sessions in one process"); a row count's shape then follows only
    through its own passes. A draft's length depends on the shape only
    (E(k) / t(k + 1) is compared across k at one level)."""

    sums: dict[int, list[float]] = field(default_factory=dict)   # r -> [passes (at most 32), base(r) seconds]
    scale: float = 1.0

    def record(self, rows: int, seconds: float) -> None:
        seen = self.sums.get(rows)
        if seen is None:
            self.sums[rows] = [1, seconds / self.scale]
            return
        if len(self.sums) >= 2:
            self.scale += LEVEL_W * (seconds / max(seen[1], 1e-12) - self.scale)
        seen[0] = min(seen[0] + 1, 32)
        seen[1] += SHAPE_W * (seconds / self.scale - seen[1])

    def copy(self) -> PassCost:
        return PassCost({r: list(v) for r, v in self.sums.items()}, self.scale)

    def add(self, curve: VerifyCost) -> None:
        """Each of a measured curve's passes, recorded, made non-decreasing in rows (as curve_of
        makes them: noise must not make more rows look cheaper)."""
        top = 0.0
        for r, t in zip(curve.rows, curve.s, strict=True):
            top = max(top, t)
            self.record(int(r), top)

    def record_split(self, ubatches: Sequence[int], seconds: float) -> None:
        """One decode that llama.cpp ran as these ubatches (ubatch_rows): a single one is a pass of
        its rows; several move the level only (what each cost alone is not seen)."""
        if len(ubatches) == 1:
            self.record(ubatches[0], seconds)
        elif len(self.sums) >= 2:
            self.scale += LEVEL_W * (seconds / max(sum(self._base(r) for r in ubatches), 1e-12) - self.scale)

    def split_at(self, ubatches: Sequence[int]) -> float:
        """Seconds of one decode run as these ubatches: the sum of their passes."""
        return sum(self.at(r) for r in ubatches)

    @classmethod
    def of(cls, curve: VerifyCost) -> PassCost:
        """t(r) that starts from a measured curve."""
        c = cls()
        c.add(curve)
        return c

    def line(self) -> tuple[float, float]:
        """(c0, c1) of base(r) = c0 + c1 * r, least squares over the per-r means (one point:
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

    def idle_steps(self, t_propose: float) -> int:
        """Plain steps a held-back free drafter skips after a proposal of t_propose seconds: as many
        as keep its proposals at HELD_SHARE of the steps' time t(1), MAX_IDLE at most."""
        return min(MAX_IDLE, int(t_propose / (HELD_SHARE * self.at(1))))

    def at(self, rows: int) -> float:
        """t(rows): scale times base(rows), linear between the per-r means around it (a CPU's verify
        curve is concave: a line through few short passes would call every long draft dear), the
        least-squares slope past the longest pass seen, the shortest's time below it; the line
        alone before two."""
        return self.scale * self._base(rows)

    def _base(self, rows: int) -> float:
        pts = sorted((r, m) for r, (_, m) in self.sums.items())
        if len(pts) < 2:
            c0, c1 = self.line()
            return c0 + c1 * rows
        if rows <= pts[0][0]:
            return pts[0][1]
        if rows >= pts[-1][0]:
            return pts[-1][1] + self.line()[1] * (rows - pts[-1][0])
        i = bisect_left(pts, (rows, -1.0))
        (r0, t0), (r1, t1) = pts[i - 1], pts[i]
        return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)


@dataclass(slots=True)
class Acceptance:
    """A drafter's acceptance by draft position, following the text: rates(n)[i] = P(the draft's
    token i + 1 is accepted | its tokens 1..i were), from counts that decay by DECAY per draft.

    By position, because drafts are not coin flips: an n-gram copy is often wrong at its first
    token (the match was the wrong one) and then right for a long run, so a single rate would
    call a verbatim copy's long drafts a waste. Before any draft, rate 0.5 (PRIOR, which decays
    like a draft); a position no draft has reached takes the best rate before it."""

    reached: list[float] = field(default_factory=lambda: [float(sum(PRIOR))])   # [i]: drafts that got to token i + 1
    accepted: list[float] = field(default_factory=lambda: [float(PRIOR[0])])    # [i]: ... and had it accepted

    def record(self, n_drafted: int, n_accepted: int, at: int = 0) -> None:
        """One verified (or shadow-scored) draft: its first n_accepted of n_drafted tokens accepted;
        at: the position of its first token in its copy (1: it continues a copy that was right)."""
        grow = at + n_drafted - len(self.reached)
        if grow > 0:
            self.reached += [0.0] * grow
            self.accepted += [0.0] * grow
        for i in range(len(self.reached)):
            self.reached[i] *= DECAY
            self.accepted[i] *= DECAY
        for i in range(min(n_accepted + 1, n_drafted)):
            self.reached[at + i] += 1.0
            self.accepted[at + i] += i < n_accepted

    def rates(self, n: int) -> list[float]:
        """[n] conditional rates; position i > 0 weighs in the rate of position i - 1 as one draft.
        A position no draft has reached takes the best rate past the first before it (the first's
        at position 1): a copy right for longer is taken to go on at least as well, so that the one
        copy seen to end at its 11th token does not make a coin flip of every token past it."""
        out: list[float] = []
        best = 0.0                     # the best rate past position 0 so far
        for i in range(n):
            r, a = (self.reached[i], self.accepted[i]) if i < len(self.reached) else (0.0, 0.0)
            if i == 0:
                out.append(a / r)
                continue
            out.append((a + out[-1]) / (r + 1.0) if r > 0 else out[0] if i == 1 else best)
            best = max(best, out[-1])
        return out

    @classmethod
    def of_copies(cls) -> Acceptance:
        """The prior of a drafter that copies earlier text: its first token right half the time,
        and a copy that has been right so far right at its next token with 0.9 (PRIOR_COPY blended
        with the first position's, as rates() does), so that a held-back copy seen right for a token
        or two is drafted before any copy was scored."""
        return cls([float(sum(PRIOR)), float(sum(PRIOR_COPY))], [float(PRIOR[0]), PRIOR_COPY[0]])

    @property
    def rate(self) -> float:
        """P(a draft's first token is accepted)."""
        return self.rates(1)[0]


def expected_each(a: Sequence[float], n: int) -> Iterator[float]:
    """E(0), E(1), ..., E(n) of expected_tokens, one term more each (a position past a: rate 0)."""
    e, p = 1.0, 1.0
    yield e
    for i in range(n):
        p *= a[i] if i < len(a) else 0.0
        e += p
        yield e


def expected_tokens(a: float | Sequence[float], k: float) -> float:
    """E(k): tokens per pass of a k-token draft, the target's own and the accepted ones:
    1 + a1 + a1 a2 + ... + a1..ak, with a the per-position conditional rates (a position past
    them: 0) or one rate for every position (1 + a + ... + a^k). A fractional k (a mean draft
    length) adds its fraction of the next term: E(2.5) = E(2) + 0.5 a1 a2 a3."""
    n = int(k)
    if isinstance(a, (int, float)):
        if n == k:
            return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)
        a = [float(a)] * (n + 1)
    if n == k:
        return list(expected_each(a, n))[-1]
    *_, e, e_next = expected_each(a, n + 1)
    return e + (k - n) * (e_next - e)


def rates_of(through: Sequence[float]) -> list[float]:
    """Per-position conditional rates a_i from the fractions of drafts accepted through each
    position (stats' acc_rate_per_pos: a1, a1 a2, ...); past a position no draft passed, 0."""
    out, prev = [], 1.0
    for t in through:
        out.append(t / prev if prev > 0 else 0.0)
        prev = t
    return out


def best_length(a: float | Sequence[float], cost: PassCost, cap: int, k_min: int = 1) -> int:
    """The k in [k_min, cap] with the most expected tokens per second E(k) / t(k + 1) (the
    shortest on ties); a: Acceptance.rates(cap), or one rate for every position.
    k_min 1 keeps a drafter's estimate learning from its own drafts; 0 (no draft: a plain step)
    is for drafters whose proposals cost nothing to make and can be scored without a verify pass
    (their whole proposals scored against the emitted text)."""
    rates = [float(a)] * cap if isinstance(a, (int, float)) else a
    best, best_k = 0.0, k_min
    for k, e in enumerate(expected_each(rates, cap)):
        if k >= k_min and e / cost.at(k + 1) > best * (1 + 1e-9):
            best, best_k = e / cost.at(k + 1), k
    return best_k


def share_rows(rates: Sequence[Sequence[float]], lengths: Sequence[int], k_min: Sequence[int],
               pass_time: Callable[[Sequence[int]], float]) -> list[int]:
    """Draft lengths for sequences that share one target decode (a batched step): k_i in
    [min(k_min[i], lengths[i]), lengths[i]] with the most expected tokens per second of the decode,
    (n + sum_i (E_i(k_i) - 1)) / pass_time(k), n = len(lengths); rates[i]: sequence i's
    per-position acceptance (at least lengths[i] long); pass_time(k): seconds of the decode where
    sequence i verifies 1 + k_i rows (llama.cpp's ubatches of it: ubatch_rows). Each sequence's next
    token adds a_i1..a_ik (its chance to be reached and accepted), which only falls with k; rows are
    added in that order, largest first, and the count with the best ratio is kept. A draft longer
    than its neighbours' is a ubatch of its own, which costs about a plain step more, and a large
    batch's one-token rows already fill the matrix units: there, no drafts at all."""
    n = len(lengths)
    if n == 0:
        return []
    k0 = [min(m, ln) for m, ln in zip(k_min, lengths, strict=True)]
    k = list(k0)
    p = [float(np.prod(rates[i][:k[i]])) for i in range(n)]
    e = n + sum(sum(float(np.prod(rates[i][:j + 1])) for j in range(k[i])) for i in range(n))
    heap = [(-p[i] * rates[i][k[i]], i) for i in range(n) if k[i] < lengths[i]]
    heapq.heapify(heap)
    best, n_best, order = e / pass_time(k), 0, []
    while heap:
        m, i = heapq.heappop(heap)
        e = e - m
        p[i], k[i] = -m, k[i] + 1
        order.append(i)
        ratio = e / pass_time(k)
        if ratio > best * (1 + 1e-9):
            best, n_best = ratio, len(order)
        if k[i] < lengths[i] and p[i] > 0:
            heapq.heappush(heap, (-p[i] * rates[i][k[i]], i))
    out = k0
    for i in order[:n_best]:
        out[i] += 1
    return out


@dataclass(slots=True)
class DraftLength:
    """One drafter's draft length through a generation: its cap, or (adaptive) the best_length at
    its running acceptance.

    start(cost) at the generation's start; record() after each verified draft of it; after each
    target pass, score(ctx_tokens) decides its pending proposal. A drafter with free proposals
    (k_min 0: n-grams) is always asked for its longest draft, and take(...) says how much of it
    to verify (0: held back, a plain step); its acceptance is learned from whole proposals, each
    scored against the text the target emits (one pending at a time), not from the cut that was
    verified: a cut draft says nothing about the tokens past it, and counting the next draft of the
    same copy from position 1 would teach that copies fail early, so the cut would shrink itself."""

    cap: int                   # its longest draft, within the engine's bounds
    adaptive: bool = False
    k_min: int = 1             # 0: it may be held back (its proposals are free: n-grams)
    acc: Acceptance = field(default_factory=Acceptance)
    n: int = 0                 # the length to ask for now
    shadow: tuple[int, np.ndarray] | None = None   # pending proposal: (position of its first token, int32 [k])
    at: int = 0                # the pending proposal's first token's position in its copy (0 or 1)
    kind: str = ""             # the pending proposal's Draft.kind
    kinds: dict[str, Acceptance] = field(default_factory=dict)   # each named kind's acceptance ("": acc)
    run_end: int = -1          # where the last scored proposal ended if the text matched all of it
    idle: int = 0              # steps before a held-back free drafter is asked again (pace)

    @property
    def free(self) -> bool:
        """Whether its proposals are scored whole against the emitted text (adaptive, free)."""
        return self.adaptive and self.k_min == 0

    def __post_init__(self) -> None:
        if self.k_min == 0 and self.acc == Acceptance():
            self.acc = self._prior()

    def _prior(self) -> Acceptance:
        """A fresh acceptance: a free drafter's prior is copies' (Acceptance.of_copies)."""
        return Acceptance.of_copies() if self.k_min == 0 else Acceptance()

    def _best(self, cost: PassCost) -> int:
        return best_length(self.acc.rates(self.cap), cost, self.cap, self.k_min)

    def of_kind(self, kind: str) -> Acceptance:
        """The acceptance of proposals of this Draft.kind: suffix's copies of earlier answers (global)
        are right more often than those of the request's own text, and each is judged by its own."""
        if not kind:
            return self.acc
        if kind not in self.kinds:
            self.kinds[kind] = self._prior()
        return self.kinds[kind]

    def start(self, cost: PassCost) -> None:
        self.n = self._best(cost) if self.adaptive else self.cap

    def record(self, n_drafted: int, n_accepted: int, cost: PassCost) -> None:
        """One verified draft of n_drafted tokens, n_accepted of them accepted (a free drafter's
        is scored through its pending proposal instead)."""
        if self.adaptive and not self.free:
            self.acc.record(n_drafted, n_accepted)
            self.n = self._best(cost)

    def take(self, proposal: np.ndarray, pos: int, limit: int, cost: PassCost, kind: str = "") -> np.ndarray:
        """The tokens to verify at positions pos.. (int32 [k], k <= limit; 0: held back), from a
        free drafter's proposal (int32, may be empty; kind: its Draft.kind), which becomes the pending
        proposal if none is. Of candidates(), the cut with the most expected tokens per second is drafted."""
        return self.best_cut(proposal, pos, limit, cost, kind)[2]

    def best_cut(self, proposal: np.ndarray, pos: int, limit: int,
                 cost: PassCost, kind: str = "") -> tuple[float, list[float], np.ndarray]:
        """take()'s choice as (its expected tokens per second E(k) / t(k + 1), its candidate's
        per-position rates, the cut: int32 [k]). A held-back drafter's value is a plain step's,
        1 / t(1), which any draft that pays beats: the engine drafts from the free drafter whose
        cut has the highest value."""
        best: tuple[float, list[float], np.ndarray] = (1.0 / cost.at(1), [], proposal[:0])   # nothing pending
        for i, (a, toks) in enumerate(self.candidates(proposal, pos, kind)):
            k = best_length(a, cost, min(len(toks), limit, self.cap), 0)
            v = expected_tokens(a, k) / cost.at(k + 1)
            if i == 0 or v > best[0]:
                best = (v, a, toks[:k])
        return best

    def candidates(self, proposal: np.ndarray, pos: int, kind: str = "") -> list[tuple[list[float], np.ndarray]]:
        """What a free drafter may draft at positions pos..: (per-position rates, int32 [k] tokens)
        pairs. The proposal becomes the pending one if none is. The pending one, right so far for
        its first j tokens, offers the rest of its copy, judged by the rates from position j on (a
        copy that started right tends to stay right); a proposal that continues it is the same copy;
        one that does not is judged by the rates from the start. A new pending proposal that starts
        where the last one was right to its end is judged from a copy's second token (the text is
        still copying). Each is judged by the rates of its kind (Draft.kind; the pending one's for
        its copy). None while nothing is pending."""
        if self.shadow is None and len(proposal):
            self.shadow, self.at, self.kind = (pos, proposal), int(pos == self.run_end), kind
        if self.shadow is None:
            return []
        p0, pend = self.shadow
        j = pos - p0
        cands = [(self.at if j == 0 else 0, proposal, kind if j else self.kind)]
        if 0 < j < len(pend):
            rest = pend[j:]
            m = min(len(proposal), len(rest))
            if m and np.array_equal(proposal[:m], rest[:m]):
                cands = [(self.at + j, proposal if len(proposal) >= len(rest) else rest, self.kind)]
            else:
                cands.append((self.at + j, rest, self.kind))
        return [(self.of_kind(k).rates(self.cap + off)[off:], toks) for off, toks, k in cands]

    def ask(self) -> bool:
        """Whether to ask the drafter for a proposal this step (False: a paced step, counted)."""
        if self.idle > 0:
            self.idle -= 1
            return False
        return True

    def pace(self, drafted: int, t_propose: float, cost: PassCost) -> None:
        """After a free drafter's proposal of t_propose seconds (its mean): drafted 0 (held back)
        skips cost.idle_steps(t_propose) steps; drafted > 0 asks again at the next step."""
        if self.free:
            self.idle = 0 if drafted else cost.idle_steps(t_propose)

    def score(self, ctx_tokens: Sequence[int], cost: PassCost) -> None:
        """Score the pending proposal once the emitted text ctx_tokens decides it (a mismatch, or
        all of it matched), as a draft of its length from its position in its copy."""
        if self.shadow is not None:
            n_ok, done = score_shadow(self.shadow, ctx_tokens)
            if done:
                p0, toks = self.shadow
                self.of_kind(self.kind).record(len(toks), n_ok, self.at)
                self.n = self._best(cost)
                self.shadow, self.run_end = None, p0 + len(toks) if n_ok == len(toks) else -1


def score_shadow(sh: tuple[int, np.ndarray], ctx_tokens: Sequence[int]) -> tuple[int, bool]:
    """(tokens of the pending proposal (p0, tokens) that the emitted text ctx_tokens[p0:] matches,
    whether that is final: a mismatch, or the whole draft matched)."""
    p0, toks = sh
    got = ctx_tokens[p0:p0 + len(toks)]
    n_ok = common_prefix(got, toks[:len(got)])
    return n_ok, n_ok < len(got) or len(got) == len(toks)
