"""The adaptive n-gram draft length replayed offline on 40 model texts, against a cut with foresight.

    python benchmarks/draft_length_replay.py [--sizes 16,32,48] [-n 200] [--out FILE.json]

benchmarks/draft_length.py runs the policy live on 7 of the peers workloads, and one decision on one text
moves a workload's speed by 10 %. A change to kernels/draftlen.py needs more texts than that, and
quickly: here each text is generated once (greedy, exact mode, `none`; cached under
build/draft_length_replay/), and the engine's n-gram loop is replayed on it without the model. A
pass's rows are priced by the model's pass-cost curve, measured once per run at every size from 1 to
49 rows (the verify-cost rounds of kernels/calibrate, at a 200-token depth) and frozen; the adaptive
length reads it where the engine would have timed it (draftlen.curve_rows, linear between), so a
step between those sizes costs it what it costs the engine. tests/test_draft_length_replay.py checks
that the replay makes the engine's own passes.

The texts: the peers workloads' prompts (benchmarks/prompts/) and 31 more built from this Python's
standard library sources and docstrings: verbatim copies, code rewrites, free text, JSON to table, a
log excerpt (Gemma 3 270M, a base model); summaries that quote, corrected repeats, code with type
hints, free chat (SmolLM2-135M-Instruct, with its chat template).

Per text, modeled × none of: ngram-simple n3 m16 as fixed (llama-server's usual setting), the adaptive
length (--spec-draft-adaptive) at size-m 16 and each --sizes, and "foresight": each pass drafts the
length that pays most for that pass given how far the copy will really be accepted. It knows the
text, so no policy reaches it on the whole; it is greedy pass by pass, so it is not a strict bound
either (a longer size-m can read lower). Prints a markdown table and the geometric means.
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np

from specrun.gguf_spec.registry import resolve_model
from specrun.kernels.drafters.ngram_simple import NgramSimple
from specrun.kernels.draftlen import DraftLength, curve_rows
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams
from specrun.kernels.types import common_prefix

sys.path.insert(0, str(Path(__file__).resolve().parent))    # run from anywhere: the scripts import each other
from draft_length import GREEDY, PROMPTS, WORKLOADS, FrozenCost, measure_curve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "draft_length_replay" / "texts.json"
GEMMA, SMOLLM2 = "gemma-3-270m", "smollm2-135m-instruct"
PEERS = {**WORKLOADS, "long-prompt": (GEMMA, "long_prompt.txt"), "long-prompt-smollm2": (SMOLLM2, "long_prompt.txt")}
REPLAY_ROWS = tuple(range(1, 50))   # every pass size up to size-m 48's: the passes are priced by these
EXACT_CAP = 62     # the engine's longest draft in exact mode (kernels/engine.py n_max_cap)


def corpus() -> dict[str, tuple[str, str]]:
    """{name: (model, prompt text)}: the peers prompts and texts built from the standard library."""
    import colorsys
    import fnmatch
    import genericpath
    import glob
    import heapq
    import shlex
    import string
    import textwrap

    def lines(mod, a: int, b: int) -> str:
        return "".join(Path(mod.__file__).read_text().splitlines(keepends=True)[a:b])

    def chat(user: str, system: str = "") -> str:
        head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
        return head + f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"

    out = {w: (m, (PROMPTS / f).read_text()) for w, (m, f) in PEERS.items()}
    for i, (mod, a, b) in enumerate([(colorsys, 0, 60), (fnmatch, 0, 55), (genericpath, 0, 60), (glob, 0, 50)]):
        out[f"verbatim-{i}"] = (GEMMA, "Repeat the following Python module exactly, line for line.\n\n"
                                       f"{lines(mod, a, b)}\n\nRepeated exactly:\n\n")
    for i, f in enumerate([colorsys.rgb_to_hls, colorsys.rgb_to_hsv, textwrap.dedent, fnmatch.translate, heapq.nsmallest]):
        out[f"rewrite-{i}"] = (GEMMA, "Here is a Python function, then the same function rewritten with type hints "
                                      f"and a docstring.\n\n{inspect.getsource(f)}\nRewritten:\n\n")
    for i, p in enumerate(["The old lighthouse keeper had not seen a ship in eleven years, until",
                           "In the spring of 1887, a young engineer named",
                           "Chapter One\n\nThe rain had been falling for three days when",
                           "There are three things every new gardener should know about tomatoes."]):
        out[f"free-{i}"] = (GEMMA, p)
    rnd, names = random.Random(1), ["Alice", "Bruno", "Chen", "Dana", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jia"]
    for i, cols in enumerate([("name", "city", "age"), ("product", "price", "stock", "sku"), ("id", "title", "status")]):
        recs = [{c: names[j] if c in ("name", "title", "product") else f"{c}-{rnd.randint(100, 999)}"
                 if c in ("city", "sku", "status") else rnd.randint(1, 99) for c in cols} for j in range(10)]
        out[f"table-{i}"] = (GEMMA, "Convert this JSON list to a Markdown table with one row per record.\n\n"
                                    f"{json.dumps(recs, indent=1)}\n\nMarkdown table:\n\n")
    log = (PROMPTS / "long_prompt.txt").read_text().rsplit("\n\n", 1)[0][:6000]
    out["log-errors"] = (GEMMA, f"{log}\n\nList every line above that contains ERROR, copied exactly:\n\n")
    docs = [inspect.getdoc(json), inspect.getdoc(shlex.shlex), inspect.getdoc(glob.glob), inspect.getdoc(string.Formatter.vformat)]
    for i, d in enumerate(docs):
        out[f"summary-{i}"] = (SMOLLM2, chat(f"Summarize the following text in three sentences, quoting it word for word.\n\n{d}",
                                             "You summarize documents faithfully and quote them word for word."))
    for i, p in enumerate([
            "Our team moved the weekly meeting from Monday to Tuesday because too many people were travelling on "
            "Mondays, and we will keep the same time, ten in the morning.",
            "The new printer on the third floor is for colour documents only; please use the old one near the "
            "kitchen for everything else, and report paper jams to the front desk.",
            "I studied biology at the university of Leeds and worked for two years in a hospital laboratory, where "
            "I ran blood tests and kept the equipment calibrated."]):
        out[f"reuse-{i}"] = (SMOLLM2, chat(f'Here is a paragraph:\n\n"{p}"\n\nPlease repeat it with any grammar mistakes '
                                           "corrected, then list each of its sentences on its own line."))
    for i, f in enumerate([textwrap.indent, colorsys.hls_to_rgb, fnmatch.filter, heapq.merge]):
        out[f"hints-{i}"] = (SMOLLM2, chat("Add type hints and a docstring to this Python function, and show the whole "
                                           f"function.\n\n{inspect.getsource(f)}"))
    out["copy-chat"] = (SMOLLM2, chat(f"Copy this code exactly, without changes:\n\n{lines(colorsys, 60, 110)}"))
    out["free-chat"] = (SMOLLM2, chat("Write a short story about a cat who learns to play the piano."))
    out["free-chat-2"] = (SMOLLM2, chat("Explain how a bicycle gear works, in two paragraphs."))
    return out


def _key(model: str, text: str, n: int) -> str:
    return f"{model}|{n}|{hashlib.sha1(text.encode()).hexdigest()[:16]}"


def frozen(curve: dict[int, float]) -> FrozenCost:
    """A pass-cost model that prices r rows at curve[r] seconds (as if each from 32 samples)."""
    return FrozenCost({r: [32, t] for r, t in curve.items()})


def replay(prompt: list[int], gen: list[int], curve: dict[int, float], size_m: int, adaptive: bool,
           size_n: int = 3, truth: dict[int, float] | None = None) -> dict:
    """The engine's loop (kernels/engine.py Engine._run) for one ngram-simple drafter, greedy, on a
    known text: prompt, then gen (the model's own tokens; gen[0] comes from the prompt's pass).
    curve: {rows: seconds}, frozen: what the policy reads (the engine's: measured at
    draftlen.curve_rows, linear between); truth: what the passes cost (default: curve). Returns the
    passes' rows and their modeled seconds."""
    cost = frozen(curve)
    d = NgramSimple(size_n, size_m)
    d.begin(np.asarray(prompt, dtype=np.int32))
    dl = DraftLength(min(size_m, EXACT_CAP), adaptive, 0 if adaptive else 1)
    dl.start(cost)
    text, ctx, rows = prompt + gen, prompt + gen[:1], []
    while len(ctx) < len(text):
        k_cap = len(text) - len(ctx) - 1
        cap = min(k_cap, dl.cap if dl.free else dl.n)
        draft = d.propose(np.asarray(ctx, dtype=np.int32), cap).tokens if cap > 0 else np.zeros(0, np.int32)
        if dl.free and cap > 0:
            draft = dl.take(draft, len(ctx), cap, cost)
        pos = len(ctx)
        n_ok = common_prefix(text[pos:pos + len(draft)], draft.tolist())
        rows.append(len(draft) + 1)
        if len(draft):
            dl.record(len(draft), n_ok, cost)
        ctx += text[pos:pos + n_ok + 1]
        dl.score(ctx, cost)
    priced = cost if truth is None else frozen(truth)
    return {"rows": rows, "modeled_s": sum(priced.at(r) for r in rows)}


