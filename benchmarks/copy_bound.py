"""How fast any copy drafter could go on specrun's exact text: a bound with foresight, beside what llama-server's best needs.

    python benchmarks/copy_bound.py [--workloads code-rewrite,...] [-n 128] [--peers FILE.json] [--out FILE.json]

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
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from specrun.gguf_spec.registry import resolve_model
from specrun.kernels.engine import Engine
from specrun.kernels.params import EngineParams

sys.path.insert(0, str(Path(__file__).resolve().parent))    # run from anywhere: the scripts import each other
from draft_length import GREEDY, PROMPTS, WORKLOADS, measure_curve  # noqa: E402
from draft_length_replay import EXACT_CAP, REPLAY_ROWS, best_cut, frozen, replay  # noqa: E402
from peers import RESULTS, best_peer, summarize  # noqa: E402

MATCH_N = (3, 2, 1, 0)


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
               cap: int = EXACT_CAP) -> dict:
    """Passes of the oracle copy drafter on prompt + gen (gen[0] comes from the prompt's pass), each
    drafting the k <= longest_copy(...) with the most tokens per second for that pass. curve:
    {rows: seconds}. Returns {"rows": [rows per pass], "modeled_s": seconds}."""
    cost = frozen(curve)
    text, pos, rows = prompt + gen, len(prompt) + 1, []
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="free,code-rewrite,verbatim,json-table,chat-reuse,code-rewrite-smollm2")
    ap.add_argument("-n", "--n-predict", type=int, default=128, help="as the peers requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", default=str(RESULTS / "peers.json"),
                    help="a peers.py or exact_peers.py run, for the needed column")
    ap.add_argument("--out", default=str(RESULTS / "copy_bound.json"))
    args = ap.parse_args()
    names = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        sys.exit(f"unknown workload {unknown[0]!r}: choose from {', '.join(WORKLOADS)}")
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
    out = Path(args.out)
    out.write_text(json.dumps({"measured": time.strftime("%Y-%m-%d"), "n_predict": args.n_predict,
                               "peers": Path(args.peers).name,
                               "curves_ms": {m: {r: s * 1e3 for r, s in c.items()} for m, c in curves.items()},
                               "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
