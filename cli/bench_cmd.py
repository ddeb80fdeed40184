"""`specrun bench`: every spec setting on one model, in one process, interleaved over repetitions.

    for rep in 1..reps: for prompt: for setting: reset the KV, generate n tokens, record

so machine drift (other processes, thermal limits) hits every setting alike. Per prompt, one table:
generation tokens/s (median, min–max over reps), the ratio to `none` (median over reps of the
ratio to none's tokens/s in the same rep), acceptance, mean accepted length, tokens per target
pass, and whether the tokens equal none's (greedy). Plus the verify-pass cost by rows, measured
on this machine (kernels.calibrate.measure_verify_cost).

The core (run_bench) takes Setting objects; a Setting may bring its own drafter objects, which is
how tests show that the equality column catches a setting whose output differs.
"""

from __future__ import annotations

import csv
import io
import json
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import click
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.output import check_output
from specrun.kernels.calibrate import GREEDY, VERIFY_ROWS, VerifyCost, measure_verify_cost, setting_name
from specrun.kernels.chat_template import TemplateError
from specrun.kernels.constrain import check_controls
from specrun.kernels.drafters import draft_n_max
from specrun.kernels.engine import Engine
from specrun.kernels.llama import default_threads
from specrun.kernels.params import MODEL_TYPES, NGRAM_TYPES, SpecParams, parse_spec_types
from specrun.kernels.stats import GenStats
from specrun.kernels.types import SamplingParams

from .runtime.chat import ChatFormat
from .runtime.console import err_console, handle_errors, setup_logging
from .runtime.help import SectionedCommand
from .runtime.loading import open_engine, prepare
from .runtime.options import (
    AUTO,
    SPEC_DEFAULT,
    engine_params,
    model_options,
    ngram_family_options,
    ngram_family_params,
)
from .runtime.prompts import BUILTIN, CHAT_MESSAGE, PROMPTS, read_prompt

VERIFY_REPS = 5


# ---- the core ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setting:
    """One column of the comparison: a SpecParams, or explicit drafter objects (tests)."""

    spec: SpecParams
    name: str = ""                                    # default: the spec types ("none" for none)
    drafters: Callable[[object], Sequence] | None = None   # engine -> drafter objects, per run

    @property
    def label(self) -> str:
        return self.name or ("+".join(self.spec.types) if self.spec.types else "none")

    @property
    def is_none(self) -> bool:
        return not self.spec.types and self.drafters is None


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    name: str
    tokens: tuple[int, ...]