def read_at(curve: dict[int, float], size_m: int) -> dict[int, float]:
    """The points of a measured curve that the engine times for a size-m cap (draftlen.curve_rows)."""
    return {r: curve[r] for r in curve_rows(min(size_m, EXACT_CAP) + 1)}


def best_cut(n_ok: int, cost: FrozenCost) -> int:
    """The draft length k <= n_ok (tokens of it the text accepts) whose pass of k + 1 rows makes the
    most tokens per second: foresight's cut."""
    return max(range(n_ok + 1), key=lambda k: (k + 1) / cost.at(k + 1))


def foresight(prompt: list[int], gen: list[int], curve: dict[int, float], size_m: int, size_n: int = 3) -> float:
    """Modeled seconds when each pass drafts, of the ngram-simple proposal, the k <= (tokens of it the
    text accepts) with the most tokens per second for that pass."""
    cost = frozen(curve)
    d = NgramSimple(size_n, size_m)
    d.begin(np.asarray(prompt, dtype=np.int32))
    text, ctx, t = prompt + gen, prompt + gen[:1], 0.0
    while len(ctx) < len(text):
        cap = min(len(text) - len(ctx) - 1, size_m, EXACT_CAP)
        draft = d.propose(np.asarray(ctx, dtype=np.int32), cap).tokens if cap > 0 else []
        pos = len(ctx)
        n_ok = common_prefix(text[pos:pos + len(draft)], list(draft))
        k = best_cut(n_ok, cost)
        t += cost.at(k + 1)
        ctx += text[pos:pos + k + 1]
    return t


