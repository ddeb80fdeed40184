"""Side-by-side speed of spec types, measured in one process with interleaved repetitions.

    python benchmarks/bench_spec.py [--reps 3] [-n 128] [--threads 2] [--quick] [--out FILE.json]

Setups (greedy, 2 threads, exact mode unless stated):
  * Gemma 3 270M Q4_K_M: none, ngram-simple (default and size-n 3 / size-m 16), draft (the model
    itself: the upper bound of acceptance at the cost of a second full model), on an
    input-grounded prompt (rewrite a code file) and a free prompt; plus llama-cpp-python's
    high-level `Llama` and `Llama` + `LlamaPromptLookupDecoding` on the same prompts.
  * Tiny qwen35 + MTP models of realistic shape (24 trunk layers, n_embd 512, n_ff 2048; f16
    exact head, f16 noisy head sigma 0.1, q8_0 exact head): none vs draft-mtp at n-max 1, 3, 5.
Reports generation tokens/s (median over reps), the ratio to `none` of the same setup and prompt,
acceptance rate, mean accepted length, tokens per target pass, and whether the tokens equal
`none`'s. Prints a markdown table; writes all numbers as JSON and the table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = (ROOT / "kernels" / "sampling.py").read_text()[:1800]
PROMPTS = {
    "code-rewrite": "Here is a Python module. Rewrite it exactly, keeping every line.\n\n```python\n" + CODE
                    + "\n```\n\nRewritten:\n\n```python\n",
    "free": "Once upon a time, in a small village at the edge of a great forest, there lived",
}
MTP_PROMPTS = {"free": "Hello world, this is a test of speculative decoding with the MTP head of a model"}


@dataclass
class Row:
    setup: str
    prompt: str
    name: str
    tps: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    acc_rate: float | None = None
    mean_acc_len: float | None = None
    tokens_per_pass: float | None = None
    equal_to_none: bool | None = None
    tokens: list[int] | None = None
    text: str | None = None           # llama-cpp-python peers: compared with the peer's own plain text


def specrun_runner(path: str, types: tuple, n_max: int, threads: int, n_predict: int, exact: bool = True,
                   draft: str | None = None, **spec_kw):
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams, SpecParams
    from specrun.kernels.types import SamplingParams

    spec = SpecParams(types=types, n_max=n_max, **spec_kw)
    engine = Engine(path, EngineParams(n_ctx=4096, n_threads=threads, exact=exact, spec=spec, draft_model=draft))

    def go(prompt_text: str, row: Row) -> None:
        toks = engine.tokenize(prompt_text)
        engine.reset()
        t0 = time.perf_counter()
        gen = engine.generate(toks, n_predict, SamplingParams(temp=0.0))
        out = [t for chunk in gen for t in chunk]
        total = time.perf_counter() - t0
        st = gen.stats
        row.tps.append(st.gen_tps)
        row.total_s.append(total)
        row.tokens = out
        if st.drafters:
            row.acc_rate = st.acceptance_rate
            row.mean_acc_len = st.drafters[0].mean_acc_len if len(st.drafters) == 1 else None
        row.tokens_per_pass = st.tokens_per_pass

    return go, engine.close


_PEER = r"""
import json, sys, time
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
path, threads, n, lookup, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1", sys.stdin.read()
llm = Llama(path, n_ctx=4096, n_batch=4096, n_threads=threads, n_threads_batch=threads, verbose=False,
            draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None)
