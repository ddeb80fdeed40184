"""Text or engine: specrun beside llama-server twice, with llama.cpp's defaults and with exact mode's flags.

    python benchmarks/exact_peers.py [--workloads free,code-rewrite,...] [--settings none,ngram-simple,...]
        [--reps 3] [--out benchmarks/results/exact_peers.json]

On a workload where llama-server's greedy text differs from specrun's (the peers table's `none text
identical` line), the two systems' n-gram speed-ups are measured on two texts: an n-gram drafter's
acceptance is decided by how much of the text copies earlier text. Exact mode's flags make
llama-server's one-token and batched logits bit-identical as specrun's are (../shared notes: no
repacked weights `-nr`, a Q8_0 K cache `-ctk q8_0`, llama.cpp's tiled K-quant matmul off
`GGML_CPU_TILED_MM=0`), so that llama-server writes specrun's text, and its drafts are specrun's.
This runs three systems on the same requests: specrun, llama-server, and llama-server with those
flags ("llama-server exact"); every server of a model is up at once (one per system and setting),
and the requests of a round go to each in turn, in an order that rotates round by round, after
peers.py's flush. Medians of --reps after a warm-up; `× none` against the same system's `none`.
specrun's `auto` runs beside them; its verdicts are against each llama-server's best of
peers.PEER_SETTINGS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from datetime import date
from pathlib import Path

from peers import (
    LOGS,
    PEER_SETTINGS,
    PROMPTS,
    RESULTS,
    ROOT,
    SETTINGS,
    WORKLOADS,
    ServerFailed,
    Setting,
    best_peer,
    cpu_model,
    free_port,
    git_state,
    measure,
    model_path,
    server_command,
    serving,
    summarize,
    write_results,
)

EXACT_FLAGS = ("-nr", "-ctk", "q8_0")
EXACT_ENV = ("env", "GGML_CPU_TILED_MM=0")     # env execs: the pid stays the server's
SYSTEMS = ("specrun", "llama-server", "llama-server exact")
# where the peers run at b056f7d found llama-server's `none` text different from specrun's
DEFAULT_WORKLOADS = ("free", "code-rewrite", "verbatim", "json-table", "chat-reuse", "code-rewrite-smollm2")


def command(system: str, model: str, path: str, setting: Setting, args) -> list[str]:
    """peers' server command; llama-server exact is llama-server's with EXACT_FLAGS after -m PATH."""
    if system != "llama-server exact":
        return server_command(system, model, path, setting, free_port(), args)
    server, m, p, *rest = server_command("llama-server", model, path, setting, free_port(), args)
    return [*EXACT_ENV, server, m, p, *EXACT_FLAGS, *rest]


def run(args) -> list[dict]:
    """Every request measured: peers.measure's record with model, workload, setting, system, rep."""
    named = {w.name: w for w in WORKLOADS}
    texts = {w: (PROMPTS / named[w].file).read_text(encoding="utf-8") for w in args.workloads}
    out: list[dict] = []
    for model in dict.fromkeys(named[w].model for w in args.workloads):
        path = model_path(args.specrun, model)
        mine = [w for w in args.workloads if named[w].model == model]
        servers = [(sys_, s) for s in SETTINGS if s.name in args.settings
                   for sys_ in SYSTEMS if sys_ == "specrun" or s.name != "auto"]
        with contextlib.ExitStack() as stack:
            live = {}
            for sys_, s in servers:
                log = LOGS / f"exact-{sys_.replace(' ', '_')}-{model}-{s.name.replace(' ', '_')}.log"
                live[(sys_, s.name)] = stack.enter_context(serving(command(sys_, model, path, s, args), log))
            keys = list(live)
            for rep in range(-1, args.reps):
                order = keys[rep % len(keys):] + keys[:rep % len(keys)]
                for w in mine:
                    for sys_, setting in order:
                        url, pid = live[(sys_, setting)]
                        r = measure(url, pid, texts[w], f"{w} {sys_} {setting}", rep, args)
                        if rep >= 0:
                            out.append({"model": model, "workload": w, "setting": setting, "system": sys_,
                                        "rep": rep, **r})
    return out


