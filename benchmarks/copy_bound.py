"""How fast any copy drafter could go on specrun's exact text: a bound with foresight, beside what llama-server's best needs.

    python benchmarks/copy_bound.py [--workloads code-rewrite,...] [-n 128] [--peers FILE.json] [--out FILE.json]
    python benchmarks/copy_bound.py --sessions [-n 96]    # issue 50's sessions, beside results/suffix_alone.json

Issue 12 asks `auto` to match llama-server's best n-gram setting on each workload. The two systems
write different greedy texts where their arithmetic differs (benchmarks/exact_peers.py), and an
n-gram drafter's speed is decided by how much of the text copies earlier text. This asks whether
any drafter that copies from the context could reach llama-server's speed on specrun's own text.

Per workload: specrun's greedy `none` text (exact mode, n tokens), and the model's pass-cost curve
(kernels/calibrate's verify-cost rounds, as draft_length_replay.py). Then, pass by pass, an oracle
that knows the text drafts the longest prefix of the true continuation that follows some earlier
occurrence in the context of the last `n` tokens (any position at all for n = 0), cut to the length
with the most tokens per second for that pass, up to exact mode's 62. No n-gram drafter with that
match length drafts more text that is accepted; any other cut only pays more rows. The columns:
ngram-simple n3 m16 replayed as the engine runs it, the bound at n = 3, 2, 1, 0, and the "needed"
speed-up: llama-server's best of peers.PEER_SETTINGS ÷ specrun's `none`, in tok/s, from a
peers.py or exact_peers.py run (--peers; default: the peers table's run, which has every workload).
A bound under "needed" means no copy drafter reaches llama-server on that text; the modeled
× none leaves out per-pass overheads, so it reads high, never low.

--sessions: suffix_bench's sessions (draft_length.SESSIONS), each request after the last on one
engine. A copy may come from any earlier request's prompt or answer too (suffix's global tree), so
request i's context is every earlier request, then its prompt, then its answer so far. The
n-gram replay sees its own request only, as the engine's ngram-simple. "needed" comes from a
suffix_bench.py run (--peers, default results/suffix_alone.json): llama-server's best ÷ specrun
`none`, with "goal" (issue 50: 1.3 × needed) and that run's `auto` × none beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from specrun.gguf_spec.registry import resolve_model
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams, SpecParams

sys.path.insert(0, str(Path(__file__).resolve().parent))    # run from anywhere: the scripts import each other
from draft_length import GREEDY, PROMPTS, SESSIONS, WORKLOADS, measure_curve, run_workload  # noqa: E402
from draft_length_replay import EXACT_CAP, REPLAY_ROWS, best_cut, frozen, replay  # noqa: E402
from peers import RESULTS, best_peer, cpu_model, git_state, summarize  # noqa: E402

MATCH_N = (3, 2, 1, 0)
GOAL = 1.3           # issue 50: 1.3x llama-server's best on the sessions


def longest_copy(text: list[int], pos: int, match_n: int, cap: int) -> int:
    """The most tokens of text[pos:] (at most cap) that equal the tokens following some j < pos in
    text[:pos] whose preceding match_n tokens equal text[pos - match_n:pos]; the copy may not read
    past pos. Example: text [5, 6, 7, 5, 6, 8], pos 4 (after "5"), match_n 1: j = 1 follows a 5 and
    text[1:3] = [6, 7] vs text[4:6] = [6, 8]: 1 token."""
    best, cap = 0, min(cap, len(text) - pos)
    for j in range(match_n, pos):
        if match_n and text[j - match_n:j] != text[pos - match_n:pos]:
            continue
        m = 0
        while m < cap and j + m < pos and text[j + m] == text[pos + m]:
            m += 1
        best = max(best, m)
    return best


def copy_bound(prompt: list[int], gen: list[int], curve: dict[int, float], match_n: int,
               cap: int = EXACT_CAP, earlier: Sequence[int] = ()) -> dict:
    """Passes of the oracle copy drafter on prompt + gen (gen[0] comes from the prompt's pass), each
    drafting the k <= longest_copy(...) with the most tokens per second for that pass; copies may
    also come from `earlier` (tokens before the prompt: a session's earlier requests). curve:
    {rows: seconds}. Returns {"rows": [rows per pass], "modeled_s": seconds}."""
    cost = frozen(curve)
    text, rows = [*earlier, *prompt, *gen], []
    pos = len(text) - len(gen) + 1
    while pos < len(text):
        k = best_cut(longest_copy(text, pos, match_n, min(cap, len(text) - pos - 1)), cost)
        rows.append(k + 1)
        pos += k + 1
    return {"rows": rows, "modeled_s": sum(cost.at(r) for r in rows)}


def needed(peers_json: Path) -> dict[str, float]:
    """{workload: llama-server's best tok/s ÷ specrun's none tok/s} from a peers.py or exact_peers.py run."""
    rows = summarize(json.loads(peers_json.read_text())["requests"])
    by = {(r["workload"], r["setting"], r["system"]): r for r in rows}
    out = {}
    for w in dict.fromkeys(r["workload"] for r in rows):
        best, mine = best_peer(by, w), by.get((w, "none", "specrun"))
        if best and mine:
            out[w] = best["gen_tps"] / mine["gen_tps"]
    return out


def needed_sessions(bench_json: Path) -> dict[str, dict[str, float]]:
    """{"workload:model": {"needed": llama-server's best ÷ none, "auto": auto × none}} from a
    suffix_bench.py run (session tok/s, medians of the per-rep ratios)."""
    from suffix_bench import summarize as sessions_summary
    rows = sessions_summary(json.loads(bench_json.read_text())["requests"])
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        key = f"{r['workload']}:{r['model']}"
        if r["system"] == "none" and r["x_best"]:
            out.setdefault(key, {})["needed"] = 1 / r["x_best"]
        elif r["system"] == "auto" and r["x_none"]:
            out.setdefault(key, {})["auto"] = r["x_none"]
    return out


def session_row(e: Engine, w: str, curve: dict[int, float], n_predict: int) -> dict:
    """The bounds and the n-gram replay over one session, × none (every request's modeled time summed)."""
    reqs: list[tuple[list[int], list[int]]] = []
    run_workload(e, w, SpecParams(verify="match"), n_predict, record=reqs)
    none_s = sum((len(g) - 1) * curve[1] for _, g in reqs if g)
    ngram_s = sum(replay(p, g, curve, 16, False)["modeled_s"] for p, g in reqs if len(g) > 1)
    row = {"workload": w, "model": SESSIONS[w][0], "requests": len(reqs), "tokens": sum(len(g) for _, g in reqs),
           "ngram-simple n3 m16": none_s / ngram_s}
    for n in MATCH_N:
        earlier, s = [], 0.0
        for p, g in reqs:
            if len(g) > 1:
                s += copy_bound(p, g, curve, n, earlier=earlier)["modeled_s"]
            earlier += [*p, *g]
        row[f"bound n{n}"] = none_s / s
    return row


def save(out: Path, n_predict: int, peers: str, curves: dict[str, dict[int, float]], rows: list[dict], md: str) -> None:
    """The run's JSON (curves in ms, every row) at out, its table next to it (.md)."""
    out.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d"), "n_predict": n_predict, "peers": peers,
                               "curves_ms": {m: {r: s * 1e3 for r, s in c.items()} for m, c in curves.items()},
                               "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="free,code-rewrite,verbatim,json-table,chat-reuse,code-rewrite-smollm2")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="as the peers requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", help="a peers.py or exact_peers.py run, for the needed column (default: results/peers.json); "
                                    "with --sessions a suffix_bench.py run (default: results/suffix_alone.json)")
    ap.add_argument("--out", help="default: results/copy_bound.json, or copy_bound_sessions.json")
    ap.add_argument("--sessions", action="store_true", help="issue 50's sessions (see above)")
    args = ap.parse_args()
    if args.sessions:
        return main_sessions(args)
    args.out = args.out or str(RESULTS / "copy_bound.json")
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}")
    args.peers = args.peers or str(RESULTS / "peers.json")
    need = needed(Path(args.peers)) if Path(args.peers).is_file() else {}
    rows, curves = [], {}
    for model in dict.fromkeys(WORKLOADS[w][0] for w in names):
        with Engine(str(resolve_model(model)), EngineParams(n_ctx=4096, n_threads=args.threads)) as e:
            curve = curves[model] = {r: t for r, (_, t) in measure_curve(e, REPLAY_ROWS).items()}
            for w in (w for w in names if WORKLOADS[w][0] == model):
                prompt = e.tokenize((PROMPTS / WORKLOADS[w][1]).read_text(encoding="utf-8"))
                gen = [t for c in e.generate(prompt, args.n_predict, GREEDY) for t in c]
                prompt = prompt.tolist()
                none_s = (len(gen) - 1) * curve[1]
                row = {"workload": w, "model": model, "prompt_tokens": len(prompt), "tokens": len(gen),
                       "ngram-simple n3 m16": none_s / replay(prompt, gen, curve, 16, False)["modeled_s"]}
                row |= {f"bound n{n}": none_s / copy_bound(prompt, gen, curve, n)["modeled_s"] for n in MATCH_N}
                row["needed"] = need.get(w)
                rows.append(row)
                print(f"[copy_bound] {w}: {row}", file=sys.stderr, flush=True)
    cols = ["ngram-simple n3 m16", *(f"bound n{n}" for n in MATCH_N), "needed"]
    md = [f"Modeled × `none` on specrun's exact greedy text ({args.n_predict} tokens); needed: llama-server's best "
          f"÷ specrun's `none` in tok/s, from {Path(args.peers).name}.\n",
          "| workload | model | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    md += [f"| {r['workload']} | {r['model']} | " + " | ".join("—" if r[c] is None else f"{r[c]:.2f}" for c in cols) + " |"
           for r in rows]
    text = "\n".join(md) + "\n"
    print(text)
    save(Path(args.out), args.n_predict, Path(args.peers).name, curves, rows, text)


def main_sessions(args) -> None:
    peers = Path(args.peers or RESULTS / "suffix_alone.json")
    need = needed_sessions(peers) if peers.is_file() else {}
    rows, curves = [], {}
    for model in dict.fromkeys(m for m, _ in SESSIONS.values()):
        with Engine(str(resolve_model(model)), EngineParams(n_ctx=4096, n_threads=args.threads)) as e:
            curve = curves[model] = {r: t for r, (_, t) in measure_curve(e, REPLAY_ROWS).items()}
            for w in (w for w, (m, _) in SESSIONS.items() if m == model):
                row = session_row(e, w, curve, args.n_predict) | need.get(w, {})
                rows.append(row)
                print(f"[copy_bound] {w}: {row}", file=sys.stderr, flush=True)
    cols = ["ngram-simple n3 m16", *(f"bound n{n}" for n in MATCH_N), "auto", "needed", "goal"]
    for r in rows:
        r["goal"] = GOAL * r["needed"] if r.get("needed") else None
    commit, dirty = git_state()
    md = [f"Measured {time.strftime('%Y-%m-%d %H:%M')} at commit `{commit}`"
          + (f", with uncommitted changes in {', '.join(dirty)}" if dirty else "") + f"; {cpu_model()}, "
          f"{args.threads} threads.\n",
          f"Modeled × `none` on specrun's exact greedy text of each session ({args.n_predict} tokens a request at "
          f"most); a copy may come from any earlier request. auto: measured × none, needed: llama-server's best ÷ "
          f"specrun's `none`, goal: {GOAL} × needed, all three from {peers.name}.\n",
          "| session | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    md += [f"| {r['workload']} | " + " | ".join("—" if r.get(c) is None else f"{r[c]:.2f}" for c in cols) + " |"
           for r in rows]
    under = [r["workload"] for r in rows if r.get("goal") and r["bound n1"] < r["goal"]]
    md += ["", f"Sessions where no copy drafter that matches at least one token reaches the goal (bound n1 < goal): "
           f"{len(under)} of {len(rows)}" + (f" ({', '.join(under)})" if under else "") + "."]
    text = "\n".join(md) + "\n"
    print(text)
    save(Path(args.out or RESULTS / "copy_bound_sessions.json"), args.n_predict, peers.name, curves, rows, text)


if __name__ == "__main__":
    main()
