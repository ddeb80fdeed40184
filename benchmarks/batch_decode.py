"""Does one batched decode of N sequences pay on this CPU? (issue 49)

    python benchmarks/batch_decode.py [--model gemma-3-270m] [-t 2] [-n 32] [--reps 3]
        [--out benchmarks/results/batch_decode.json]

Aggregate generated tokens/s of N = 1, 2, 4 sequences (exact mode, greedy, spec none), two ways:

- kernel: N sequences in one context, a llama_decode of N rows (one token each) per step,
  against N one-sequence contexts stepping one token each, one context after the other.
- engine: N requests through kernels/batch.py's BatchEngine (one decode per step), against the
  same N requests through the Engine one after another (what one slot does with N queued requests).

Each cell is the median of --reps rounds, the two ways alternating within a round. Only the
generation is timed (prompts of about 20 tokens are evaluated before the clock starts in the
kernel rows; in the engine rows the prompt is part of the time, for both ways alike).
Writes the JSON and a markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from specrun.gguf_spec.registry import resolve_model
from specrun.kernels.batch import BatchEngine, BatchParams, Request
from specrun.kernels.engine import Engine
from specrun.kernels.llama import Context, ContextParams, Model
from specrun.kernels.params import EngineParams, SpecParams
from specrun.kernels.types import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temp=0.0)
TEXTS = ["The history of the city begins", "def parse(line):\n    fields =", "Dear committee, I am writing to",
         "The three laws of motion state that"]


def kernel_round(model: Model, prompts, n_gen: int, threads: int) -> tuple[float, float]:
    """(batched s, separate s) for len(prompts) sequences of n_gen one-token steps."""
    N = len(prompts)
    with Context(model, ContextParams(n_ctx=512 * N, n_batch=512, n_threads=threads, n_seq_max=N)) as c:
        for s, p in enumerate(prompts):
            c.decode_seqs(p, range(len(p)), [s] * len(p), [0] * (len(p) - 1) + [1])
        toks = [int(c.outputs_rows()[0].argmax())] * N
        t = time.perf_counter()
        for i in range(n_gen):
            c.decode_seqs(toks, [len(p) + i for p in prompts], range(N), [1] * N)
            toks = [int(r.argmax()) for r in c.outputs_rows()]
        batched = time.perf_counter() - t
    separate = 0.0
    for p in prompts:
        with Context(model, ContextParams(n_ctx=512, n_batch=512, n_threads=threads)) as c:
            c.decode(p, 0, "last")
            tok = int(c.logits_rows()[-1].argmax())
            t = time.perf_counter()
            for i in range(n_gen):
                c.decode([tok], len(p) + i, "last")
                tok = int(c.logits_rows()[-1].argmax())
            separate += time.perf_counter() - t
    return batched, separate


def engine_round(model: Model, engine: Engine, prompts, n_gen: int, threads: int) -> tuple[float, float]:
    N = len(prompts)
    with BatchEngine(model.path, BatchParams(n_seq=N, n_ctx_seq=512, n_threads=threads), model=model) as b:
        t = time.perf_counter()
        hs = b.run([Request(p, n_gen, GREEDY, SpecParams(types=())) for p in prompts])
        batched = time.perf_counter() - t
    t = time.perf_counter()
    seq = []
    for p in prompts:
        engine.reset()
        seq.append([x for chunk in engine.generate(p, n_gen, GREEDY) for x in chunk])
    separate = time.perf_counter() - t
    assert [h.tokens for h in hs] == seq, "the batched texts differ from the texts alone"
    return batched, separate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-gen", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/batch_decode.json"))
    args = ap.parse_args()
    model = Model(resolve_model(args.model))
    prompts = [model.tokenize(t) for t in TEXTS]
    engine = Engine(model.path, EngineParams(n_ctx=512, n_threads=args.threads, fast_prefill=False,
                                             spec=SpecParams(types=())), model=model)
    rows = []
    for N in (1, 2, 4):
        for way, fn in (("kernel", kernel_round), ("engine", engine_round)):
            times = [fn(model, prompts[:N], args.n_gen, args.threads) if way == "kernel"
                     else fn(model, engine, prompts[:N], args.n_gen, args.threads) for _ in range(args.reps)]
            b = statistics.median(t[0] for t in times)
            s = statistics.median(t[1] for t in times)
            tok = N * args.n_gen
            r = {"n_seq": N, "way": way, "batched_tps": tok / b, "separate_tps": tok / s, "ratio": s / b,
                 "batched_s": [t[0] for t in times], "separate_s": [t[1] for t in times]}
            print(r, flush=True)
            rows.append(r)
    engine.close()
    model.close()
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": args.model,
            "threads": args.threads, "n_gen": args.n_gen, "reps": args.reps, "cpus": os.cpu_count(),
            "loadavg_after": os.getloadavg()}
    out = Path(args.out)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# N sequences in one batched decode against N contexts one after another (benchmarks/batch_decode.py)", "",
             f"{meta['date']}, {args.model}, {args.threads} threads, exact mode, greedy, spec none, {args.n_gen} tokens "
             f"a sequence, median of {args.reps} alternating rounds; load average after the run "
             f"{meta['loadavg_after'][0]:.1f} on {meta['cpus']} CPUs (a shared machine: compare within a row).", "",
             "| N | way | batched tok/s | separate tok/s | batched / separate |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n_seq']} | {r['way']} | {r['batched_tps']:.1f} | {r['separate_tps']:.1f} | "
                     f"{r['ratio']:.2f} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