@dataclass(slots=True)
class _Runs:
    tps: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    n_gen: int = 0
    n_passes: int = 0
    n_drafts: int = 0
    n_drafted: int = 0
    n_accepted: int = 0


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One (prompt, setting), numbers rounded as the table shows them."""

    prompt: str
    setting: str
    n_max: int | None
    gen_tps: float
    gen_tps_min: float
    gen_tps_max: float
    ratio_to_none: float
    acceptance_rate: float | None       # None: no draft was verified (none; n-grams without a match)
    mean_acc_len: float | None          # 1 + accepted tokens per verified draft
    tokens_per_pass: float
    n_gen: int
    equal_to_none: bool | None          # None: not checked (sampling at temperature > 0)
    first_diff: int | None              # first token index that differs from none's


@dataclass(frozen=True, slots=True)
class BenchResult:
    prompts: tuple[BenchPrompt, ...]
    rows: tuple[BenchRow, ...]
    verify: VerifyCost


def _first_diff(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _generate(engine: Engine, prompt: Sequence[int], n: int, sampling: SamplingParams,
              s: Setting) -> tuple[list[int], GenStats]:
    drafters = s.drafters(engine) if s.drafters is not None else None
    engine.reset()
    gen = engine.generate(prompt, n, sampling, spec=s.spec, drafters=drafters)
    return [t for chunk in gen for t in chunk], gen.stats


def _draft_bound(spec: SpecParams) -> int:
    """The n-max column: the longest draft of the setting (size_m for n-grams alone)."""
    return draft_n_max(spec.types[0], spec) if len(spec.types) == 1 else spec.n_max


def run_bench(engine, prompts: Sequence[BenchPrompt], settings: Sequence[Setting], n_predict: int, reps: int,
              sampling: SamplingParams = GREEDY, *, verify_rows: Sequence[int] = VERIFY_ROWS,
              verify_reps: int = VERIFY_REPS, warmup: bool = True,
              on_step: Callable[[str], None] | None = None) -> BenchResult:
    """Run every (prompt, setting) `reps` times, interleaved; the first setting must be `none`.
    on_step is called after each run (and each verify-cost round) with what was done."""
    if not settings or not settings[0].is_none:
        raise SpecrunError("the first bench setting must be `none` (the baseline)")
    verify = measure_verify_cost(engine, prompts[0].tokens, verify_rows, verify_reps, on_step)
    if warmup:   # untimed: first-use allocations (graphs per batch size, draft contexts)
        for s in settings:
            _generate(engine, prompts[0].tokens, min(8, n_predict), sampling, s)
    runs = {(p.name, i): _Runs() for p in prompts for i in range(len(settings))}
    for rep in range(reps):
        for p in prompts:
            for i, s in enumerate(settings):
                toks, st = _generate(engine, p.tokens, n_predict, sampling, s)
                r = runs[(p.name, i)]
                r.tps.append(st.gen_tps)
                r.tokens.append(toks)
                r.n_gen += st.n_gen
                r.n_passes += st.n_target_passes
                r.n_drafts += sum(d.n_gen_drafts for d in st.drafters)
                r.n_drafted += st.n_drafted
                r.n_accepted += st.n_accepted
                if on_step:
                    on_step(f"rep {rep + 1}/{reps} · {p.name} · {s.name or setting_name(s.spec)}")
    rows = []
    for p in prompts:
        base = runs[(p.name, 0)]
        for i, s in enumerate(settings):
            r = runs[(p.name, i)]
            ratios = [a / b for a, b in zip(r.tps, base.tps, strict=True) if b > 0]
            equal, diff = None, None
            if sampling.greedy:
                refs = [base.tokens[0]] * reps if s.is_none else base.tokens   # none: its reps agree
                diffs = [_first_diff(t, b) for t, b in zip(r.tokens, refs, strict=True)]
                bad = [d for d in diffs if d is not None]
                equal, diff = not bad, (min(bad) if bad else None)
            rows.append(BenchRow(
                prompt=p.name, setting=s.label, n_max=None if s.is_none else _draft_bound(s.spec),
                gen_tps=round(statistics.median(r.tps), 1), gen_tps_min=round(min(r.tps), 1),
                gen_tps_max=round(max(r.tps), 1),
                ratio_to_none=round(statistics.median(ratios), 2) if ratios else 0.0,
                acceptance_rate=round(r.n_accepted / r.n_drafted, 3) if r.n_drafted else None,
                mean_acc_len=round(1 + r.n_accepted / r.n_drafts, 2) if r.n_drafts else None,
                tokens_per_pass=round((r.n_gen - reps) / r.n_passes, 2) if r.n_passes else 0.0,
                n_gen=round(r.n_gen / reps), equal_to_none=equal, first_diff=diff))
    return BenchResult(tuple(prompts), tuple(rows), verify)


# ---- output --------------------------------------------------------------------------------------

COLUMNS = ("setting", "n-max", "tok/s", "min–max", "× none", "accept", "acc len", "tok/pass", "= none")


def _cells(r: BenchRow) -> list[str]:
    dash = "—"
    if r.equal_to_none is None:
        eq = dash
    elif not r.equal_to_none:
        eq = f"NO@{r.first_diff}"
    else:
        eq = "ref" if r.n_max is None else "yes"
    return [r.setting, dash if r.n_max is None else str(r.n_max), f"{r.gen_tps:.1f}",
            f"{r.gen_tps_min:.1f}–{r.gen_tps_max:.1f}", f"×{r.ratio_to_none:.2f}",
            dash if r.acceptance_rate is None else f"{r.acceptance_rate:.3f}",
            dash if r.mean_acc_len is None else f"{r.mean_acc_len:.2f}", f"{r.tokens_per_pass:.2f}", eq]


def tables(res: BenchResult, meta: dict) -> list[tuple[str, Table]]:
    """(title, table) pairs: the verify cost by rows, then one per prompt."""
    v = res.verify
    n_thr = meta["threads"]
    t = Table(box=box.ROUNDED)
    for c in ("rows", "ms", "min–max", "× 1 row"):
        t.add_column(c, justify="right")
    for r, ms, lo, hi in zip(v.rows, v.measured, v.s_min, v.s_max, strict=True):
        t.add_row(str(r), f"{ms * 1e3:.2f}", f"{lo * 1e3:.2f}–{hi * 1e3:.2f}", f"{ms / v.measured[0]:.2f}")
    out = [(f"verify pass cost by rows on this machine (KV depth {v.depth}, {n_thr} thread{'s' * (n_thr != 1)}, "
             f"median of {meta['verify_reps']})", t)]
    for p in res.prompts:
        t = Table(box=box.ROUNDED)
        for i, c in enumerate(COLUMNS):
            t.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
        for r in res.rows:
            if r.prompt == p.name:
                t.add_row(*_cells(r), style="bold red" if r.equal_to_none is False else None)
        out.append((f"{p.name}: {len(p.tokens)} prompt tokens, -n {meta['n_predict']}, {meta['reps']} reps, "
                    f"temp {meta['temp']:g}", t))
    return out


def verify_dicts(v: VerifyCost) -> list[dict]:
    return [{"rows": r, "ms": round(ms * 1e3, 2), "ms_min": round(lo * 1e3, 2), "ms_max": round(hi * 1e3, 2),
             "x_single": round(ms / v.measured[0], 2)}
            for r, ms, lo, hi in zip(v.rows, v.measured, v.s_min, v.s_max, strict=True)]


def to_json(res: BenchResult, meta: dict) -> dict:
    return {**meta, "verify_cost": {"kv_depth": res.verify.depth, "rows": verify_dicts(res.verify)},
            "prompts": [{"name": p.name, "n_prompt": len(p.tokens),
                         "rows": [asdict(r) for r in res.rows if r.prompt == p.name]} for p in res.prompts]}


def to_csv(res: BenchResult) -> str:
    buf = io.StringIO()
    names = list(BenchRow.__dataclass_fields__)
    w = csv.DictWriter(buf, fieldnames=names, lineterminator="\n")
    w.writeheader()
    for r in res.rows:
        w.writerow(asdict(r))
    return buf.getvalue()


def _check_plot(path: str) -> None:
    """Before the run: matplotlib is there, it writes this file type, and the file can be written."""
    try:
        import matplotlib
    except ImportError:
        raise SpecrunError("--plot needs matplotlib: pip install 'specrun[plot]'") from None
    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = Path(path).suffix.lstrip(".").lower()
    if kind not in kinds:
        raise SpecrunError(f"--plot {path}: matplotlib writes {', '.join(sorted(kinds))}, not "
                           f"{kind or 'a file without an extension'}; name it e.g. bench.png")
    check_output(path)


def plot_label(r: BenchRow) -> str:
    """A setting's name under its bars: "draft-mtp, n-max 3" (n-grams: their longest draft, as the table's n-max)."""
    return r.setting if r.n_max is None else f"{r.setting}, n-max {r.n_max}"


def plot(res: BenchResult, path: str) -> None:
    """Tokens/s (median, min–max bars) and acceptance per setting, one group of bars per prompt."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(plot_label(r) for r in res.rows))
    prompts = [p.name for p in res.prompts]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6.0, 0.9 * len(labels) * max(1, len(prompts)) ** 0.5), 7),
                                   sharex=True)
    width = 0.8 / max(1, len(prompts))
    for j, pname in enumerate(prompts):
        rows = [r for r in res.rows if r.prompt == pname]
        xs = [i + (j - (len(prompts) - 1) / 2) * width for i in range(len(rows))]
        tps = [r.gen_tps for r in rows]
        err = [[r.gen_tps - r.gen_tps_min for r in rows], [r.gen_tps_max - r.gen_tps for r in rows]]
        ax1.bar(xs, tps, width, yerr=err, capsize=2, label=pname)
        ax2.bar(xs, [r.acceptance_rate or 0.0 for r in rows], width, label=pname)
    ax1.set_ylabel("generation tokens/s")
    ax1.legend(fontsize="small")
    ax2.set_ylabel("acceptance rate")
    ax2.set_ylim(0, 1)
    ax2.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the command ---------------------------------------------------------------------------------


