"""Pass by pass: every llama.cpp graph timed inside specrun serve and llama-server on the same requests.

    python benchmarks/pass_times.py [--workload code-rewrite-smollm2] [--setting "ngram-simple n3 m16"]
        [--systems "specrun,llama-server exact"] [--reps 6]        # or: make bench-pass-times
        [--also "GOMP_SPINCOUNT=10000000" --also "--no-fast-prefill"]   # more specrun servers beside them

exact_peers.py can show two systems drafting the same tokens at different tok/s; this says where the
time differs. benchmarks/pass_times.c, built here with cc into build/peers/ and preloaded into each
server (LD_PRELOAD), wraps ggml_backend_sched_graph_compute_async, through which llama_decode runs
every ubatch's graph, and logs each graph: its CLOCK_MONOTONIC start and duration, node count and
rows (tokens). A request's graphs are those that start inside its window (time.monotonic: the same
clock). Per system, over the kept reps: tok/s from the server's own timings; per request, the time
in graphs and the rest of the request (tokenizing, HTTP, Python or C++ between passes, llama.cpp
outside graph compute); per graph group, graphs per request and mean ms. A group is (role, rows):
role "target" for graphs with at least half the most nodes seen (the target's passes, the prompt's
chunks), else "N nodes" (a draft model's step, an EAGLE-3 fusion, an MTP head). Systems as in
exact_peers.py (llama-server exact: exact mode's flags); each --also adds a specrun server named
"specrun SPEC", where SPEC's leading NAME=VALUE words are its environment and the rest extra flags
(an A/B of a setting or an environment variable in the same run). Every server up at once, the
requests rotating among them, one warm-up each, an unrelated prompt before each request (peers.FLUSH).
Writes benchmarks/results/pass_times.json and .md.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

from exact_peers import SYSTEMS, command
from peers import (
    FLUSH,
    LOGS,
    PROMPTS,
    RESULTS,
    ROOT,
    SETTINGS,
    WORKLOADS,
    ServerFailed,
    complete,
    cpu_model,
    git_state,
    model_path,
    serving,
    write_results,
)

SHIM_SRC = ROOT / "benchmarks" / "pass_times.c"
SHIM = ROOT / "build" / "peers" / "pass_times.so"


@dataclass(frozen=True, slots=True)
class Graph:
    start: float   # ms, CLOCK_MONOTONIC
    ms: float
    nodes: int
    rows: int


def build_shim(src: Path = SHIM_SRC, out: Path = SHIM) -> Path:
    """cc the preload library against the ggml headers llama-cpp-python installs (site-packages/include);
    rebuilt when the source is newer. Raises RuntimeError with cc's message."""
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    spec = importlib.util.find_spec("llama_cpp")
    include = Path(spec.origin).parents[1] / "include" if spec and spec.origin else None
    if include is None or not (include / "ggml-backend.h").is_file():
        raise RuntimeError(f"no ggml-backend.h beside llama_cpp (looked in {include}); `make install` puts it there")
    out.parent.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-I", str(include), str(src), "-o", str(out), "-ldl",
                        "-lpthread"], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"cc could not build {out.name}: {r.stderr.strip()[-400:]}")
    return out


def variant(system: str) -> tuple[list[str], list[str]]:
    """("specrun SPEC") -> (SPEC's leading NAME=VALUE words: environment, the rest: extra flags)."""
    words = shlex.split(system.removeprefix("specrun").strip())
    n = 0
    while n < len(words) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[n]):
        n += 1
    return words[:n], words[n:]


def server(system: str, model: str, path: str, setting, args) -> list[str]:
    """exact_peers' command for a system; "specrun SPEC" is specrun's with SPEC's environment and flags."""
    if not system.startswith("specrun "):
        return command(system, model, path, setting, args)
    env, flags = variant(system)
    return ["env", *env, *command("specrun", model, path, setting, args), *flags]


def parse(text: str) -> list[Graph]:
    """The shim's lines (start ms, duration ms, nodes, rows); a torn last line is skipped."""
    out = []
    for line in text.splitlines():
        f = line.split()
        if len(f) == 4:
            with contextlib.suppress(ValueError):
                out.append(Graph(float(f[0]), float(f[1]), int(f[2]), int(f[3])))
    return out


