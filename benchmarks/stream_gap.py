"""Busy slots with an idle one between them: their KV streams side by side or not (issue 49).

    python benchmarks/stream_gap.py [--models gemma-3-270m,smollm2-135m-instruct] [-t 2] [-n 64]
        [--reps 3] [--out benchmarks/results/stream_gap.json]

llama.cpp splits a decode over a KV stream per sequence into ubatches of consecutive sequence ids
(draftlen.ubatch_rows), so busy slots 0 and 2 with slot 1 idle cost a pass each per step. The
batched engine moves the busy sequences' streams side by side (BatchEngine._compact). Here the
same requests, pinned to slots with gaps between them (as a server's slots are, each request
going to the slot that holds its prefix), run with that on (`compact`) and off (`gap`), the two
alternating within each rep. The idle slots hold a cached prompt first, so a move trades two
streams. Greedy, spec none; tok/s counts all generated tokens over the run's wall time (prompts
of about 10 tokens included, alike in both). The texts must be equal both ways.
A move copies whole streams, so its cost grows with the context: the second table times the
step that admits the request which opens a gap, with and without the move, at several -c.
Writes the JSON and a markdown table next to it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from specrun.gguf_spec.registry import resolve_model
from specrun.kernels.batch import BatchEngine, BatchParams, Request
from specrun.kernels.llama import Model
from specrun.kernels.types import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temp=0.0)
TEXTS = ["The history of the city begins", "def parse(line):\n    fields =", "Dear committee, I am writing to",
         "The three laws of motion state that"]
LAYOUTS = ((4, (0, 2)), (6, (0, 2, 4)), (8, (1, 4, 7)))    # (slots, the busy ones)


def one_run(model: Model, n_seq: int, busy: tuple[int, ...], compact: bool, n: int, threads: int
            ) -> tuple[float, list[list[int]], int]:
    """(seconds, texts, streams moved) of the busy slots' requests, after every slot cached a prompt."""
    params = BatchParams(n_seq=n_seq, n_ctx_seq=512, n_threads=threads, compact=compact)
    with BatchEngine(model.path, params, model=model) as b:
        b.run([Request(model.tokenize("An unrelated prompt, cached."), 2, GREEDY, seq=i) for i in range(n_seq)])
        b.n_moves = 0
        reqs = [Request(model.tokenize(TEXTS[j % len(TEXTS)]), n, GREEDY, seq=s) for j, s in enumerate(busy)]
        t0 = time.perf_counter()
        hs = b.run(reqs)
        return time.perf_counter() - t0, [h.tokens for h in hs], b.n_moves


def admit_step(model: Model, ctx: int, compact: bool, threads: int) -> tuple[float, float]:
    """(seconds of the step that admits a request to slot 2 beside a busy slot 0, the median of the
    plain steps after it) with slot 1 idle and holding KV: with compact, that step moves a stream."""
    params = BatchParams(n_seq=4, n_ctx_seq=ctx, n_threads=threads, compact=compact)
    with BatchEngine(model.path, params, model=model) as b:
        b.run([Request(model.tokenize(f"Cached text number {i}."), 2, GREEDY, seq=i) for i in range(4)])
        hs = [b.submit(Request(model.tokenize(TEXTS[0]), 24, GREEDY, seq=0))]
        for _ in range(8):
            b.step()
        hs.append(b.submit(Request(model.tokenize(TEXTS[2]), 16, GREEDY, seq=2)))
        times = []
        while not all(h.done for h in hs):
            t0 = time.perf_counter()
            b.step()
            times.append(time.perf_counter() - t0)
        return times[0], statistics.median(times[1:])


def markdown(data: dict) -> str:
    """The two tables of a run's JSON."""
    meta, rows, moves = data["meta"], data["rows"], data["moves"]
    lines = ["# Busy slots with idle ones between them (benchmarks/stream_gap.py)", "",
             f"{meta['date']}, {meta['threads']} threads, exact mode, greedy, spec none, {meta['n_predict']} tokens a "
             f"request, median of {meta['reps']} reps (the two ways alternating). `gap`: the busy slots' KV streams "
             "stay where they are; `compact`: they are moved side by side (BatchEngine._compact).", "",
             "| model | slots | busy | gap tok/s | compact tok/s | compact / gap | streams moved | texts equal |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['slots']} | {', '.join(map(str, r['busy']))} | {r['gap_tok_s']:.1f} | "
                     f"{r['compact_tok_s']:.1f} | {r['ratio']:.2f} | {r['moves']} | {r['texts_equal']} |")
    lines += ["", "The step that admits the request to slot 2 (slot 0 busy, slot 1 idle with KV): with the move "
              "(`compact`) and without (`gap`), and the plain steps after it (medians, ms):", "",
              "| model | -c | admitting step, gap | admitting step, compact | plain step, gap | plain step, compact |",
              "|---|---|---|---|---|---|"]
    for m in moves:
        lines.append(f"| {m['model']} | {m['ctx']} | {1e3 * m['admit_step_s']:.0f} | {1e3 * m['move_step_s']:.0f} | "
                     f"{1e3 * m['plain_gap_s']:.0f} | {1e3 * m['plain_compact_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gemma-3-270m,smollm2-135m-instruct")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-predict", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--move-ctx", default="2048,8192,32768", help="contexts of a slot for the move's cost")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/stream_gap.json"))
    args = ap.parse_args()
    rows, move_rows = [], []
    for name in args.models.split(","):
        model = Model(resolve_model(name), exact=True)
        for n_seq, busy in LAYOUTS:
            secs: dict[bool, list[float]] = {True: [], False: []}
            texts, moves = {}, 0
            for rep in range(args.reps):
                for compact in ((True, False) if rep % 2 == 0 else (False, True)):
                    s, t, m = one_run(model, n_seq, busy, compact, args.n_predict, args.threads)
                    secs[compact].append(s)
                    texts.setdefault(compact, t)
                    moves = max(moves, m) if compact else moves
            n_tok = sum(len(t) for t in texts[True])
            r = {"model": name, "slots": n_seq, "busy": list(busy), "tokens": n_tok, "moves": moves,
                 "compact_s": secs[True], "gap_s": secs[False],
                 "compact_tok_s": n_tok / statistics.median(secs[True]),
                 "gap_tok_s": n_tok / statistics.median(secs[False]),
                 "texts_equal": texts[True] == texts[False]}
            r["ratio"] = r["compact_tok_s"] / r["gap_tok_s"]
            print(r, flush=True)
            rows.append(r)
        for ctx in map(int, args.move_ctx.split(",")):
            got: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for rep in range(args.reps):
                for compact in ((True, False) if rep % 2 == 0 else (False, True)):
                    got[compact].append(admit_step(model, ctx, compact, args.threads))
            m = {"model": name, "ctx": ctx, "move_step_s": statistics.median(a for a, _ in got[True]),
                 "admit_step_s": statistics.median(a for a, _ in got[False]),
                 "plain_compact_s": statistics.median(p for _, p in got[True]),
                 "plain_gap_s": statistics.median(p for _, p in got[False])}
            print(m, flush=True)
            move_rows.append(m)
        model.close()
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "threads": args.threads,
            "n_predict": args.n_predict, "reps": args.reps}
    data = {"meta": meta, "rows": rows, "moves": move_rows}
    write_results(args.out, data, markdown(data))


if __name__ == "__main__":
    main()