def markdown(data: dict) -> str:
    m, rows = data["meta"], summarize(data["requests"])
    by = {(r["workload"], r["setting"], r["system"]): r for r in rows}
    head = (f"Measured {m['date']} at commit `{m['commit']}`{' (uncommitted changes)' if m['dirty'] else ''}; {m['cpu']}, "
            f"{m['cores']} cores. Three systems on the same /completion requests (greedy, n_predict {m['n_predict']}, "
            f"{m['threads']} threads, context {m['ctx']}), every server of a model up at once, requests rotating; medians of {m['reps']} after a "
            "warm-up. *llama-server exact*: llama-server with exact mode's flags (`-nr -ctk q8_0`, `GGML_CPU_TILED_MM=0`). "
            "Each cell: tok/s, × that system's `none`, drafted / accepted over the reps.\n")
    out = [head, "| workload | setting | specrun | llama-server | llama-server exact | text |", "|---|---|---|---|---|---|"]

    def cell(r: dict | None) -> str:
        if r is None:
            return "—"
        acc = f", {r['drafted']} / {r['accepted']}" if r["drafted"] else ""
        return f"{r['gen_tps']:.1f}, {r['x_none']:.2f}×{acc}"

    verdicts = []
    for w in dict.fromkeys(r["workload"] for r in rows):
        sp_none = by.get((w, "none", "specrun"))
        for s in dict.fromkeys(r["setting"] for r in rows if r["workload"] == w):
            trio = [by.get((w, s, x)) for x in SYSTEMS]
            here = [(x, r) for x, r in zip(SYSTEMS, trio, strict=True) if r]
            same = [x for x, r in here if sp_none and r["text"] == sp_none["text"]]
            drift = [x for x, r in here if r["equal_none"] is False]
            note = f"specrun's `none` text: {', '.join(same) or 'none of them'}" + \
                (f"; not its own `none`'s: {', '.join(drift)}" if drift else "")
            out.append(f"| {w} | {s} | " + " | ".join(cell(r) for r in trio) + f" | {note} |")
        auto = by.get((w, "auto", "specrun"))
        for peer in SYSTEMS[1:]:
            best = best_peer(by, w, peer)
            if auto and best:
                verdicts.append(f"{w}: auto {auto['gen_tps']:.1f} ÷ {peer}'s best ({best['setting']}, "
                                f"{best['gen_tps']:.1f}) = {auto['gen_tps'] / best['gen_tps']:.2f}")
    return "\n".join(out + ["", *(f"- {v}" for v in verdicts)]) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=str(ROOT / "build" / "peers" / "cmake" / "bin" / "llama-server"))
    ap.add_argument("--specrun", default=str(Path(sys.executable).with_name("specrun")))
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    ap.add_argument("--settings", default=",".join((*PEER_SETTINGS, "auto")))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--max-busy", type=float, default=0.25)
    ap.add_argument("--retries", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "exact_peers.json"))
    ap.add_argument("--from-json", help="render an earlier run's JSON instead of measuring")
    args = ap.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.settings = [s for s in args.settings.split(",") if s]
    bad = set(args.workloads) - {w.name for w in WORKLOADS} | set(args.settings) - {s.name for s in SETTINGS}
    if bad:
        ap.error(f"unknown workload or setting: {', '.join(sorted(bad))}")
    if not args.from_json and not Path(args.llama_server).is_file():
        ap.error(f"no llama-server at {args.llama_server}: `make peers-server` builds it")
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        commit, dirty = git_state()
        try:
            requests = run(args)
        except ServerFailed as e:
            sys.exit(f"exact_peers: a server failed: {e}")
        data = {"meta": {"commit": commit, "dirty": dirty, "cpu": cpu_model(), "cores": os.cpu_count(),
                         "date": date.today().isoformat(), "reps": args.reps,
                         "n_predict": args.n_predict, "threads": args.threads, "ctx": args.ctx}, "requests": requests}
    write_results(args.from_json or args.out, data, markdown(data))
    if data["requests"]:
        print(f"[exact_peers] {len(data['requests'])} requests; median other work "
              f"{statistics.median(r['others_busy'] for r in data['requests']):.0%}", file=sys.stderr)


if __name__ == "__main__":
    main()
