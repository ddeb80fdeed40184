"""--spec-draft-adaptive against fixed n-gram drafts, on the peers workloads, in one process.

    python benchmarks/draft_length.py [--set fixed|auto] [--workloads free,code-rewrite,...] [-n 128] [--reps 3]
                                      [--out FILE.json] [--curves FILE.json]

For each workload (benchmarks/prompts/, the peers benchmark's files and models), greedy, 2 threads,
exact mode, one request at a time:
  * --set fixed (the default): `none`, ngram-simple size-n 3 / size-m 16 with its fixed length (the
    cap), and the same with --spec-draft-adaptive;
  * --set auto: `none` and the copy drafters chat's and serve's `auto` may run: ngram-simple
    size-n 2 / size-m 16 (longest match) adaptive, the same beside suffix (each step drafts from the
    one whose cut pays more), and suffix alone; suffix without its global tree (a first request's);
  * --set sessions: the same settings on suffix_bench.py's sessions (a workload per model: its
    requests in order, each after the last on one engine, as one server slot serves them), suffix
    with its global tree (fresh per session); a row sums the session's requests.
Two speeds per row, both against `none`:

  * modeled: each pass's rows priced by one pass-cost curve t(r), measured once per model at the start
    (median of 5 interleaved rounds of 1..33-row passes) and frozen, so that the draft lengths the policy picks
    do not depend on this machine's drift while it runs: the same run gives the same passes, and
    the ratio is the policy's own (what a change to kernels/draftlen.py is judged by). --curves
    takes them from an earlier run's JSON instead, so that two versions of the code can be compared
    pass for pass;
  * wall: generation tokens/s, the median of --reps runs, interleaved across the three settings.

Every row's text is compared with `none`'s. Prints a markdown table; writes all numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from specrun.gguf_spec.registry import resolve_model
from specrun.kernels.calibrate import measure_verify_cost
from specrun.kernels.chat_template import template_for
from specrun.kernels.drafters.suffix import private_stores
from specrun.kernels.draftlen import PassCost, curve_rows
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams, SpecParams, SuffixParams
from specrun.kernels.types import SamplingParams, Stops

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from peers import cpu_model, git_state  # noqa: E402
from suffix_bench import MODELS, STOP, load_workloads, request_body  # noqa: E402

PROMPTS = ROOT / "benchmarks" / "prompts"
WORKLOADS = {   # name: (model, prompt file), as in benchmarks/peers.py
    "free": ("gemma-3-270m", "free.txt"),
    "code-rewrite": ("gemma-3-270m", "code_rewrite.txt"),
    "verbatim": ("gemma-3-270m", "verbatim_source.txt"),
    "json-table": ("gemma-3-270m", "json_table.txt"),
    "summary": ("smollm2-135m-instruct", "summary_quotes.txt"),
    "chat-reuse": ("smollm2-135m-instruct", "chat_reuse.txt"),
    "code-rewrite-smollm2": ("smollm2-135m-instruct", "code_rewrite.txt"),
    "long-prompt": ("gemma-3-270m", "long_prompt.txt"),
    "long-prompt-smollm2": ("smollm2-135m-instruct", "long_prompt.txt"),
}
NGRAM = SpecParams(types=("ngram-simple",), ngram_size_n=3, ngram_size_m=16, verify="match")
AUTO = SpecParams(types=("ngram-simple",), ngram_size_n=2, ngram_size_m=16, ngram_match="longest", adaptive=True,
                  verify="match", suffix=SuffixParams(max_cached_requests=0))
SESSIONS = {f"{w.name}:{m}": (m, w) for m in MODELS for w in load_workloads()}   # suffix_bench's
AUTO_SET = {"none": SpecParams(verify="match"), "ngram n2 m16": AUTO,
            "ngram n2 m16 + suffix": replace(AUTO, types=("ngram-simple", "suffix")),
            "suffix": replace(AUTO, types=("suffix",))}
SETS = {   # --set: (settings, default workloads)
    "fixed": ({"none": SpecParams(verify="match"), "fixed n3 m16": NGRAM, "adaptive n3 m16": replace(NGRAM, adaptive=True)},
              tuple(w for w in WORKLOADS if not w.startswith("long-prompt"))),
    "auto": (AUTO_SET, tuple(WORKLOADS)),
    "sessions": ({s: replace(p, suffix=SuffixParams()) for s, p in AUTO_SET.items()}, tuple(SESSIONS)),
}
GREEDY = SamplingParams(temp=0.0)


def geomean(xs: list[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


class FrozenCost(PassCost):
    """t(r) from a fixed table; record() only logs the pass's rows. Its proposals take no time
    (idle_steps 0): a held-back drafter is asked every step, as the replay models it."""

    __slots__ = ("rows",)

    def __init__(self, sums: dict[int, list[float]]) -> None:
        super().__init__({r: list(v) for r, v in sums.items()})
        self.rows: list[int] = []

    def record(self, rows: int, seconds: float) -> None:
        self.rows.append(rows)

    def idle_steps(self, t_propose: float) -> int:
        return 0


CURVE_ROWS = tuple(curve_rows(33))   # the engine's probe's pass sizes (kernels/draftlen.py), up to 33 rows


def measure_curve(e: Engine, rows: tuple[int, ...] = CURVE_ROWS) -> dict[int, list[float]]:
    """{rows: [n, median seconds]} of target passes of each of `rows` rows at a 200-token depth
    (kernels/calibrate's verify-cost rounds, interleaved, 5 reps)."""
    vc = measure_verify_cost(e, e.tokenize("The quick brown fox jumps over the lazy dog. " * 20), rows=rows)
    return {r: [32, t] for r, t in zip(vc.rows, vc.s, strict=True)}


def model_of(w: str) -> str:
    return SESSIONS[w][0] if w in SESSIONS else WORKLOADS[w][0]


def _sums(st) -> Counter:
    return Counter({"passes": st.n_target_passes, "drafted": st.n_drafted, "accepted": st.n_accepted,
                    "n_gen": st.n_gen, "t_gen_s": st.t_gen_s})


def _to_stop(e: Engine, toks: list[int]) -> list[int] | None:
    """toks up to the one whose text completes a stop string; None if their text has none."""
    def stopped(k: int) -> bool:
        return any(x in e.model.detokenize(toks[:k]) for x in STOP)
    return next(toks[:j] for j in range(1, len(toks) + 1) if stopped(j)) if stopped(len(toks)) else None


def run_workload(e: Engine, w: str, spec: SpecParams, n_predict: int,
                 record: list | None = None) -> tuple[list[int], Counter]:
    """A workload's run under spec on engine e (its pass_cost set by the caller): every token of its
    requests in order, and the stats summed over them (passes, drafted, accepted, n_gen, t_gen_s).
    record: if given, gets (prompt tokens, answer tokens) of each request, in order."""
    record = [] if record is None else record
    if w in WORKLOADS:
        prompt = e.tokenize((PROMPTS / WORKLOADS[w][1]).read_text())
        gen = e.generate(prompt, n_predict, GREEDY, spec=spec)
        toks = [t for c in gen for t in c]
        record.append((prompt.tolist(), toks))
        return toks, _sums(gen.stats)
    model, wl = SESSIONS[w]
    kind = MODELS[model]
    stops = Stops.of(STOP) if kind == "completion" else Stops()
    template = template_for(e.model) if kind == "chat" else None
    answers: list[str] = []
    toks: list[int] = []
    sums: Counter = Counter()
    e.reset(drafters=True)                     # a fresh server per session: no KV, no drafter
    with private_stores():                     # ... and a fresh global tree
        for i in range(len(wl.users)):
            _, body = request_body(wl, kind, i, answers, n_predict)
            text = template.render(body["messages"]) if template else body["prompt"]
            prompt = e.tokenize(text)
            gen = e.generate(prompt, n_predict, GREEDY, spec=spec, stops=stops)
            got: list[int] = []
            for chunk in gen:
                got += chunk
                cut = _to_stop(e, got) if kind == "completion" else None
                if cut is not None:            # a pass may emit tokens past the stop: the server cuts them
                    got = cut
                    gen.close()
                    break
            answer = e.model.detokenize(got)   # /completion's text ends before its stop string
            answers.append(min((answer.split(x)[0] for x in STOP), key=len) if kind == "completion" else answer)
            toks += got
            record.append((prompt.tolist(), got))
            sums.update(_sums(gen.stats))
    return toks, sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--set", choices=tuple(SETS), default="fixed", help="the settings compared (see above)")
    ap.add_argument("--workloads", help="comma-separated (default: the set's)")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="default: benchmarks/results/draft_length.json, or draft_length_auto.json")
    ap.add_argument("--curves", help="an earlier run's JSON: its pass-cost curves, not measured again")
    args = ap.parse_args()
    settings, default = SETS[args.set]
    names = [w for w in args.workloads.split(",") if w] if args.workloads else list(default)
    args.out = args.out or str(ROOT / "benchmarks" / "results" / ("draft_length.json" if args.set == "fixed"
                                                                  else f"draft_length_{args.set}.json"))
    bad = [w for w in names if w not in WORKLOADS and w not in SESSIONS]
    if bad:
        sys.exit(f"unknown workload(s) {', '.join(bad)}; known: {', '.join([*WORKLOADS, *SESSIONS])}")
    rows, curves = [], {}
    given = json.loads(Path(args.curves).read_text())["curves_ms"] if args.curves else {}
    for model in dict.fromkeys(model_of(w) for w in names):
        with Engine(str(resolve_model(model)), EngineParams(n_ctx=4096, n_threads=args.threads)) as e:
            curves[model] = ({int(r): [32, ms / 1e3] for r, ms in given[model].items()} if model in given
                             else measure_curve(e))
            print(f"[draft-length] {model} pass cost: " + ", ".join(
                f"{r} rows {v[1] * 1e3:.1f} ms" for r, v in sorted(curves[model].items())), file=sys.stderr)
            for w in (w for w in names if model_of(w) == model):
                got: dict[str, dict] = {s: {"tps": []} for s in settings}
                for _ in range(args.reps):
                    for s, spec in settings.items():
                        cost = FrozenCost(curves[model])
                        e.pass_cost = cost
                        toks, st = run_workload(e, w, spec, args.n_predict)
                        got[s].update(tokens=toks, passes=st["passes"], drafted=st["drafted"],
                                      accepted=st["accepted"], modeled_s=sum(cost.at(r) for r in cost.rows))
                        got[s]["tps"].append(st["n_gen"] / st["t_gen_s"])
                base = got["none"]
                for s, g in got.items():
                    row = {"workload": w, "model": model, "setting": s, "passes": g["passes"],
                           "drafted": g["drafted"], "accepted": g["accepted"],
                           "modeled_x_none": base["modeled_s"] / g["modeled_s"] * len(g["tokens"]) / len(base["tokens"]),
                           "wall_tps": statistics.median(g["tps"]),
                           "wall_x_none": statistics.median(g["tps"]) / statistics.median(base["tps"]),
                           "equal_none": g["tokens"] == base["tokens"]}
                    rows.append(row)
                    print(f"[draft-length] {w} {s}: modeled x{row['modeled_x_none']:.2f}, wall x{row['wall_x_none']:.2f}, "
                          f"{row['passes']} passes, equal to none: {row['equal_none']}", file=sys.stderr)
    commit, dirty = git_state()
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} at commit `{commit}`"
             + (f", with uncommitted changes in {', '.join(dirty)}" if dirty else "")
             + f"; {cpu_model()}, {os.cpu_count()} cores; --set {args.set}, {args.threads} threads, greedy, n_predict "
             f"{args.n_predict}, {args.reps} reps (wall: the median).", "",
             "| workload | setting | passes | drafted | accepted | modeled × none | wall tok/s | wall × none | = none |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['setting']} | {r['passes']} | {r['drafted']} | {r['accepted']} | "
              f"{r['modeled_x_none']:.2f} | {r['wall_tps']:.1f} | {r['wall_x_none']:.2f} | "
              f"{'yes' if r['equal_none'] else '**no**'} |" for r in rows]
    lines += ["", "Geometric mean over the workloads, × none: " + "; ".join(
        f"{s} modeled {geomean([r['modeled_x_none'] for r in rows if r['setting'] == s]):.3f}, "
        f"wall {geomean([r['wall_x_none'] for r in rows if r['setting'] == s]):.3f}" for s in settings if s != "none") + "."]
    md = "\n".join(lines)
    print(md)
    out = Path(args.out)
    out.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d"), "n_predict": args.n_predict, "reps": args.reps,
                               "curves_ms": {m: {r: v[1] * 1e3 for r, v in c.items()} for m, c in curves.items()},
                               "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(md + "\n")


if __name__ == "__main__":
    main()
