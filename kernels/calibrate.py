"""Pick the speculative setting that is fastest on this machine, from a short calibration.

Everything is measured on the loaded engine, in this process (on a CPU a
verify row costs almost as much as a plain step, so acceptance alone does not decide).

    D(r)    time of one target decode of r rows with logits (a verify pass of r - 1 draft
            tokens), rolled back after each call; median of reps, made non-decreasing in r
            (draftlen.VerifyCost, timed by Engine.measure_passes as the adaptive length's are)
    T1      time per token of plain generation (a greedy `none` probe: decode, sampling and the
            loop's bookkeeping)
    Tv(r)   = T1 + D(r) - D(1): a verify pass costs a plain step plus its extra rows

Per drafter, greedy probe generations of the user's prompt at n_max = 1 and n_max = K (the
largest candidate) give:

    f       fraction of target passes that verified a draft (n-grams find no match on most
            steps of free text; MTP and draft models draft on every step)
    a_i     fraction of drafts whose first i + 1 tokens were accepted (acc_rate_per_pos)
    L       mean draft length at n_max = K
    t_tok   drafting time per drafted token (an MTP or draft-model step; 0 for n-grams)
    c0, c1  the rest of a pass's cost, fitted to the two probes: c0 per pass (n-gram lookup, MTP
            bookkeeping), c1 per drafted token (draft step plus bookkeeping; t_tok when the two
            probes cannot separate it)

The prediction for n_max = k <= K, with k' = min(k, L):

    E(k)       = 1 + f * (a_0 + ... + a_{k'-1})                        tokens per pass
                 (the adaptive length's E(k), draftlen.expected_tokens, of k' drafts, less the
                 target's own token, times f)
    T(k)       = f * Tv(k' + 1) + (1 - f) * T1 + c0 + c1 * f * k'      time per pass
    speedup(k) = E(k) * T1 / T(k)

With f = 1 and c0 = 0 this is E[tokens/pass] * T1 / (T_verify(k+1) + k * T_draft); the model
reproduces both probes' measured pass times by construction and interpolates between them.
`none` is chosen unless the best setting is predicted faster by more than a margin.

Acceptance comes from greedy probes: at temperature > 0 real acceptance is usually lower.

CachedMeasure keeps the machine's part (D(r), T1, c0, c1) in a JSON file per model, machine and
settings; a second calibration then only probes the acceptance of its own prompt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

from .drafters import draft_n_max, make_drafter
from .draftlen import VerifyCost, curve_rows, expected_tokens, rates_of
from .llama import MAX_EXACT_BATCH
from .params import MODEL_TYPES, NGRAM_TYPES, SPEC_TYPE, SpecParams
from .types import SamplingParams

log = logging.getLogger(__name__)

VERIFY_ROWS = tuple(curve_rows(17))   # the verify-cost curve's pass sizes (they seed the adaptive length's t(r))
MARGIN = 0.10            # choose a speculative setting only when predicted > 1 + MARGIN
GREEDY = SamplingParams(temp=0.0)

Progress = Callable[[str], None]     # called once per calibration step, with what it did


class CalibrationError(SpecrunError):
    """The calibration cannot run (no room in the context, an empty prompt)."""


# ---- data ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbeRun:
    """One greedy probe generation (pooled over reps; times are medians of reps)."""

    n_max: int
    n_passes: int
    n_gen: int
    n_drafts: int                 # drafts verified (n_gen_drafts)
    n_drafted: int                # draft tokens verified
    n_accepted: int
    acc_per_pos: tuple[float, ...]   # a_i: fraction of drafts accepted through position i
    t_pass_s: float               # generation time per target pass
    t_tok_s: float                # drafting time per drafted token (0 for per-call drafters)

    @property
    def f(self) -> float:
        return self.n_drafts / self.n_passes if self.n_passes else 0.0

    @property
    def mean_len(self) -> float:
        return self.n_drafted / self.n_drafts if self.n_drafts else 0.0

    @property
    def acceptance(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0


@dataclass(frozen=True, slots=True)
class DrafterCost:
    """One drafter's calibration: its probes and the fitted per-pass model."""

    spec: SpecParams              # the drafter's settings, n_max = K (the longest probe)
    probes: tuple[ProbeRun, ...]  # at n_max 1 and K (one when K = 1)
    c0_s: float                   # cost per pass besides verify and drafted tokens
    c1_s: float                   # cost per drafted token

    @property
    def long(self) -> ProbeRun:
        return self.probes[-1]


