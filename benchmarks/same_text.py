"""specrun's speculative settings on llama-server's own texts: how much of a peers gap is the text.

    python benchmarks/same_text.py [--peers benchmarks/results/peers.json] [--workloads code-rewrite,...]
        [--reps 3] [--out FILE.json]

Exact mode makes specrun's greedy text its own (a Q8_0 K / F16 V cache, no repacked kernels), and
on every peers workload it differs from llama-server's somewhere. An n-gram drafter's speed-up is
decided by how much of the text copies earlier text, so the peers table compares two systems on two
texts. Here specrun runs each setting in one process twice per workload:

  * own:   as it generates (its exact text, equal to its `none`);
  * llama-server's: the text llama-server wrote for that setting in the peers run (its JSON, the
    first rep; retokenized with the same vocabulary), forced: a stand-in for the engine's logit
    controls (kernels.constrain.Constraints) keeps only the forced token in every target row, so the
    target passes are real, of the rows the drafts ask for, and a draft is accepted exactly as far
    as it copies that text. Nothing cuts a draft before its verify pass, unlike a grammar.

Settings: none, ngram-simple (llama.cpp's defaults), ngram-simple n3 m16 with its fixed length, and
the same with --spec-draft-adaptive (what `--spec-type auto` runs in `specrun serve` on these models).
Two speeds against `none` on the same text, as in draft_length.py: modeled (every pass priced by
one frozen pass-cost curve per model) and wall (generation tok/s, median of --reps, interleaved).
llama-server's own × none (its timings in the peers run, each setting on its own text) stands next
to them. Forcing specrun's own `none` text reproduces its own runs pass for pass (checked each
workload: `forced own = own`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
from draft_length import GREEDY, FrozenCost, measure_curve
from peers import summarize

from specrun.gguf_spec.registry import resolve_model
from specrun.kernels import engine as engine_mod
from specrun.kernels.constrain import VerifyPass
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.types import Draft, common_prefix

ROOT = Path(__file__).resolve().parents[1]
NGRAM = SpecParams(types=("ngram-simple",), verify="match")
N3M16 = replace(NGRAM, ngram_size_n=3, ngram_size_m=16)
SETTINGS = {   # specrun's setting -> the peers run's setting whose llama-server text it is forced to
    "none": (SpecParams(verify="match"), "none"),
    "ngram-simple": (NGRAM, "ngram-simple"),
    "ngram-simple n3 m16": (N3M16, "ngram-simple n3 m16"),
    "adaptive n3 m16 (auto)": (replace(N3M16, adaptive=True), "ngram-simple n3 m16"),
}


class ForcedText:
    """The engine's logit controls for one generation, standing in for kernels.constrain.Constraints:
    every row keeps only the token of `tokens` at its position (int32 [n], the text after the
    prompt; past its end, the end token). Rows are views of one preallocated float32 [65, n_vocab]
    buffer of -inf, one per row of a pass (a verify pass has at most 64 rows in exact mode)."""

    grammar = None

    def __init__(self, tokens: np.ndarray, n_vocab: int, end: int) -> None:
        self.tokens, self.end, self.n = tokens, end, 0
        self.buf = np.full((65, n_vocab), -np.inf, dtype=np.float32)
        self.hot = np.zeros(65, dtype=np.int64)

    def row(self, logits: np.ndarray, prefix: np.ndarray | None = None, grammar=None) -> np.ndarray:
        i = 0 if prefix is None else len(prefix)
        j = self.n + i
        tok = int(self.tokens[j]) if j < len(self.tokens) else self.end
        self.buf[i, self.hot[i]] = -np.inf
        self.buf[i, tok] = 0.0
        self.hot[i] = tok
        return self.buf[i]

    def verify_pass(self, draft: Draft) -> VerifyPass:
        return VerifyPass(self, draft, [None] * (len(draft) + 1), [])

    def accept(self, tokens) -> None:
        self.n += len(tokens)

    def close(self) -> None:
        pass


@contextmanager
def forced(tokens: np.ndarray | None, n_vocab: int, end: int):
    """Inside: every generation of the engine module emits `tokens` (None: the model's own text)."""
    if tokens is None:
        yield
        return
    real = engine_mod.Constraints

    class Forcing:
        @staticmethod
        def of(model, sampling, n_ctx, prompt):
            return ForcedText(tokens, n_vocab, end)

    engine_mod.Constraints = Forcing
    try:
        yield
    finally:
        engine_mod.Constraints = real


def continuation(e: Engine, prompt_text: str, text: str) -> np.ndarray:
    """int32 [n]: `text` as tokens after the prompt's (the whole string retokenized, so a token that
    spans the boundary is not split; the text alone when the prompt's tokens change)."""
    p = e.tokenize(prompt_text)
    full = e.tokenize(prompt_text + text)
    if len(full) > len(p) and np.array_equal(full[:len(p)], p):
        return full[len(p):]
    return e.tokenize(text, add_special=False)


def run_setting(e: Engine, prompt: np.ndarray, spec: SpecParams, n: int, cost: dict, tokens: np.ndarray | None) -> dict:
    fc = FrozenCost(cost)
    e.pass_cost = fc
    with forced(tokens, e.model.n_vocab, e.model.eos):
        gen = e.generate(prompt, n, GREEDY, spec=spec)
        toks = [t for c in gen for t in c]
    st = gen.stats
    return {"tokens": toks, "passes": st.n_target_passes, "rows": list(fc.rows), "drafted": st.n_drafted,
            "accepted": st.n_accepted, "modeled_s": sum(fc.at(r) for r in fc.rows), "tps": st.n_gen / st.t_gen_s}


def peers_x_none(requests: list[dict], workload: str) -> dict[str, float]:
    """llama-server's × none per setting in the peers run, as its table reads it (peers.summarize)."""
    return {r["setting"]: r["x_none"] for r in summarize(requests)
            if r["system"] == "llama-server" and r["workload"] == workload and r["x_none"] is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--peers", default=str(ROOT / "benchmarks" / "results" / "peers.json"))
    ap.add_argument("--workloads", default="free,code-rewrite,verbatim,json-table,summary,chat-reuse,code-rewrite-smollm2")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "same_text.json"))
    args = ap.parse_args()
    data = json.loads(Path(args.peers).read_text())
    known = data["meta"]["workloads"]
    names = [w for w in args.workloads.split(",") if w]
    bad = [w for w in names if w not in known or known[w]["model"].startswith("synthetic:")]
    if bad:
        sys.exit(f"workload(s) {', '.join(bad)} not in {args.peers} (or synthetic); "
                 f"known: {', '.join(w for w, v in known.items() if not v['model'].startswith('synthetic:'))}")
    theirs = {}
    for r in sorted(data["requests"], key=lambda r: r["rep"]):
        if r["system"] == "llama-server" and r.get("text") is not None:
            theirs.setdefault((r["workload"], r["setting"]), r["text"])
    rows, curves = [], {}
    n_predict = data["meta"]["n_predict"]
    for model in dict.fromkeys(known[w]["model"] for w in names):
        with Engine(str(resolve_model(model)), EngineParams(n_ctx=4096, n_threads=args.threads)) as e:
            curves[model] = measure_curve(e)
            for w in (w for w in names if known[w]["model"] == model):
                rows += measure_workload(e, w, (ROOT / known[w]["file"]).read_text(), theirs, data["requests"],
                                         curves[model], n_predict, args.reps)
    md = markdown(rows)
    print(md)
    out = Path(args.out)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    out.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d"), "commit": commit.strip(), "peers": rel(args.peers),
                               "peers_commit": data["meta"].get("commit"), "reps": args.reps,
                               "curves_ms": {m: {r: v[1] * 1e3 for r, v in c.items()} for m, c in curves.items()},
                               "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(md + "\n")


