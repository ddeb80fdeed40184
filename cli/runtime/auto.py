"""`--spec-type auto`: choose the spec type and draft length for this model on this machine.

The engine is opened with every spec type the files allow (loading.available_types), then
resolve_auto() runs kernels.calibrate on it (the verify-cost curve and short greedy probes of the
prompt) and returns the SpecParams to generate with; the reason goes to stderr as one line. The
calibration's verify-cost curve seeds the engine's pass costs (what --spec-draft-adaptive weighs a
draft length by), so its first generation measures none. The setting with the best predicted speedup
runs as it was calibrated; when none is predicted faster, or an ngram-simple setting won on the
built-in prompt of chat and serve (not the request's text), ngram-simple stays on with
--spec-draft-adaptive, which holds it back (0 rows, the engine scores its whole proposals instead)
on text it does not predict. In chat and serve suffix runs beside it, adaptive: their requests
recur, suffix drafts from earlier ones, and each step drafts from the one whose cut pays more
(benchmarks/results/suffix_choice.md). Every n-gram type of llama.cpp is a candidate (ngram-simple
at the command's sizes and at n2 m16, ngram-map-k, -map-k4v, ngram-mod, ngram-cache), and specrun's
suffix (probed without its global tree: what a first request gets), probed on the same prompt.

The machine's costs (the verify-cost curve, T1, each drafter's c0 and c1) are cached in
auto_cache_dir(), keyed by the model files, the machine, the threads and the settings
(kernels.calibrate.CachedMeasure). A second run only probes the prompt's acceptance;
--spec-auto-refresh (RunOptions.auto_refresh, passed as refresh) measures again.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from specrun.gguf_spec.registry import cache_dir
from specrun.kernels.calibrate import (
    MARGIN,
    CachedMeasure,
    Choice,
    calibrate,
    engine_key,
    explain,
    measure,
    n_steps,
    setting_name,
)
from specrun.kernels.engine import Engine
from specrun.kernels.params import MODEL_TYPES, NGRAM_TYPES, SpecParams

from .console import err_console
from .prompts import PROMPTS

# candidate draft lengths of the model drafters (a decode per drafted token); n-gram drafts are
# copies of size_n..size_m tokens, so their candidates are (size_n, size_m) pairs: the command's
# own and n2 m16. With the longest match (below) a 2-token pattern pays more than llama-server's
# usual n3: replayed on benchmarks/draft_length_replay.py's 39 texts with the adaptive length,
# modeled x none 1.867 at n2 against 1.835 at n3 and 1.804 at n4 (Gemma 2.258 / 2.197, SmolLM2
# 1.460 / 1.454); with llama.cpp's last occurrence n3 read 1.753
AUTO_N_MAX = (1, 2, 3, 4, 6, 8)
AUTO_NGRAM_SIZES = ((2, 16),)
# ngram-simple's candidates copy from the earlier occurrence with the longest matching context
# (kernels/drafters/ngram_simple.py; --spec-ngram-simple-match last keeps llama.cpp's last one)
AUTO_NGRAM_MATCH = "longest"
# llama.cpp's other n-gram drafters and specrun's suffix, which auto also probes, each with its own flags
# (the command's, the defaults unless given): one probe per rep each, as an n-gram has no n-max to vary
AUTO_NGRAM_TYPES = tuple(t for t in NGRAM_TYPES if t != "ngram-simple")


def auto_candidates(engine: Engine, base: SpecParams) -> list[SpecParams]:
    """Single-type candidates for what the engine has loaded, with base's other settings."""
    base = replace(base, adaptive=False)
    sizes = dict.fromkeys([(base.ngram_size_n, base.ngram_size_m), *AUTO_NGRAM_SIZES])
    match = base.ngram_match or AUTO_NGRAM_MATCH
    out = [replace(base, types=("ngram-simple",), ngram_size_n=n, ngram_size_m=m, ngram_match=match)
           for n, m in sizes if m <= engine.n_max_cap]
    out += [replace(base, types=(t,)) if t != "suffix" else _cold_suffix(base) for t in AUTO_NGRAM_TYPES]
    models = [t for t in engine.spec_types if t in MODEL_TYPES]
    return out + [replace(base, types=(t,), n_max=k) for t in models for k in AUTO_N_MAX if k <= engine.n_max_cap]


def _cold_suffix(base: SpecParams) -> SpecParams:
    """suffix's candidate probes without the global tree: its probes repeat one prompt, and each would
    draft the last one's output from it. So auto sees what a first request gets (the request's own
    text); the chosen setting runs with the command's global tree again (resolve_auto)."""
    return replace(base, types=("suffix",), suffix=replace(base.suffix, max_cached_requests=0))


_LIVE = measure   # kernels.calibrate's own, the one that is cached by default
REFRESH_HINT = "--spec-auto-refresh measures again"


def auto_cache_dir() -> Path:
    """Where the calibrations' machine costs are kept: the user cache (SPECRUN_CACHE_DIR), auto/."""
    return cache_dir() / "auto"


