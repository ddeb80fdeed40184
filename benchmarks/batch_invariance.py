"""Are a sequence's logits bit-identical whatever else is in the batch? (issue 49)

    python benchmarks/batch_invariance.py [--models gemma-3-270m,smollm2-135m-instruct] [-t 2]
        [--out benchmarks/results/batch_invariance.json]

Reference: sequence A alone (one sequence per context, exact mode), its prompt then greedy
one-token steps; every step's logits row kept. Then the same A in a context of 4 sequences with
the other sequences' rows in the same llama_decode calls: B's and C's prompts in chunks, their
one-token steps and verify batches of wrong drafts rolled back after the pass, B leaving
(seq_rm of all of it) and D joining into the cells B left. A itself steps one token at a time,
then by verify batches of its own reference continuation (all accepted). Each of A's rows is
compared with the reference row of the same position, bit for bit.

Per model and KV layout (kv_unified False: a stream per sequence, llama.cpp's default; True: one
buffer whose cells the sequences share, interleaved), the rows identical and the largest |diff|.
Also whether A's text (greedy) is the reference's. Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT.parent))

from specrun.gguf_spec.registry import resolve_model  # noqa: E402
from specrun.kernels.llama import Context, ContextParams, Model  # noqa: E402

PROMPT_A = (ROOT / "benchmarks/prompts/summary_quotes.txt").read_text()   # past 256 tokens as it goes
N_STEPS = 40


def reference(model: Model, prompt: np.ndarray, n_threads: int) -> tuple[list[int], list[np.ndarray]]:
    """A alone: the greedy tokens after the prompt and the logits row that chose each."""
    with Context(model, ContextParams(n_ctx=2048, n_batch=512, n_threads=n_threads)) as ctx:
        ctx.decode_chunks(prompt, 0)
        rows, toks = [ctx.logits_rows()[-1].copy()], []
        for i in range(N_STEPS):
            toks.append(int(rows[-1].argmax()))
            ctx.decode([toks[-1]], len(prompt) + i, "last")
            rows.append(ctx.logits_rows()[-1].copy())
    return toks, rows


def batched(model: Model, prompts: dict[int, np.ndarray], ref: list[int], n_threads: int,
            unified: bool) -> tuple[list[int], list[np.ndarray]]:
    """A (seq 0) in a 4-sequence context beside B (1), C (2) and later D (3, joining where B was)."""
    n_seq = 4
    with Context(model, ContextParams(n_ctx=2048 * n_seq, n_batch=512, n_threads=n_threads, n_seq_max=n_seq,
                                      kv_unified=unified)) as ctx:
        rng = np.random.default_rng(0)
        pa = prompts[0]
        # B's prompt first, alone, so that A's cells come after B's in a unified buffer
        pb = prompts[1]
        ctx.decode_seqs(pb, range(len(pb)), [1] * len(pb), [0] * len(pb))
        done = {1: len(pb)}
        # A's prompt in two chunks, each beside a chunk of C's prompt
        pc = prompts[2]
        h = len(pa) // 2
        for lo, hi, clo, chi in ((0, h, 0, 7), (h, len(pa), 7, len(pc))):
            toks = [*pa[lo:hi], *pc[clo:chi]]
            pos = [*range(lo, hi), *range(clo, chi)]
            seqs = [0] * (hi - lo) + [2] * (chi - clo)
            outs = [0] * (hi - lo - 1) + [1] + [0] * (chi - clo)
            ctx.decode_seqs(toks, pos, seqs, outs)
        done[2] = len(pc)
        rows = [ctx.outputs_rows()[0].copy()]
        toks_a: list[int] = []
        n_a = len(pa)
        step = 0
        while len(toks_a) < N_STEPS:
            toks_a.append(int(rows[-1].argmax()))
            # A: one token, or a verify batch of its reference continuation (3 drafted tokens)
            k = 0 if step % 3 == 0 else min(3, N_STEPS - len(toks_a))
            a_rows = [toks_a[-1], *ref[len(toks_a):len(toks_a) + k]]
            toks, pos, seqs, outs = list(a_rows), list(range(n_a, n_a + k + 1)), [0] * (k + 1), [1] * (k + 1)
            others = []
            for s in sorted(done):
                if s == 1 and step == 6:   # B leaves; D takes its place (its cells, in a unified buffer)
                    ctx.seq_rm_of(1, -1, -1)
                    continue
                j = int(rng.integers(0, 4))   # a one-token step, or 1-3 wrong draft tokens
                toks += [int(t) for t in rng.integers(100, 1000, j + 1)]
                pos += list(range(done[s], done[s] + j + 1))
                seqs += [s] * (j + 1)
                outs += [1] * (j + 1)
                others.append((s, j))
            if step == 6:
                done.pop(1)
                pd = prompts[3]
                toks += list(pd)
                pos += list(range(len(pd)))
                seqs += [3] * len(pd)
                outs += [0] * (len(pd) - 1) + [1]
                done[3] = len(pd) - 1 + 1
            ctx.decode_seqs(toks, pos, seqs, outs)
            out = ctx.outputs_rows()
            for i in range(k + 1):   # A's rows come first
                rows.append(out[i].copy())
            if k:
                toks_a += [int(t) for t in a_rows[1:]]
            n_a += k + 1
            for s, _j in others:      # keep the first row of each other sequence, drop its wrong drafts
                if not ctx.seq_rm_of(s, done[s] + 1, -1):
                    raise RuntimeError("seq_rm failed")
                done[s] += 1
            step += 1
        return toks_a[:N_STEPS], rows[:N_STEPS + 1]


def prompt_split(model: Model, n_threads: int) -> dict:
    """A 150-token prompt (64+ rows: flash attention's tiled kernel, were it taken) in one chunk, against
    the same prompt split 1 + 149 by another sequence's row (llama.cpp's equal split of a batch of
    several streams) and one token at a time: its rows' logits, then 8 greedy steps'."""
    long = model.tokenize(", ".join(map(str, range(1, 41))) + ",")
    n = len(long)

    def run(how: str) -> np.ndarray:
        with Context(model, ContextParams(n_ctx=1024, n_batch=512, n_threads=n_threads, n_seq_max=2)) as c:
            c.decode_seqs([5, 6, 7], range(3), [1] * 3, [0] * 3)
            if how == "split":
                c.decode_seqs([*long, 8], [*range(n), 3], [0] * n + [1], [1] * n + [0])
            elif how == "chunk":
                c.decode_seqs(long, range(n), [0] * n, [1] * n)
            rows = [c.outputs_rows().copy()] if how != "one" else []
            for i in range(n if how == "one" else 0):
                c.decode_seqs([long[i]], [i], [0], [1])
                rows.append(c.outputs_rows().copy())
            rows = [np.concatenate(rows)]
            tok = int(rows[0][-1].argmax())
            for i in range(8):
                c.decode_seqs([tok], [n + i], [0], [1])
                rows.append(c.outputs_rows().copy())
                tok = int(rows[-1][0].argmax())
            return np.concatenate(rows)

    chunk = run("chunk")
    out = {"n_prompt": n}
    for how in ("split", "one"):
        other = run(how)
        out[how] = f"{sum(bool(np.array_equal(a, b)) for a, b in zip(chunk, other, strict=True))}/{len(chunk)}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gemma-3-270m,smollm2-135m-instruct")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/batch_invariance.json"))
    args = ap.parse_args()
    results, splits = [], []
    for name in args.models.split(","):
        model = Model(resolve_model(name), exact=True)
        texts = [PROMPT_A, "The quick brown fox", "def fib(n):\n    return", "Once upon a time, in a land far"]
        prompts = {i: model.tokenize(t) for i, t in enumerate(texts)}
        ref_toks, ref_rows = reference(model, prompts[0], args.threads)
        for unified in (False, True):
            toks, rows = batched(model, prompts, ref_toks, args.threads, unified)
            same = sum(bool(np.array_equal(a, b)) for a, b in zip(rows, ref_rows, strict=True))
            diff = max(float(np.abs(a - b).max()) for a, b in zip(rows, ref_rows, strict=True))
            r = {"model": name, "kv_unified": unified, "n_prompt": len(prompts[0]), "rows": len(rows),
                 "rows_identical": same, "max_abs_diff": diff, "text_equal": toks == ref_toks}
            print(r, flush=True)
            results.append(r)
        split = {"model": name, **prompt_split(model, args.threads)}
        print(split, flush=True)
        splits.append(split)
        model.close()
    out = Path(args.out)
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "threads": args.threads,
            "n_steps": N_STEPS}
    out.write_text(json.dumps({"meta": meta, "results": results, "prompt_split": splits}, indent=1) + "\n")
    lines = ["# One sequence's logits beside others in one decode (benchmarks/batch_invariance.py)", "",
             f"{meta['date']}, {args.threads} threads, exact mode, A's prompt {results[0]['n_prompt']}+ tokens, "
             f"{N_STEPS} steps (one-token and verify rows) beside other sequences' prompt chunks, steps and "
             "rolled-back drafts; a sequence leaving and another joining.", "",
             "| model | kv_unified | A's rows identical to alone | max abs diff | A's greedy text equal |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['model']} | {r['kv_unified']} | {r['rows_identical']}/{r['rows']} | "
                     f"{r['max_abs_diff']:.3g} | {r['text_equal']} |")
    lines += ["", "A 150-token prompt's rows and 8 greedy steps after it, each row compared with the prompt "
              "decoded in one chunk:", "", "| model | split 1 + 149 beside another sequence | one token at a time |",
              "|---|---|---|"]
    lines += [f"| {r['model']} | {r['split']} | {r['one']} |" for r in splits]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
