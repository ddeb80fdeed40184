"""The fast prompt path's kernels with llama.cpp's tiled K-quant matmul on and off, side by side.

    python benchmarks/prompt_kernels.py [--models gemma-3-270m,smollm2-135m-instruct] [--rounds 3]
        [--threads 2] [--out benchmarks/results/prompt_kernels.json]

Exact mode needs `GGML_CPU_TILED_MM=0` (kernels/llama.py): the tiled kernel takes K-quant matmuls
of 8 rows or more, so a verify row would be computed otherwise than the same position decoded
alone. ggml reads the variable once per process (a std::call_once in ggml-cpu/tiled/tiled.cpp),
and its only per-context override, the CPU backend's use_ref, is not reachable through llama.h.
So the fast prompt context (kernels/prefill.py), which runs in the same process as the exact one,
evaluates prompts without the tiled kernel, where llama-server uses it. This measures what that
costs: for each model, a child process loads the fast context's weights (repacked, as
Model.repacked() does) and evaluates benchmarks/prompts/long_prompt.txt in the fast context's own
blocks (prefill.fast_blocks, then the tail), once with the variable unset (llama-server's kernels)
and once with it 0 (specrun's); the two children alternate, --rounds times, 3 timed evaluations
each after one untimed. On x86 the tiled kernel takes Q2_K..Q6_K and IQ types that are not
repacked: Q6_K in a Q4_K_M file such as Gemma 3 270M; SmolLM2's Q4_1 / Q8_0 never take it, so its
ratio is the control. Writes the JSON and a markdown table next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import PROMPTS, RESULTS, cpu_model, git_state, write_results  # noqa: E402

TILED_ENV = "GGML_CPU_TILED_MM"
SETTINGS = {"tiled on": None, "tiled off": "0"}   # setting: the variable's value (None: unset)


def child(model: str, threads: int, reps: int) -> None:
    """In a process of its own: print {"prompt_n", "tok_s": [reps]} for the long prompt."""
    from specrun.gguf_spec.registry import resolve_model
    from specrun.kernels.llama import Context, ContextParams, Model
    from specrun.kernels.prefill import BLOCK, fast_blocks, fast_len

    with Model(str(resolve_model(model)), exact=False) as m:
        p = m.tokenize((PROMPTS / "long_prompt.txt").read_text())
        head = fast_len(len(p))
        blocks = [*fast_blocks(head), (head, len(p) - head)]
        with Context(m, ContextParams(n_ctx=4096, n_batch=BLOCK, n_ubatch=BLOCK, n_threads=threads,
                                      kv_f16=True, n_outputs_max=1)) as c:
            got = []
            for rep in range(reps + 1):
                c.clear()
                t = time.perf_counter()
                for s, size in blocks:
                    c.decode(p[s:s + size], s, "last" if s + size == len(p) else "none")
                if rep:
                    got.append(len(p) / (time.perf_counter() - t))
        print(json.dumps({"prompt_n": len(p), "repacked_mib": m.repacked_mib, "tok_s": got}))


def run_child(model: str, value: str | None, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k != TILED_ENV}
    if value is not None:
        env[TILED_ENV] = value
    r = subprocess.run([sys.executable, __file__, "--child", model, "--threads", str(args.threads)],
                       env=env, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        sys.exit(f"[prompt-kernels] the {model} child failed (rc {r.returncode}): {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def markdown(data: dict) -> str:
    dirty = f" with uncommitted changes in {', '.join(data['dirty'])}" if data.get("dirty") else ""
    lines = [f"Measured {data['date']} at commit `{data['commit']}`{dirty}; {data['cpu']}; {data['threads']} threads; "
             f"`long_prompt.txt` in the fast context's blocks, repacked weights, F16 KV cache; median of "
             f"{data['rounds']} rounds x 3 evaluations, the two settings alternating.", "",
             "| model | prompt tokens | tiled on (llama-server) tok/s | tiled off (specrun) tok/s | off / on |",
             "|---|---|---|---|---|"]
    for model, r in data["models"].items():
        on, off = statistics.median(r["tiled on"]), statistics.median(r["tiled off"])
        lines.append(f"| {model} | {r['prompt_n']} | {on:.0f} | {off:.0f} | {off / on:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--models", default="gemma-3-270m,smollm2-135m-instruct")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "prompt_kernels.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.threads, 3)
        return
    commit, dirty = git_state()
    data = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": commit, "dirty": dirty,
            "cpu": cpu_model(), "threads": args.threads, "rounds": args.rounds, "models": {}}
    for model in (m for m in args.models.split(",") if m):
        r: dict = {s: [] for s in SETTINGS}
        for rnd in range(args.rounds):
            for s in (list(SETTINGS) if rnd % 2 == 0 else list(SETTINGS)[::-1]):
                got = run_child(model, SETTINGS[s], args)
                r[s] += got["tok_s"]
                r["prompt_n"] = got["prompt_n"]
                print(f"[prompt-kernels] {model} {s}: " + ", ".join(f"{x:.0f}" for x in got["tok_s"]) + " tok/s",
                      file=sys.stderr, flush=True)
        data["models"][model] = r
    write_results(args.out, data, markdown(data))


if __name__ == "__main__":
    main()