def calibrate_with_progress(engine: Engine, prompt_tokens, candidates: list[SpecParams], **opts) -> Choice:
    """calibrate() with a transient progress bar on stderr."""
    m = opts.get("measure")
    reps, verify_reps = opts.get("reps", 3), opts.get("verify_reps", 5)
    total = m.steps(candidates, reps, verify_reps) if isinstance(m, CachedMeasure) else n_steps(candidates, reps,
                                                                                                  verify_reps)
    with Progress(TextColumn("calibrating spec auto: {task.description}"), BarColumn(), MofNCompleteColumn(),
                  console=err_console, transient=True) as progress:
        task = progress.add_task("", total=total)
        return calibrate(engine, prompt_tokens, candidates,
                         on_step=lambda what: progress.update(task, advance=1, description=what), **opts)


def resolve_auto(engine: Engine, base: SpecParams, prompt_tokens=None, *, measure=measure,
                 refresh: bool = False, cache: Path | None = None) -> SpecParams:
    """The SpecParams that `--spec-type auto` stands for on this engine and prompt (None: a
    built-in free-text prompt, for chat and serve). Prints the choice and its reason on stderr.
    base: the command's --spec-* options (ngram sizes, p-min, verify... are kept; --spec-draft-adaptive
    applies to the chosen setting, the calibration itself runs without it). measure: kernels.calibrate's,
    or a test's with injected timings. cache: the folder of the machine's costs (default: auto_cache_dir()
    for kernels.calibrate's measure; a test's measure is cached only when cache is given); refresh
    (--spec-auto-refresh) measures again and overwrites."""
    builtin = prompt_tokens is None or len(prompt_tokens) == 0
    if builtin:
        prompt_tokens = engine.tokenize(PROMPTS["free"])
    cands = auto_candidates(engine, replace(base, adaptive=False))
    if cache is None and measure is _LIVE:
        cache = auto_cache_dir()
    cached = None
    if cache is not None:
        measure = cached = CachedMeasure(cache, engine_key(engine), refresh=refresh,
                                         measure=measure)
    choice = calibrate_with_progress(engine, prompt_tokens, cands, measure=measure)
    spec, reason = choice.spec, choice.reason
    verify = choice.costs.verify if choice.costs is not None else None
    if verify is not None and len(verify.rows) >= 3 and min(verify.s) > 0:
        engine.seed_pass_cost(verify)   # the adaptive length starts from this curve
    # an n-gram setting chosen on the request's own prompt runs as it was calibrated (the probes saw
    # this text pay); on the built-in prompt, ngram-simple goes adaptive (the setting that won, or
    # n2 m16 when another n-gram type won there: the built-in text says little of the requests'), with
    # suffix beside it.
    # ngram-mod always runs as calibrated: its own n-min rule (a 48-token chain or nothing) keeps it
    # silent on text it does not predict, and cut drafts would count as rejected in its
    # low-acceptance reset
    if not spec.types or (builtin and _ngram(spec) and spec.types != ("ngram-mod",)):
        # n-grams stay on, adaptive, so that each text decides (held back, at the cost of a lookup
        # per token, while a plain step pays more)
        ngram = spec if spec.types in (("ngram-simple",), ("suffix",)) else \
            _auto_simple(cands) or next((c for c in cands if _ngram(c)), None)
        if ngram is not None and builtin:
            # chat and serve: their requests recur, and suffix drafts from earlier ones; each step
            # drafts from the copy drafter whose cut pays more (Engine._propose)
            simple = ngram if ngram.types == ("ngram-simple",) else _auto_simple(cands) or ngram
            ngram = replace(simple, types=tuple(dict.fromkeys((*simple.types, "suffix"))))
        if ngram is not None:
            reason = _adaptive_reason(replace(ngram, adaptive=True), choice, builtin)
            spec = replace(ngram, adaptive=True)
    if "suffix" in spec.types:
        spec = replace(spec, suffix=base.suffix)     # probed cold (_cold_suffix); runs with the global tree
    if cached is not None and cached.hit:
        reason += f" [machine costs from the cache ({cached.path}); {REFRESH_HINT}]"
    err_console.print(f"spec auto: {reason}", markup=False, soft_wrap=True)
    return replace(spec, adaptive=spec.adaptive or (base.adaptive and bool(spec.types)))



def _adaptive_reason(spec: SpecParams, choice: Choice, builtin: bool) -> str:
    """Why an n-gram setting runs adaptive: what was predicted, in plain words."""
    head = f"{setting_name(spec)}, adaptive (drafts only where a draft is predicted to pay on the text at hand)"
    best = choice.table[0] if choice.table else None
    if not choice.spec.types:
        if best is None or choice.costs is None:
            return f"{head}: no setting could be predicted"
        t1 = choice.costs.t1_s
        return (f"{head}: no setting was predicted more than {MARGIN:.0%} faster than none on "
                f"{'a built-in prompt' if builtin else 'this prompt'}; the best, {setting_name(best.spec)}, "
                f"×{best.speedup:.2f} ({explain(best, choice.costs)}; plain step {t1 * 1e3:.2f} ms)")
    return (f"{head}: {setting_name(choice.spec)} was predicted ×{choice.predicted_speedup:.2f} on a built-in "
            f"prompt, which says little of the requests' text")


def _auto_simple(cands: list[SpecParams]) -> SpecParams | None:
    """ngram-simple's candidate at auto's own sizes (n2 m16)."""
    return next((c for c in cands if c.types == ("ngram-simple",)
                 and (c.ngram_size_n, c.ngram_size_m) == AUTO_NGRAM_SIZES[0]), None)


def _ngram(spec: SpecParams) -> bool:
    return bool(spec.types) and all(t in NGRAM_TYPES for t in spec.types)