@dataclass(frozen=True, slots=True)
class Costs:
    verify: VerifyCost
    t1_s: float                   # plain generation, seconds per token
    drafters: tuple[DrafterCost, ...]


@dataclass(frozen=True, slots=True)
class Prediction:
    spec: SpecParams
    acceptance: float             # of the drafted tokens (probe at n_max = K)
    tokens_per_pass: float        # E(k)
    t_pass_s: float               # T(k)
    speedup: float                # E(k) * T1 / T(k)


@dataclass(frozen=True, slots=True)
class Choice:
    spec: SpecParams              # types=() when none is chosen
    predicted_speedup: float      # 1.0 for none
    reason: str                   # one or two lines: what and why
    table: tuple[Prediction, ...]  # every candidate, best first
    costs: Costs | None = None


# ---- the math (pure) -------------------------------------------------------------------------


def fit_drafter(spec: SpecParams, probes: Sequence[ProbeRun], verify: VerifyCost, t1: float) -> DrafterCost:
    """c0 and c1 such that both probes' pass times are reproduced (see the module docstring)."""

    def explained(p: ProbeRun) -> float:
        return p.f * (t1 + verify.at(p.mean_len + 1) - verify.at(1)) + (1 - p.f) * t1

    resid = [p.t_pass_s - explained(p) for p in probes]
    x = [p.f * p.mean_len for p in probes]          # drafted tokens per pass
    t_tok = probes[-1].t_tok_s
    if len(probes) > 1 and x[-1] - x[0] >= 0.25:
        c1 = max(0.0, (resid[-1] - resid[0]) / (x[-1] - x[0]))
    else:
        c1 = t_tok
    c0 = max(0.0, resid[-1] - c1 * x[-1])
    return DrafterCost(spec, tuple(probes), c0, c1)


def predict(costs: Costs, spec: SpecParams) -> Prediction:
    """The predicted speedup of a single-type setting whose drafter was calibrated with n_max >= spec.n_max."""
    dc = _drafter_cost(costs, spec)
    p = dc.long
    n_max = float(draft_n_max(spec.types[0], spec))
    k = min(n_max, p.mean_len) if p.n_drafts else n_max
    e = 1.0 + p.f * (expected_tokens(rates_of(p.acc_per_pos), k) - 1.0)
    t1 = costs.t1_s
    tv = t1 + costs.verify.at(k + 1) - costs.verify.at(1)
    t = p.f * tv + (1 - p.f) * t1 + dc.c0_s + dc.c1_s * p.f * k
    return Prediction(spec, p.acceptance, e, t, e * t1 / t if t > 0 else 0.0)


def _key(spec: SpecParams) -> SpecParams:
    return replace(spec, n_max=0)


def _drafter_cost(costs: Costs, spec: SpecParams) -> DrafterCost:
    for dc in costs.drafters:
        if _key(dc.spec) == _key(spec) and dc.spec.n_max >= spec.n_max:
            return dc
    raise CalibrationError(f"no calibration of {'+'.join(spec.types)} up to n-max {spec.n_max}")


def setting_name(spec: SpecParams) -> str:
    if not spec.types:
        return "none"
    if all(t in SPEC_TYPE for t in spec.types):   # "ngram-simple size-n 12 size-m 48", "draft-mtp n-max 3", joined by " + "
        return " + ".join(f"{t} {SPEC_TYPE[t].label(spec)}".rstrip() for t in spec.types)
    return f"{'+'.join(spec.types)} n-max {spec.n_max}"


def _probe_specs(spec: SpecParams) -> list[SpecParams]:
    """A drafter's probes: a model drafter at n_max 1 and at its own n_max; n-grams as they are
    (their drafts are bounded by their own flags: no n-max to vary)."""
    if spec.types[0] in NGRAM_TYPES:
        return [spec]
    return [replace(spec, n_max=k) for k in sorted({1, spec.n_max})]