def parse_settings(types_text: str, n_max_text: str, ngram_n: int, ngram_m: int,
                   family: dict | None = None) -> list[Setting]:
    """'none,ngram-simple,draft-mtp' x '1,3' -> none first, then each type at each n-max.
    'a+b' is a combination (llama.cpp's order: n-grams first). n-gram types alone run once: their
    drafts are bounded by their own flags (size_m...), not by an n-max (llama.cpp's semantics).
    family: the other n-gram types' SpecParams fields (options.ngram_family_params)."""
    try:
        n_maxes = list(dict.fromkeys(int(x) for x in n_max_text.split(",") if x.strip()))
    except ValueError:
        raise click.BadParameter(f"'{n_max_text}' is not a comma-separated list of integers",
                                 param_hint="--spec-draft-n-max") from None
    if not n_maxes or min(n_maxes) < 1:
        raise click.BadParameter("draft lengths must be >= 1", param_hint="--spec-draft-n-max")
    out = [Setting(SpecParams())]
    seen: set[tuple] = set()
    for item in (t.strip() for t in types_text.split(",")):
        if not item or item == "none":
            continue
        if item == "auto":
            raise click.BadParameter("bench compares named settings, and auto is a choice among them: leave "
                                     "--spec-type out to compare every type this model can use, or see what auto "
                                     "picks with `specrun run --spec-type auto`", param_hint="--spec-type")
        try:
            types = parse_spec_types(item.replace("+", ","))
        except SpecrunError as e:
            raise click.BadParameter(str(e), param_hint="--spec-type") from None
        if not types or types in seen:
            continue
        seen.add(types)
        out += [Setting(SpecParams(types=types, n_max=k, ngram_size_n=ngram_n, ngram_size_m=ngram_m, **(family or {})))
                for k in (n_maxes if not set(types) <= set(NGRAM_TYPES) else n_maxes[:1])]
    return out