def measure_workload(e: Engine, w: str, prompt_text: str, theirs: dict, requests: list[dict], cost: dict,
                     n_predict: int, reps: int) -> list[dict]:
    """The table's rows of one workload: every setting on its own text and on llama-server's."""
    prompt = e.tokenize(prompt_text)
    forced_toks = {peer: continuation(e, prompt_text, theirs[(w, peer)])
                   for peer in dict.fromkeys(p for _, p in SETTINGS.values()) if (w, peer) in theirs}
    got: dict[tuple[str, str], dict] = {}

    def run(key: tuple[str, str], spec: SpecParams, toks: np.ndarray | None) -> None:
        r = run_setting(e, prompt, spec, n_predict if toks is None else len(toks), cost, toks)
        if toks is not None and r["tokens"] != toks.tolist():
            sys.exit(f"{w} {key}: forcing llama-server's text failed after "
                     f"{common_prefix(r['tokens'], toks.tolist())} of {len(toks)} tokens")
        got.setdefault(key, r | {"tps": []})["tps"].append(r["tps"])

    for _ in range(reps):
        for peer, toks in forced_toks.items():          # `none` on each of llama-server's texts
            run(("none", peer), SETTINGS["none"][0], toks)
        for s, (spec, peer) in SETTINGS.items():
            run((s, "own"), spec, None)
            if peer in forced_toks and s != "none":
                run((s, peer), spec, forced_toks[peer])
    own_none = np.asarray(got[("none", "own")]["tokens"], dtype=np.int32)
    check = run_setting(e, prompt, SETTINGS["adaptive n3 m16 (auto)"][0], len(own_none), cost, own_none)
    same = check["rows"] == got[("adaptive n3 m16 (auto)", "own")]["rows"]
    x_peer = peers_x_none(requests, w)
    rows = []
    for s, (_spec, peer) in SETTINGS.items():
        own, base = got[(s, "own")], got[("none", "own")]
        row = {"workload": w, "setting": s, "peer_setting": peer, "llama_server_x_none": x_peer.get(peer),
               "own": ratios(own, base), "own_equal_none": own["tokens"] == base["tokens"],
               "forced_own_reproduces": same}
        if peer in forced_toks:
            row["theirs"] = ratios(got[(s, peer)], got[("none", peer)])
            row["theirs_tokens"] = len(forced_toks[peer])
        rows.append(row)
        print(f"[same-text] {w} {s}: own modeled x{row['own']['modeled']:.2f}, on llama-server's text "
              f"x{row.get('theirs', {}).get('modeled', float('nan')):.2f} (llama-server x"
              f"{row['llama_server_x_none'] or float('nan'):.2f})", file=sys.stderr)
    return rows