def choose(costs: Costs, candidates: Sequence[SpecParams], margin: float = MARGIN,
           base: SpecParams | None = None) -> Choice:
    """The candidate with the highest predicted speedup, or `none` (base with types=()) when
    no candidate is predicted faster than 1 + margin."""
    table = sorted((predict(costs, c) for c in candidates if c.types), key=lambda p: -p.speedup)
    t1 = costs.t1_s
    none = replace(base or SpecParams(), types=())
    if not table:
        return Choice(none, 1.0, "none: no speculative setting to try", (), costs)
    best = table[0]
    why = explain(best, costs)
    if best.speedup > 1.0 + margin:
        reason = (f"{setting_name(best.spec)}: predicted ×{best.speedup:.2f} over none ({why}; "
                  f"plain step {t1 * 1e3:.2f} ms)")
        return Choice(best.spec, best.speedup, reason, tuple(table), costs)
    reason = (f"none: no speculative setting is predicted faster than ×{1 + margin:.2f}; the best, "
              f"{setting_name(best.spec)}, is ×{best.speedup:.2f} ({why}; plain step {t1 * 1e3:.2f} ms)")
    return Choice(none, 1.0, reason, tuple(table), costs)


def explain(p: Prediction, costs: Costs) -> str:
    """What a prediction rests on, in words: acceptance, tokens per pass, the verify and draft costs."""
    dc = _drafter_cost(costs, p.spec)
    t1 = costs.t1_s
    k = draft_n_max(p.spec.types[0], p.spec)     # an n-gram's longest draft is its own (size-m...)
    parts = [f"acceptance {p.acceptance:.2f}, {p.tokens_per_pass:.2f} tokens/pass",
             f"a {k + 1}-row verify costs {(t1 + costs.verify.at(k + 1) - costs.verify.at(1)) / t1:.2f}× a plain step"]
    if p.spec.types[0] in MODEL_TYPES:   # a decode per drafted token; n-grams: one lookup
        parts.append(f"a drafted token {dc.c1_s / t1:.2f}×")
    if dc.long.f < 0.999:
        parts.append(f"drafts on {dc.long.f:.0%} of passes")
    return ", ".join(parts)


# ---- measuring -------------------------------------------------------------------------------


def measure_verify_cost(engine, prompt_tokens: Sequence[int], rows: Sequence[int] = VERIFY_ROWS, reps: int = 5,
                        on_step: Progress | None = None) -> VerifyCost:
    """D(r) for each r in rows at the KV depth of the prompt (its tail when the context is short):
    one warm-up round, then `reps` rounds over all rows (interleaved, so drift hits every r alike).
    Leaves the engine's KV empty (engine.reset())."""
    ctx = engine.ctx
    cap = min(ctx.n_batch, MAX_EXACT_BATCH if engine.params.exact else ctx.n_batch)
    rows = tuple(sorted({int(r) for r in rows if 1 <= r <= cap}))
    if not rows:
        raise CalibrationError(f"no verify row count fits the batch (n_batch {ctx.n_batch})")
    prompt = np.asarray(prompt_tokens, dtype=np.int32)
    room = engine.n_ctx - rows[-1] - 1
    if room < 1:
        raise CalibrationError(f"the context ({engine.n_ctx} tokens) has no room for a {rows[-1]}-row verify pass")
    prompt = prompt[-room:] if len(prompt) > room else prompt
    if len(prompt) == 0:
        prompt = np.asarray([engine.model.bos], dtype=np.int32)
    engine.reset()
    try:
        ctx.decode_chunks(prompt, 0)
        on_round = (lambda i: on_step(f"verify cost, round {i + 1}/{reps + 1}")) if on_step else None
        return engine.measure_passes(rows, prompt, reps, warmup=True, on_round=on_round)
    finally:
        engine.reset()


def _probe_once(engine, prompt: np.ndarray, n_probe: int, spec: SpecParams) -> tuple:
    """Generate at least n_probe tokens. The generation may run a longest draft + 1 tokens further and is
    stopped early, so no draft is cut short by the end of generation (that would bias the
    acceptance of the last positions and the mean draft length)."""
    n = 0
    room = min(draft_n_max(spec.types[0], spec), engine.n_max_cap) + 1 if spec.types else 0
    # an n-gram drafter of its own for each probe: ngram-mod's pool and ngram-cache's tables carry
    # over between generations, so a shared one would draft the repeated probe from its own last run
    fresh = [make_drafter(spec.types[0], engine.target, spec)] if spec.types and spec.types[0] in NGRAM_TYPES else None
    try:
        with engine.generate(prompt, n_probe + room, GREEDY, spec=spec, drafters=fresh) as gen:
            for toks in gen:
                n += len(toks)
                if n >= n_probe:
                    break
    finally:
        for d in fresh or ():
            d.close()
    st = gen.stats
    d = st.drafters[0] if st.drafters else None
    return st, d