def ngram_n_max_note(n_max_text: str) -> str:
    """The line for --spec-draft-n-max given with n-gram types only (llama.cpp does not apply it to them)."""
    return (f"--spec-draft-n-max {n_max_text} is ignored: n-gram drafts are bounded by their own flags "
            "(--spec-ngram-simple-size-m, --spec-ngram-map-k-size-m, --spec-ngram-mod-n-max...), as in llama.cpp")


def _ngrams_only(settings: Sequence[Setting]) -> bool:
    types = [s.spec.types for s in settings if s.spec.types]
    return bool(types) and all(set(t) <= set(NGRAM_TYPES) for t in types)


def _prompt_choice(prompt: str | None, file: str | None, names: str | None) -> list[tuple[str, str | None]]:
    """(name, text) pairs before the model is loaded; text None = the chat prompt (rendered later)."""
    if names is not None and (prompt is not None or file is not None):
        raise click.UsageError("give --prompts or -p/-f, not both")
    if prompt is not None or file is not None:
        text = read_prompt(prompt, file)
        return [("prompt" if prompt is not None else ("stdin" if file == "-" else Path(file).name), text)]
    wanted = list(BUILTIN) if names in (None, "builtin") else [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in BUILTIN]
    if unknown or not wanted:
        raise click.BadParameter(f"unknown prompt '{(unknown or [names])[0]}'; choose builtin or some of "
                                 f"{', '.join(BUILTIN)}", param_hint="--prompts")
    return [(n, PROMPTS.get(n)) for n in dict.fromkeys(wanted)]


def _prompts(engine, chosen: list[tuple[str, str | None]]) -> list[BenchPrompt]:
    out = []
    for n, text in chosen:
        if text is not None:
            out.append(BenchPrompt(n, tuple(int(t) for t in engine.tokenize(text))))
            continue
        toks = _chat_tokens(engine)
        if toks is not None:
            out.append(BenchPrompt("chat", toks))
    if not out:
        raise click.UsageError("no prompt left to run (the model has no chat template)")
    return out


def _chat_tokens(engine: Engine) -> tuple[int, ...] | None:
    if not engine.model.chat_template():
        err_console.print("skipping the chat prompt: the model has no chat template", style="dim")
        return None
    try:
        tokens, _ = ChatFormat.load(engine.model).prompt([{"role": "user", "content": CHAT_MESSAGE}])
    except TemplateError as e:
        err_console.print(f"skipping the chat prompt: {e}", markup=False, soft_wrap=True)
        return None
    return tuple(tokens)


def _out_console(to_stderr: bool) -> Console:
    f = sys.stderr if to_stderr else sys.stdout
    return Console(file=f, highlight=False, width=None if f.isatty() else 160)


@click.command("bench", cls=SectionedCommand)
@model_options
@click.option("--spec-type", "spec_type", default=None,
              help="comma-separated settings to compare, 'a+b' for a combination "
                   f"(default: none, ngram-simple, and {' / '.join(MODEL_TYPES)} when the files allow)")
@click.option("--spec-draft-n-max", "n_max", default="1,2,3,5,8", show_default=True,
              help="comma-separated draft lengths; each model spec type runs at each (n-gram types: their own flags)")
@click.option("--spec-ngram-simple-size-n", "ngram_n", type=click.IntRange(1), default=SPEC_DEFAULT.ngram_size_n,
              show_default=True)
@click.option("--spec-ngram-simple-size-m", "ngram_m", type=click.IntRange(1), default=SPEC_DEFAULT.ngram_size_m,
              show_default=True)
