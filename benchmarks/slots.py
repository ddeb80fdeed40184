"""Two slots (-np 2): requests one at a time, two at once, then one at a time again, per server.

    python benchmarks/slots.py [--model gemma-3-270m] [--reps 3] [-n 128] [--systems specrun,llama-server]
        [--out benchmarks/results/slots.json]

What a `specrun serve -np 2` user feels once two requests have overlapped. llama.cpp's CPU backend
runs each graph with OpenMP, and libgomp keeps a team of worker threads for every thread that ever
decoded, for that thread's lifetime; with more such threads than CPUs, every barrier of every decode
sleeps on a futex. specrun's slots ran on a pool of long-lived threads, so after the first two
overlapping requests every later request, on either slot, decoded about 3x slower (cli/server/slots.py
now gives each run a thread of its own). llama-server serves all its slots from one thread.

Per system, one server (2 threads, context 4096, -np 2, free.txt, greedy, n_predict tokens,
cache_prompt false), three phases: `alone` (--reps requests one after the other), `at once` (two
requests at the same time, --reps times) and `after` (--reps requests one after the other again).
Speeds are the server's own `timings` (predicted_per_second), medians. The ratios are within one
server's run: after / alone (1.00: overlapping requests left nothing behind) and at once / alone,
for one request's speed and for the two requests' sum. Writes the JSON and a markdown table next to it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import (  # noqa: E402
    PROMPTS,
    RESULTS,
    ROOT,
    complete,
    cpu_model,
    free_port,
    git_state,
    model_path,
    serving,
    write_results,
)

PHASES = ("alone", "at once", "after")


def at_once(url: str, prompt: str, n: int) -> list[dict]:
    out: list[dict] = [{}, {}]

    def ask(i: int) -> None:
        out[i] = complete(url, prompt, n)

    th = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    return out


def measure(cmd: list[str], log: Path, prompt: str, args) -> dict:
    """{phase: [tok/s of each request]} (at once: pairs), and the texts, for one server."""
    res: dict = {p: [] for p in PHASES}
    texts: set[str] = set()
    with serving(cmd, log) as (url, _pid):
        complete(url, prompt, args.n_predict)                      # warm-up
        for phase in PHASES:
            for rep in range(args.reps):
                got = at_once(url, prompt, args.n_predict) if phase == "at once" else [complete(url, prompt, args.n_predict)]
                res[phase].append([r["gen_tps"] for r in got])
                texts.update(r["text"] for r in got)
                print(f"[slots] {cmd[0].rsplit('/', 1)[-1]} {phase} rep {rep + 1}: "
                      + " + ".join(f"{r['gen_tps']:.1f}" for r in got) + " tok/s", file=sys.stderr, flush=True)
    res["same_text"] = len(texts) == 1
    return res


def summary(res: dict) -> dict:
    alone = statistics.median(x[0] for x in res["alone"])
    after = statistics.median(x[0] for x in res["after"])
    each = statistics.median(v for pair in res["at once"] for v in pair)
    both = statistics.median(sum(pair) for pair in res["at once"])
    return {"alone": alone, "after": after, "at_once_each": each, "at_once_sum": both,
            "after_over_alone": after / alone, "each_over_alone": each / alone, "sum_over_alone": both / alone}


def markdown(data: dict) -> str:
    dirty = f" with uncommitted changes in {', '.join(data['dirty'])}" if data.get("dirty") else ""
    lines = [f"Measured {data['date']} at commit `{data['commit']}`{dirty}; {data['cpu']}; model {data['model']}, "
             f"{data['threads']} threads, -np 2, n_predict {data['n_predict']}, {data['reps']} reps per phase, "
             "medians of each server's own `timings`.", "",
             "| system | alone tok/s | at once, each | at once, sum | after tok/s | after / alone | sum at once / alone "
             "| one text |", "|---|---|---|---|---|---|---|---|"]
    for system, r in data["systems"].items():
        s = summary(r)
        lines.append(f"| {system} | {s['alone']:.1f} | {s['at_once_each']:.1f} | {s['at_once_sum']:.1f} | "
                     f"{s['after']:.1f} | {s['after_over_alone']:.2f} | {s['sum_over_alone']:.2f} | "
                     f"{'yes' if r['same_text'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--llama-server", default=str(ROOT / "build" / "peers" / "cmake" / "bin" / "llama-server"))
    ap.add_argument("--specrun", default=str(Path(sys.executable).with_name("specrun")))
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--systems", default="specrun,llama-server")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "slots.json"))
    args = ap.parse_args(argv)
    path = model_path(args.specrun, args.model)
    prompt = (PROMPTS / "free.txt").read_text()
    systems = [s for s in args.systems.split(",") if s]
    if "llama-server" in systems and not Path(args.llama_server).is_file():
        print(f"[slots] no llama-server at {args.llama_server} (make peers-server): specrun only", file=sys.stderr)
        systems.remove("llama-server")
    commit, dirty = git_state()
    data = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": commit, "dirty": dirty, "cpu": cpu_model(),
            "model": args.model, "threads": args.threads, "n_predict": args.n_predict, "reps": args.reps, "systems": {}}
    for system in systems:
        port = free_port()
        common = ["-m", path, "-t", str(args.threads), "-c", "4096", "-np", "2", "--host", "127.0.0.1", "--port", str(port)]
        cmd = [args.specrun, "serve", *common] if system == "specrun" else [args.llama_server, *common]
        data["systems"][system] = measure(cmd, ROOT / "build" / "peers" / "logs" / f"slots-{system}.log", prompt, args)
    write_results(args.out, data, markdown(data))


if __name__ == "__main__":
    main()