def probe(engine, prompt_tokens: Sequence[int], drafter_specs: Sequence[SpecParams], n_probe: int = 32,
          reps: int = 3, on_step: Progress | None = None) -> tuple[float, list[list[ProbeRun]]]:
    """Greedy probe generations, interleaved over reps: `none`, then each drafter at n_max = 1 and
    at its own n_max. Returns T1 (seconds per token of `none`) and, per drafter, its probes."""
    prompt = np.asarray(prompt_tokens, dtype=np.int32)
    runs = [(SpecParams(), None)]
    for i, s in enumerate(drafter_specs):
        runs += [(ps, i) for ps in _probe_specs(s)]
    t_pass: list[list[float]] = [[] for _ in runs]
    t_tok: list[list[float]] = [[] for _ in runs]
    last: list = [None] * len(runs)
    for rep in range(reps):
        for j, (spec, _) in enumerate(runs):
            st, d = _probe_once(engine, prompt, n_probe, spec)
            if st.n_target_passes == 0:
                raise CalibrationError("the probe generation stopped at its first token (end of generation); "
                                       "calibrate with a longer prompt")
            t_pass[j].append(st.t_gen_s / st.n_target_passes)
            if d is not None and d.n_gen_tokens and spec.types[0] in MODEL_TYPES:
                t_tok[j].append(d.t_draft_s / d.n_gen_tokens)
            last[j] = (st, d)
            if on_step:
                on_step(f"probe {setting_name(spec)}, rep {rep + 1}/{reps}")
    t1 = statistics.median(t_pass[0])
    out: list[list[ProbeRun]] = [[] for _ in drafter_specs]
    for j, (spec, i) in enumerate(runs):
        if i is None:
            continue
        st, d = last[j]
        out[i].append(ProbeRun(
            n_max=draft_n_max(spec.types[0], spec), n_passes=st.n_target_passes, n_gen=st.n_gen, n_drafts=d.n_gen_drafts,
            n_drafted=d.n_gen_tokens, n_accepted=d.n_acc_tokens, acc_per_pos=tuple(d.acc_rate_per_pos),
            t_pass_s=statistics.median(t_pass[j]), t_tok_s=statistics.median(t_tok[j]) if t_tok[j] else 0.0))
    return t1, out


def measure(engine, prompt_tokens: Sequence[int], candidates: Sequence[SpecParams], *, n_probe: int = 32,
            reps: int = 3, verify_reps: int = 5, on_step: Progress | None = None) -> Costs:
    """Measure this machine and model for the candidates' drafters: the verify-cost curve, T1,
    and each drafter's probes with its fitted costs. The engine must have been created able to run
    every candidate (draft-mtp needs the MTP heads loaded). Leaves the engine's KV empty.

    Steps: verify_reps + 1 verify-cost rounds, then reps x (1 + 2 per drafter) probes of n_probe tokens."""
    prompt = np.asarray(prompt_tokens, dtype=np.int32)
    if len(prompt) == 0:
        raise CalibrationError("the calibration prompt is empty")
    groups = _groups(candidates)
    if not groups:
        return Costs(VerifyCost((1,), (0.0,), (0.0,), (0.0,)), 0.0, ())
    k_max = max(min(draft_n_max(g.types[0], g), engine.n_max_cap) for g in groups)
    n_probe = min(n_probe, engine.n_ctx - len(prompt) - 2 * k_max - 3)
    if n_probe < 4:
        raise CalibrationError(f"no room in the context ({engine.n_ctx} tokens) to probe after a "
                               f"{len(prompt)}-token prompt; raise -c")
    verify = measure_verify_cost(engine, prompt, rows=sorted({*VERIFY_ROWS, k_max + 1}), reps=verify_reps,
                                 on_step=on_step)
    t1, probes = probe(engine, prompt, groups, n_probe, reps, on_step)
    engine.reset()
    return Costs(verify, t1, tuple(fit_drafter(s, p, verify, t1) for s, p in zip(groups, probes, strict=True)))