@ngram_family_options
@click.option("-p", "--prompt", default=None, help="one prompt text instead of the built-in prompts")
@click.option("-f", "--file", "file", default=None, help="read one prompt from a file (- for stdin)")
@click.option("--prompts", "prompt_names", default=None,
              help=f"built-in prompts: builtin (all) or some of {', '.join(BUILTIN)} (chat only with a chat template)")
@click.option("-n", "--n-predict", "n_predict", type=click.IntRange(1), default=128, show_default=True,
              help="tokens to generate per run")
@click.option("--temp", type=float, default=0.0, show_default=True,
              help="temperature (> 0: sampled with a fixed --seed; the equality column is then not checked)")
@click.option("-s", "--seed", type=click.IntRange(0), default=0, show_default=True)
@click.option("--reps", type=click.IntRange(1), default=3, show_default=True, help="repetitions of every run")
@click.option("--json", "as_json", is_flag=True, help="print the results as JSON on stdout (tables on stderr)")
@click.option("--csv", "as_csv", is_flag=True, help="print one CSV row per prompt and setting (tables on stderr)")
@click.option("--plot", "plot_path", default=None, metavar="OUT.png",
              help="draw tokens/s and acceptance per setting (needs matplotlib: pip install 'specrun[plot]')")
@handle_errors
def bench(spec_type, n_max, ngram_n, ngram_m, prompt, file, prompt_names, n_predict, temp, seed, reps, as_json,
          as_csv, plot_path, **kw):
    """Compare spec settings on one model: tokens/s, speed ratio to none, acceptance, output equality."""
    if as_json and as_csv:
        raise click.UsageError("--json and --csv do not go together; choose one")
    if plot_path:
        _check_plot(plot_path)
    setup_logging(kw["verbose"])
    params = engine_params(kw, SpecParams())
    if spec_type is None:     # every type the files allow (as auto, which says nothing of an unused -md)
        _, params = prepare(kw["model"], replace(params, spec=SpecParams(types=AUTO)))   # auto: the available ones
        spec_type = ",".join(("none", *(t for t in params.spec.types if t == "ngram-simple" or t not in NGRAM_TYPES)))
    family = ngram_family_params(kw)
    settings = parse_settings(spec_type, n_max, ngram_n, ngram_m, family)
    if (click.get_current_context().get_parameter_source("n_max") is not click.core.ParameterSource.DEFAULT
            and _ngrams_only(settings)):
        err_console.print(ngram_n_max_note(n_max), markup=False, soft_wrap=True)
    chosen = _prompt_choice(prompt, file, prompt_names)
    union = tuple(dict.fromkeys(t for s in settings for t in s.spec.types))
    if "draft-simple" in union and not kw["model_draft"]:
        raise click.UsageError("--spec-type draft-simple needs -md/--model-draft DRAFT.gguf")
    spec = SpecParams(types=parse_spec_types(",".join(union)) if union else (),
                      n_max=max(s.spec.n_max for s in settings), ngram_size_n=ngram_n, ngram_size_m=ngram_m, **family)
    sampling = SamplingParams(temp=temp, seed=seed)
    check_controls(sampling, {"temp": "--temp"})
    with open_engine(kw["model"], replace(params, spec=spec)) as engine:
        prompts = _prompts(engine, chosen)
        meta = {"model": engine.model.path, "threads": engine.ctx.params.n_threads or default_threads(),
                "exact": engine.params.exact, "n_predict": n_predict, "reps": reps, "temp": temp, "seed": seed,
                "verify_reps": VERIFY_REPS, "load_avg": [round(x, 2) for x in os.getloadavg()]}
        total = VERIFY_REPS + 1 + reps * len(prompts) * len(settings)
        with Progress(TextColumn("bench {task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn(), console=err_console, transient=True) as progress:
            task = progress.add_task("warming up", total=total)
            res = run_bench(engine, prompts, settings, n_predict, reps, sampling,
                            on_step=lambda what: progress.update(task, advance=1, description=what))
    err_console.print(f"load average at the start: {meta['load_avg'][0]:.2f} (1 min) on {os.cpu_count()} cores",
                      style="dim")
    con = _out_console(to_stderr=as_json or as_csv)
    for title, t in tables(res, meta):
        con.print(title, style="bold", markup=False)
        con.print(t)
    if as_json:
        json.dump(to_json(res, meta), sys.stdout)
        sys.stdout.write("\n")
    elif as_csv:
        sys.stdout.write(to_csv(res))
    if plot_path:
        plot(res, plot_path)
        err_console.print(f"plot written to {plot_path}", style="dim")