t0 = time.perf_counter()
r = llm.create_completion(prompt, max_tokens=n, temperature=0.0, top_k=1)
dt = time.perf_counter() - t0
toks = llm.tokenize(r["choices"][0]["text"].encode(), add_bos=False, special=True)
print(json.dumps({"total_s": dt, "n": r["usage"]["completion_tokens"], "tokens": toks, "text": r["choices"][0]["text"]}))
"""


def subprocess_runner(kind: str, path: str, threads: int, n_predict: int, extra: tuple = ()):
    """Runs in a fresh process each time (its own llama.cpp settings): llama-cpp-python's high-level
    Llama (kind 'llama' / 'llama-lookup') or the specrun CLI with --json (kind 'specrun')."""
    import subprocess

    def go(prompt_text: str, row: Row) -> None:
        if kind.startswith("llama"):
            cmd = [sys.executable, "-c", _PEER, path, str(threads), str(n_predict), "1" if kind == "llama-lookup" else "0"]
        else:
            cmd = [sys.executable, "-m", "specrun.cli.main", "-m", path, "-t", str(threads), "-n", str(n_predict),
                   "--temp", "0", "--json", "-f", "-", *extra]
        r = subprocess.run(cmd, input=prompt_text, capture_output=True, text=True, timeout=600, check=True)
        d = json.loads(r.stdout)
        if kind.startswith("llama"):
            row.total_s.append(d["total_s"])
            row.tps.append(d["n"] / d["total_s"])
            row.tokens = d["tokens"]
            row.text = d["text"]
        else:
            st = d["stats"]
            total = st["t_prompt_s"] + st["t_gen_s"]
            row.total_s.append(total)
            row.tps.append(st["n_gen"] / total)
            row.tokens = d["tokens"]
            row.acc_rate = st["acceptance_rate"] if st["drafters"] else None
            row.tokens_per_pass = st["tokens_per_pass"]

    return go, lambda: None


def interleave(runners: dict, prompts: dict, rows: dict, reps: int, label: str) -> None:
    for rep in range(reps):
        for pname, ptext in prompts.items():
            for name, (go, _) in runners.items():
                print(f"[{label}] rep {rep + 1}/{reps} {pname} {name}", file=sys.stderr, flush=True)
                go(ptext, rows[(pname, name)])


def finish(rows: dict, setup: str, baseline: str = "none") -> list[dict]:
    out = []
    for (pname, name), r in rows.items():
        base = rows.get((pname, baseline))
        tps = statistics.median(r.tps)
        d = {"setup": setup, "prompt": pname, "setting": name, "gen_tps": round(tps, 2),
             "gen_tps_min": round(min(r.tps), 2), "gen_tps_max": round(max(r.tps), 2),
             "total_s": round(statistics.median(r.total_s), 3),
             "ratio_to_none": round(tps / statistics.median(base.tps), 3) if base else None,
             "acceptance_rate": None if r.acc_rate is None else round(r.acc_rate, 4),
             "mean_acc_len": None if r.mean_acc_len is None else round(r.mean_acc_len, 3),
             "tokens_per_pass": None if r.tokens_per_pass is None else round(r.tokens_per_pass, 3),
             "equal_to_none": (r.tokens == base.tokens) if base and base.tokens is not None else None}
        out.append(d)
    return out


def bench_gemma(args) -> list[dict]:
    from specrun.gguf_spec.registry import resolve_model

    path = str(resolve_model("gemma-3-270m"))
    t, n = args.threads, args.n_predict
    runners = {
        "none": specrun_runner(path, (), 3, t, n),
        "ngram-simple": specrun_runner(path, ("ngram-simple",), 16, t, n),
        "ngram-simple n3 m16": specrun_runner(path, ("ngram-simple",), 16, t, n, ngram_size_n=3, ngram_size_m=16),
    }
    if not args.quick:
        runners["draft (self) n-max 3"] = specrun_runner(path, ("draft-simple",), 3, t, n, draft=path)
    rows = {(p, k): Row("gemma-3-270m Q4_K_M", p, k) for p in PROMPTS for k in runners}
    try:
        interleave(runners, PROMPTS, rows, args.reps, "gemma")
    finally:
        for _, close in runners.values():
            close()
    return finish(rows, "gemma-3-270m Q4_K_M")


def bench_peers(args) -> list[dict]:
    """Whole-request time (prompt + generation), each run in a fresh process, interleaved:
    specrun (exact and --no-exact) against llama-cpp-python's high-level Llama."""
    from specrun.gguf_spec.registry import resolve_model

    path = str(resolve_model("gemma-3-270m"))
    t, n = args.threads, args.n_predict
    runners = {
        "none": subprocess_runner("specrun", path, t, n),
        "none --no-exact": subprocess_runner("specrun", path, t, n, ("--no-exact",)),
        "ngram-simple": subprocess_runner("specrun", path, t, n, ("--spec-type", "ngram-simple",
                                                                  "--spec-draft-n-max", "16")),
        "llama-cpp-python Llama": subprocess_runner("llama", path, t, n),
        "llama-cpp-python Llama + PromptLookup": subprocess_runner("llama-lookup", path, t, n),
    }
    rows = {(p, k): Row("gemma-3-270m, per process", p, k) for p in PROMPTS for k in runners}
    interleave(runners, PROMPTS, rows, args.reps, "peers")
    out = finish(rows, "gemma-3-270m Q4_K_M, whole request, fresh process")
    for r in out:   # a peer's output is compared with the same peer's plain decoding (text)
        if r["setting"].startswith("llama-cpp-python"):
            r["equal_to_none"] = (rows[(r["prompt"], r["setting"])].text
                                  == rows[(r["prompt"], "llama-cpp-python Llama")].text)
    return out