def calibrate(engine, prompt_tokens: Sequence[int], candidates: Sequence[SpecParams], *, margin: float = MARGIN,
              measure: Callable[..., Costs] = measure, **opts) -> Choice:
    """Choose among candidates (single-type SpecParams; `none` is always the fallback) from the
    costs measure() takes on this engine (opts: its n_probe, reps, verify_reps, on_step). A test
    may pass its own measure, e.g. the live probes' acceptance with injected timings."""
    costs = measure(engine, prompt_tokens, candidates, **opts)
    choice = choose(costs, candidates, margin, candidates[0] if candidates else SpecParams())
    log.info("calibration: %s", choice.reason)
    return choice


def _groups(candidates: Sequence[SpecParams]) -> list[SpecParams]:
    """One probe setting per drafter: its candidates' settings at their largest n_max."""
    groups: dict[SpecParams, SpecParams] = {}
    for c in candidates:
        if len(c.types) > 1:
            raise CalibrationError(f"calibration predicts single spec types, not {'+'.join(c.types)}")
        if c.types and (_key(c) not in groups or c.n_max > groups[_key(c)].n_max):
            groups[_key(c)] = c
    return list(groups.values())


def n_steps(candidates: Sequence[SpecParams], reps: int = 3, verify_reps: int = 5) -> int:
    """How many times calibrate() calls on_step (for a progress bar)."""
    groups = _groups(candidates)
    if not groups:
        return 0
    return verify_reps + 1 + reps * (1 + sum(len(_probe_specs(g)) for g in groups))


# ---- the cache of what the machine costs ---------------------------------------------------------
#
# A second calibration of the same model, machine and settings reuses the first one's timings
# (the verify-cost curve, T1, each drafter's c0 and c1) and times nothing: it runs one greedy
# probe per drafter on its own prompt, for the acceptance (a_i, f, L), which depends on the text.

CACHE_VERSION = 1


@dataclass(frozen=True, slots=True)
class MachineCosts:
    """The part of Costs that depends on the machine and model, not on the prompt."""

    verify: VerifyCost
    t1_s: float
    drafters: tuple[tuple[float, float], ...]   # (c0_s, c1_s) per probe setting, in _groups order

    @classmethod
    def of(cls, costs: Costs) -> MachineCosts:
        return cls(costs.verify, costs.t1_s, tuple((d.c0_s, d.c1_s) for d in costs.drafters))

    def to_json(self) -> dict:
        v = self.verify
        return {"verify": {"rows": v.rows, "s": v.s, "s_min": v.s_min, "s_max": v.s_max, "depth": v.depth,
                           "s_median": v.s_median},
                "t1_s": self.t1_s, "drafters": [list(d) for d in self.drafters]}

    @classmethod
    def from_json(cls, d: dict) -> MachineCosts:
        v = d["verify"]
        verify = VerifyCost(tuple(int(r) for r in v["rows"]), *(tuple(float(x) for x in v[k])
                                                                 for k in ("s", "s_min", "s_max")),
                            int(v["depth"]), tuple(float(x) for x in v["s_median"]))
        return cls(verify, float(d["t1_s"]), tuple((float(c0), float(c1)) for c0, c1 in d["drafters"]))


def _file_stamp(path: str | None) -> str:
    if not path:
        return ""
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:missing"
    return f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"


def engine_key(engine) -> dict[str, str]:
    """What an engine's timings depend on: the model files (path, size, mtime), the machine (CPU,
    cores, llama.cpp build: cpu_probe.cache_key), the threads and the context's settings."""
    from .cpu_probe import cache_key, read_cpuinfo
    from .llama import default_threads

    p = engine.params
    return {**cache_key(read_cpuinfo()), "cores": str(os.cpu_count()),
            "model": _file_stamp(engine.model.path), "draft_model": _file_stamp(p.draft_model),
            "threads": str(engine.ctx.params.n_threads or default_threads()), "exact": str(p.exact),
            "n_ctx": str(engine.n_ctx), "n_batch": str(engine.ctx.n_batch), "kv": repr(p.kv),
            "placement": repr(p.placement)}