def groups(graphs: list[Graph], max_nodes: int) -> dict[tuple[str, int], list[float]]:
    """{(role, rows): [ms, ...]}: role "target" at >= max_nodes / 2 nodes, else "N nodes"."""
    out: dict[tuple[str, int], list[float]] = {}
    for g in graphs:
        role = "target" if 2 * g.nodes >= max_nodes else f"{g.nodes} nodes"
        out.setdefault((role, g.rows), []).append(g.ms)
    return out


def request_record(graphs: list[Graph], t0: float, t1: float) -> dict:
    """A request's window [t0, t1] (ms): its graphs, their total and the rest."""
    mine = [g for g in graphs if t0 <= g.start <= t1]
    in_graphs = sum(g.ms for g in mine)
    return {"window_ms": t1 - t0, "graph_ms": in_graphs, "rest_ms": t1 - t0 - in_graphs,
            "graphs": [asdict(g) for g in mine]}


def run(args) -> list[dict]:
    named = {w.name: w for w in WORKLOADS}
    w = named[args.workload]
    setting = next(s for s in SETTINGS if s.name == args.setting)
    prompt = (PROMPTS / w.file).read_text(encoding="utf-8")
    path = model_path(args.specrun, w.model)
    shim = build_shim()
    out: list[dict] = []
    with contextlib.ExitStack() as stack:
        live = {}
        for sys_ in args.systems:
            tag = re.sub(r"[^A-Za-z0-9_.=-]+", "_", sys_)
            times = LOGS / f"pass_times-{tag}.txt"
            times.parent.mkdir(parents=True, exist_ok=True)
            times.write_text("")
            cmd = ["env", f"LD_PRELOAD={shim}", f"PASS_TIMES={times}", *server(sys_, w.model, path, setting, args)]
            url, _ = stack.enter_context(serving(cmd, LOGS / f"pass_times-{tag}.log"))
            live[sys_] = (url, times)
        for rep in range(-1, args.reps):
            order = args.systems[rep % len(args.systems):] + args.systems[:rep % len(args.systems)]
            for sys_ in order:
                url, times = live[sys_]
                complete(url, FLUSH, 1)
                t0 = time.monotonic() * 1e3
                r = complete(url, prompt, args.n_predict)
                t1 = time.monotonic() * 1e3
                time.sleep(0.05)   # the last graph's line is written after it returns
                rec = request_record(parse(times.read_text()), t0, t1)
                print(f"[pass_times] {'warm-up' if rep < 0 else f'rep {rep + 1}'} {sys_}: {r['gen_tps']:.1f} tok/s, "
                      f"{len(rec['graphs'])} graphs, {rec['graph_ms']:.1f} ms in graphs, {rec['rest_ms']:.1f} ms else",
                      file=sys.stderr, flush=True)
                if rep >= 0:
                    out.append({"system": sys_, "rep": rep, "gen_tps": r["gen_tps"], "draft_n": r["draft_n"],
                                "draft_n_accepted": r["draft_n_accepted"], "text": r["text"], **rec})
    return out


def summarize(requests: list[dict]) -> dict[str, dict]:
    """Per system: medians per request (tok/s, graph ms, rest ms) and per group (graphs per request, mean ms)."""
    max_nodes = max((g["nodes"] for r in requests for g in r["graphs"]), default=0)
    out = {}
    for sys_ in dict.fromkeys(r["system"] for r in requests):
        mine = [r for r in requests if r["system"] == sys_]
        grouped = groups([Graph(**g) for r in mine for g in r["graphs"]], max_nodes)
        out[sys_] = {"gen_tps": statistics.median(r["gen_tps"] for r in mine),
                     "graph_ms": statistics.median(r["graph_ms"] for r in mine),
                     "rest_ms": statistics.median(r["rest_ms"] for r in mine),
                     "draft": (sum(r["draft_n"] or 0 for r in mine), sum(r["draft_n_accepted"] or 0 for r in mine)),
                     "same_text": len({r["text"] for r in mine}) == 1,
                     "groups": {k: (len(v) / len(mine), statistics.fmean(v)) for k, v in grouped.items()}}
    return out