def texts(names: dict[str, tuple[str, str]], n: int, threads: int) -> tuple[dict, dict]:
    """({name: {model, prompt, gen}}, {model: curve}): cached greedy `none` texts, and each model's
    pass-cost curve measured now."""
    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    got, curves = {}, {}
    for model in dict.fromkeys(m for m, _ in names.values()):
        with Engine(str(resolve_model(model)), EngineParams(n_ctx=4096, n_threads=threads)) as e:
            curves[model] = {r: t for r, (_, t) in measure_curve(e, REPLAY_ROWS).items()}
            for w, (m, text) in names.items():
                if m != model:
                    continue
                k = _key(model, text, n)
                if k not in cache:
                    prompt = e.tokenize(text)
                    gen = e.generate(prompt, n, GREEDY)
                    cache[k] = {"prompt": prompt.tolist(), "gen": [t for c in gen for t in c]}
                    print(f"[replay] {w}: {len(prompt)} prompt tokens, {len(cache[k]['gen'])} generated", file=sys.stderr)
                got[w] = dict(cache[k], model=model)
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    CACHE.write_text(json.dumps(cache))
    return got, curves


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="16,32,48", help="size-m values of the adaptive length to replay")
    ap.add_argument("-n", "--n-predict", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-tokens", type=int, default=60, help="leave out texts that end sooner (too few passes)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "draft_length_replay.json"))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not sizes or any(not 1 <= s <= EXACT_CAP for s in sizes):
        sys.exit(f"--sizes takes size-m values in 1..{EXACT_CAP}, comma-separated (got {args.sizes!r})")
    data, curves = texts(corpus(), args.n_predict, args.threads)
    cols = ["fixed m16", *(f"adaptive m{s}" for s in sizes), "foresight m16", f"foresight m{max(sizes)}"]
    rows = []
    for w, d in data.items():
        if len(d["gen"]) < args.min_tokens:
            continue
        curve = curves[d["model"]]
        none_s = (len(d["gen"]) - 1) * curve[1]
        x = {"fixed m16": none_s / replay(d["prompt"], d["gen"], curve, 16, False)["modeled_s"]}
        x |= {f"adaptive m{s}": none_s / replay(d["prompt"], d["gen"], read_at(curve, s), s, True, truth=curve)["modeled_s"]
              for s in sizes}
        x |= {f"foresight m{s}": none_s / foresight(d["prompt"], d["gen"], curve, s) for s in (16, max(sizes))}
        rows.append({"text": w, "model": d["model"], "prompt_tokens": len(d["prompt"]), "tokens": len(d["gen"]), **x})
    geo = {c: math.exp(sum(math.log(r[c]) for r in rows) / len(rows)) for c in cols}
    lines = ["| text | model | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    lines += [f"| {r['text']} | {r['model']} | " + " | ".join(f"{r[c]:.2f}" for c in cols) + " |" for r in rows]
    lines += [f"| **geometric mean** ({len(rows)} texts) | | " + " | ".join(f"**{geo[c]:.3f}**" for c in cols) + " |"]
    md = "\n".join(lines)
    print(md)
    out = Path(args.out)
    out.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d"), "n_predict": args.n_predict,
                               "curves_ms": {m: {r: s * 1e3 for r, s in c.items()} for m, c in curves.items()},
                               "geomean": geo, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(md + "\n")


if __name__ == "__main__":
    main()