def rel(path: str) -> str:
    """path relative to the repository when it is inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)


def ratios(g: dict, base: dict) -> dict:
    """A setting's run over `none`'s run on the same text: modeled and wall (median) × none, passes."""
    per_tok = len(g["tokens"]) / len(base["tokens"])
    return {"modeled": base["modeled_s"] / g["modeled_s"] * per_tok,
            "wall": statistics.median(g["tps"]) / statistics.median(base["tps"]),
            "passes": g["passes"], "drafted": g["drafted"], "accepted": g["accepted"]}


def markdown(rows: list[dict]) -> str:
    def f(x):
        return "—" if x is None else f"{x:.2f}"
    lines = ["| workload | setting | llama-server × none (its text) | specrun on llama-server's text: "
             "× none modeled / wall (passes) | specrun on its own text: × none modeled / wall (passes) |",
             "|---|---|---|---|---|"]
    for r in rows:
        t = r.get("theirs")
        th = "—" if t is None else f"{f(t['modeled'])} / {f(t['wall'])} ({t['passes']})"
        o = r["own"]
        lines.append(f"| {r['workload']} | {r['setting']} | {f(r['llama_server_x_none'])} | {th} | "
                     f"{f(o['modeled'])} / {f(o['wall'])} ({o['passes']}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