def measure_acceptance(engine, prompt_tokens: Sequence[int], drafter_specs: Sequence[SpecParams], n_probe: int = 32,
                       on_step: Progress | None = None) -> list[ProbeRun]:
    """One greedy probe per drafter at its own n_max (greedy acceptance does not vary between
    runs); its timings are one run's, and the prediction does not read them."""
    prompt = np.asarray(prompt_tokens, dtype=np.int32)
    out = []
    for spec in drafter_specs:
        st, d = _probe_once(engine, prompt, n_probe, spec)
        if st.n_target_passes == 0:
            raise CalibrationError("the probe generation stopped at its first token (end of generation); "
                                   "calibrate with a longer prompt")
        out.append(ProbeRun(
            n_max=draft_n_max(spec.types[0], spec), n_passes=st.n_target_passes, n_gen=st.n_gen,
            n_drafts=d.n_gen_drafts, n_drafted=d.n_gen_tokens, n_accepted=d.n_acc_tokens,
            acc_per_pos=tuple(d.acc_rate_per_pos), t_pass_s=st.t_gen_s / st.n_target_passes,
            t_tok_s=d.t_draft_s / d.n_gen_tokens if d.n_gen_tokens and spec.types[0] in MODEL_TYPES else 0.0))
        if on_step:
            on_step(f"acceptance of {setting_name(spec)}")
    engine.reset()
    return out


class CachedMeasure:
    """A measure() for calibrate() that keeps the machine's costs in `directory`, one JSON file per
    key (the engine's, the probe settings and measure's options). On a hit it times nothing and
    only probes the acceptance (measure_acceptance); refresh=True measures again and overwrites.
    After a call, `hit` says which it was and `path` names the file."""

    def __init__(self, directory: Path, key: Mapping[str, str], *, refresh: bool = False,
                 measure: Callable[..., Costs] = measure,
                 acceptance: Callable[..., list[ProbeRun]] = measure_acceptance) -> None:
        self.directory, self.key, self.refresh = Path(directory), dict(key), refresh
        self._measure, self._acceptance = measure, acceptance
        self.hit = False
        self.path: Path | None = None

    def steps(self, candidates: Sequence[SpecParams], reps: int = 3, verify_reps: int = 5) -> int:
        """How many times a call will call on_step: all of measure()'s, or one per drafter on a hit."""
        groups = _groups(candidates)
        return len(groups) if self._load(candidates, reps, verify_reps) is not None else n_steps(candidates, reps,
                                                                                                  verify_reps)

    def _entry(self, candidates, reps, verify_reps, n_probe) -> dict:
        return {"v": CACHE_VERSION, "key": self.key, "probes": [repr(g) for g in _groups(candidates)],
                "reps": reps, "verify_reps": verify_reps, "n_probe": n_probe}

    def _file(self, entry: dict) -> Path:
        return self.directory / (hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:24] + ".json")

    def _load(self, candidates, reps=3, verify_reps=5, n_probe=32) -> MachineCosts | None:
        if self.refresh:
            return None
        entry = self._entry(candidates, reps, verify_reps, n_probe)
        try:
            data = json.loads(self._file(entry).read_text())
            if data["entry"] != json.loads(json.dumps(entry)):
                return None
            costs = MachineCosts.from_json(data["costs"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return costs if len(costs.drafters) == len(_groups(candidates)) else None

    def __call__(self, engine, prompt_tokens: Sequence[int], candidates: Sequence[SpecParams], *, n_probe: int = 32,
                 reps: int = 3, verify_reps: int = 5, on_step: Progress | None = None) -> Costs:
        entry = self._entry(candidates, reps, verify_reps, n_probe)
        self.path = self._file(entry)
        groups = _groups(candidates)
        known = self._load(candidates, reps, verify_reps, n_probe)
        self.hit = known is not None
        if known is not None:
            probes = self._acceptance(engine, prompt_tokens, groups, n_probe, on_step)
            return Costs(known.verify, known.t1_s, tuple(
                DrafterCost(g, (p,), c0, c1) for g, p, (c0, c1) in zip(groups, probes, known.drafters, strict=True)))
        costs = self._measure(engine, prompt_tokens, candidates, n_probe=n_probe, reps=reps, verify_reps=verify_reps,
                              on_step=on_step)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"entry": entry, "costs": MachineCosts.of(costs).to_json()}, indent=1))
            os.replace(tmp, self.path)
        except OSError as e:
            log.info("calibration not cached in %s: %s", self.directory, e)
        return costs