def bench_mtp(args) -> list[dict]:
    from specrun.gguf_spec.testmodel import Head, SynthConfig
    from specrun.kernels.testmodel import build_test_model

    results = []
    variants = [("exact", "f16"), ("noisy:0.1", "f16"), ("exact", "q8_0")]
    if args.quick:
        variants = variants[:1]
    with tempfile.TemporaryDirectory() as d:
        for head, quant in variants:
            path = str(Path(d) / f"mtp-{head.replace(':', '')}-{quant}.gguf")
            build_test_model(path, SynthConfig(head=Head.parse(head), trunk_layers=24, n_embd=512, n_ff=2048), quant)
            setup = f"qwen35 24L/512/2048 {quant} head={head}"
            t, n = args.threads, args.n_predict
            runners = {"none": specrun_runner(path, (), 3, t, n)}
            for k in (1, 3, 5):
                runners[f"draft-mtp n-max {k}"] = specrun_runner(path, ("draft-mtp",), k, t, n)
            rows = {(p, k): Row(setup, p, k) for p in MTP_PROMPTS for k in runners}
            try:
                interleave(runners, MTP_PROMPTS, rows, args.reps, setup)
            finally:
                for _, close in runners.values():
                    close()
            results += finish(rows, setup)
    return results


def bench_sampling(args) -> list[dict]:
    """Temperature > 0: sample-and-match vs speculative (rejection) sampling, same seeds and drafts;
    and adaptive vs fixed draft length. Mean accepted length is the number to compare."""
    from specrun.gguf_spec.registry import resolve_model
    from specrun.gguf_spec.testmodel import Head, SynthConfig
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams, SpecParams
    from specrun.kernels.testmodel import build_test_model
    from specrun.kernels.types import SamplingParams

    results = []
    seeds = list(range(1, args.reps + 1))
    with tempfile.TemporaryDirectory() as d:
        setups = []
        for head in ("noisy:0.1", "noisy:0.3"):
            path = str(Path(d) / f"mtp-{head.replace(':', '')}.gguf")
            build_test_model(path, SynthConfig(head=Head.parse(head), trunk_layers=24, n_embd=512, n_ff=2048), "q8_0")
            setups.append((f"qwen35 24L q8_0 head={head}", path, ("draft-mtp",), None, MTP_PROMPTS["free"]))
        if not args.quick:
            g = str(resolve_model("gemma-3-270m"))
            setups.append(("gemma-3-270m, draft = itself", g, ("draft-simple",), g, PROMPTS["free"]))
        for setup, path, types, draft, prompt in setups:
            engine = Engine(path, EngineParams(n_ctx=4096, n_threads=args.threads,
                                               spec=SpecParams(types=types, n_max=3), draft_model=draft))
            toks = engine.tokenize(prompt)
            settings = [(f"{v} n-max 3", SpecParams(types=types, n_max=3, verify=v)) for v in ("match", "rejection")]
            settings += [(f"{v} n-max 8 adaptive", SpecParams(types=types, n_max=8, verify=v, adaptive=True))
                         for v in ("match", "rejection")]
            settings += [("rejection n-max 8 fixed", SpecParams(types=types, n_max=8, verify="rejection"))]
            settings += [("none", SpecParams())]
            for temp in (0.8, 1.0):
                acc: dict[str, list] = {name: [] for name, _ in settings}
                for seed in seeds:            # interleaved: every setting sees each seed in turn
                    for name, sp in settings:
                        gen = engine.generate(toks, args.n_predict, SamplingParams(temp=temp, seed=seed), spec=sp)
                        for _ in gen:
                            pass
                        st = gen.stats
                        acc[name].append((st.gen_tps, st.drafters[0].mean_acc_len if st.drafters else None,
                                          st.acceptance_rate, st.tokens_per_pass))
                none_tps = statistics.median(x[0] for x in acc["none"])
                for name, vals in acc.items():
                    tps = statistics.median(x[0] for x in vals)
                    mal = [x[1] for x in vals if x[1] is not None]
                    results.append({"setup": setup, "prompt": f"temp {temp}", "setting": name,
                                    "gen_tps": round(tps, 2), "ratio_to_none": round(tps / none_tps, 3),
                                    "acceptance_rate": round(statistics.mean(x[2] for x in vals), 4),
                                    "mean_acc_len": round(statistics.mean(mal), 3) if mal else None,
                                    "tokens_per_pass": round(statistics.mean(x[3] for x in vals), 3),
                                    "equal_to_none": None})
            engine.close()
    return results


def table(results: list[dict]) -> str:
    cols = ["setup", "prompt", "setting", "gen_tps", "ratio_to_none", "acceptance_rate", "mean_acc_len",
            "tokens_per_pass", "equal_to_none"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join("" if r[c] is None else str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="fewer settings (a smoke run)")
    ap.add_argument("--only", choices=["gemma", "mtp", "peers", "sampling"], default=None)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_spec.json"))
    args = ap.parse_args()
    sections = {"gemma": bench_gemma, "mtp": bench_mtp, "sampling": bench_sampling, "peers": bench_peers}
    if args.quick:
        sections.pop("peers")
    results: list[dict] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name, fn in sections.items():
        if args.only not in (None, name):
            continue
        part = fn(args)
        results += part
        print(table(part) + "\n", flush=True)                       # each section as it finishes
        out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
        out.with_suffix(".md").write_text(table(results) + "\n")


if __name__ == "__main__":
    main()