def markdown(data: dict) -> str:
    m, s = data["meta"], summarize(data["requests"])
    systems = list(s)
    texts = {r["text"] for r in data["requests"]}
    head = (f"Measured {m['date']} at commit `{m['commit']}`{' (uncommitted: ' + ', '.join(m['dirty']) + ')' if m['dirty'] else ''}; "
            f"{m['cpu']}, {m['cores']} cores; `{m['workload']}`, `{m['setting']}`, {m['threads']} threads, "
            f"n_predict {m['n_predict']}, greedy; medians of {m['reps']} requests per system after a warm-up, every "
            f"server up at once and the requests rotating. Each llama.cpp graph timed in the server process "
            f"(benchmarks/pass_times.c). Texts: {'the same for every request' if len(texts) == 1 else f'{len(texts)} different'}.\n")
    cols = " | ".join(systems)
    out = [head, f"| per request | {cols} | {systems[0]} ÷ {systems[1]} |" if len(systems) > 1 else f"| per request | {cols} |",
           "|---|" + "---|" * (len(systems) + (len(systems) > 1))]

    def row(name: str, vals: list[float], fmt: str) -> str:
        cells = " | ".join(format(v, fmt) for v in vals)
        ratio = f" | {vals[0] / vals[1]:.3f}" if len(vals) > 1 and vals[1] else (" | —" if len(vals) > 1 else "")
        return f"| {name} | {cells}{ratio} |"

    out.append(row("tok/s (server timings)", [s[x]["gen_tps"] for x in systems], ".1f"))
    out.append(row("ms in graphs", [s[x]["graph_ms"] for x in systems], ".1f"))
    out.append(row("ms outside graphs", [s[x]["rest_ms"] for x in systems], ".1f"))
    out.append("| drafted / accepted (all reps) | " + " | ".join(f"{s[x]['draft'][0]} / {s[x]['draft'][1]}" for x in systems)
               + (" | |" if len(systems) > 1 else " |"))
    keys = sorted({k for x in systems for k in s[x]["groups"]}, key=lambda k: (k[0] != "target", k[0], k[1]))
    out += ["", f"| graph | rows | {' | '.join(f'{x}: per request × ms' for x in systems)} |"
            + (" ms ratio |" if len(systems) > 1 else ""),
            "|---|---|" + "---|" * (len(systems) + (len(systems) > 1))]
    for k in keys:
        cells = [s[x]["groups"].get(k) for x in systems]
        txt = " | ".join(f"{c[0]:.2f} × {c[1]:.3f}" if c else "—" for c in cells)
        ratio = ""
        if len(systems) > 1:
            ratio = f" | {cells[0][1] / cells[1][1]:.3f}" if cells[0] and cells[1] else " | —"
        out.append(f"| {k[0]} | {k[1]} | {txt}{ratio} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=str(ROOT / "build" / "peers" / "cmake" / "bin" / "llama-server"))
    ap.add_argument("--specrun", default=str(Path(sys.executable).with_name("specrun")))
    ap.add_argument("--workload", default="code-rewrite-smollm2")
    ap.add_argument("--setting", default="ngram-simple n3 m16")
    ap.add_argument("--systems", default="specrun,llama-server exact")
    ap.add_argument("--also", action="append", default=[], metavar="SPEC",
                    help='one more specrun server: leading NAME=VALUE words its environment, the rest its extra flags')
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--out", default=str(RESULTS / "pass_times.json"))
    ap.add_argument("--from-json", help="render an earlier run's JSON instead of measuring")
    args = ap.parse_args(argv)
    args.systems = [x.strip() for x in args.systems.split(",") if x.strip()] + [f"specrun {a}" for a in args.also]
    bad = ({args.workload} - {w.name for w in WORKLOADS}) | ({args.setting} - {s.name for s in SETTINGS}) \
        | ({x for x in args.systems if not x.startswith("specrun ")} - set(SYSTEMS))
    if bad:
        ap.error(f"unknown workload, setting or system: {', '.join(sorted(bad))}")
    for a in args.also:
        try:
            shlex.split(a)
        except ValueError as e:
            ap.error(f"--also {a!r}: {e}; quote it as a shell would, e.g. --also \"GOMP_SPINCOUNT=1e7 --no-fast-prefill\"")
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        if any(not x.startswith("specrun") for x in args.systems) and not Path(args.llama_server).is_file():
            ap.error(f"no llama-server at {args.llama_server}: `make peers-server` builds it")
        commit, dirty = git_state()
        try:
            requests = run(args)
        except (ServerFailed, RuntimeError) as e:
            sys.exit(f"pass_times: {e}")
        data = {"meta": {"commit": commit, "dirty": dirty, "cpu": cpu_model(), "cores": os.cpu_count(),
                         "date": date.today().isoformat(), "workload": args.workload, "setting": args.setting,
                         "reps": args.reps, "n_predict": args.n_predict, "threads": args.threads, "ctx": args.ctx},
                "requests": requests}
    write_results(args.from_json or args.out, data, markdown(data))


if __name__ == "__main__":
    main()
