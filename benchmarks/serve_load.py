"""Many clients at once: specrun serve beside llama-server at -np 1, 2, 4 and 8 (issue 49).

    python benchmarks/serve_load.py [--models gemma-3-270m,smollm2-135m-instruct] [--clients 1,2,4,8]
        [--systems specrun,llama-server] [--settings none,ngram] [--mix default|repetitive] [--reps 1] [-n 128]
        [--requests 8] [--label latest] [--out benchmarks/results/serve_load.json]
    python benchmarks/serve_load.py --quick          # a smoke run: one model, 1 and 2 clients, 16 tokens
    python benchmarks/serve_load.py --from-json benchmarks/results/serve_load.json   # re-render, no run

For each model, setting and client count c, both servers start with -np c (specrun's -c is a
slot's context, llama-server's is all slots' together: -c CTX*c, so each slot holds CTX), both up
at once, each idle but for the phase measured. A phase sends --requests /completion requests (a
fixed mix of prompts from benchmarks/prompts/, the same list for every c and both systems; greedy,
n_predict -n, cache_prompt false) through c client threads: each client sends its next request as
soon as its last one answered, so c requests are in flight until the list runs out. Per client
count: one warm-up of c requests at once (8 tokens), then --reps phases on each server, who goes
first alternating rep by rep, so the machine's drift in speed meets both systems alike.

Threads: llama-server gets -t THREADS; specrun gets LLAMA_ARG_THREADS=THREADS and no -t, its own
default for the whole server (-cb: the batched context has them all; -nocb divides them between the
slots). Settings:
`none`, and `ngram`, each system's best n-gram setting in benchmarks/results/peers.md: ngram-simple
size-n 3, size-m 16, n-max 16, the same flags to both (peers.py's `ngram-simple n3 m16`).

Per phase: aggregate tokens/s = all requests' generated tokens (the servers' predicted_n) / the
phase's wall time, first request sent to last answer; request latency = the client's time from
sending a request to its whole answer. A cell shows the median over reps of tokens/s, and p50 /
p95 latency over every request of its reps. `= alone` counts the requests whose text equals the
same system's text of that prompt at 1 client, `none` (the request served alone, no speculation);
the cross-system line under each table compares the two systems' alone texts. Other work on the
machine while a phase ran (the share of all CPUs, less the server's own) is in the JSON.

The JSON keeps runs by --label ("before", "after"): a run replaces only its own label, so the
markdown can show a change's effect beside the run before it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from exact_peers import EXACT_ENV, EXACT_FLAGS  # noqa: E402
from peers import (  # noqa: E402
    DOCS,
    LOGS,
    PROMPTS,
    RESULTS,
    ROOT,
    ServerFailed,
    complete,
    cpu_model,
    cpu_ticks,
    free_port,
    git_state,
    http,
    last_error,
    model_path,
    others_share,
    replace_block,
    serving,
    wait_quiet,
    write_results,
)

# specrun-nocb: specrun serve -nocb, an engine per slot with the threads divided (serve's -np before the
# batched decode); at 1 client it is the same server as specrun's, so it runs from 2 clients on.
# llama-server-exact: llama-server with exact mode's flags (exact_peers.py): what exactness costs it.
SYSTEMS = ("specrun", "specrun-nocb", "llama-server", "llama-server-exact")
DEFAULT_SYSTEMS = SYSTEMS[:3]
MODELS = ("gemma-3-270m", "smollm2-135m-instruct")
# peers.py's `ngram-simple n3 m16`: llama-server's fastest n-gram setting on 6 of its 9 workloads (peers.md)
SETTINGS = {
    "none": ("--spec-type", "none"),
    "ngram": ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16",
              "--spec-draft-n-max", "16"),
}
# The prompts each model's clients send, in this order. Each is meant to be under 512 tokens: specrun's
# fast prompt context keeps whole 512-token blocks of earlier prompts, which cache_prompt false does not
# clear. json_table.txt is 582 of Gemma's tokens (556 of SmolLM2's), so its first block can be reused.
MIXES = {
    "gemma-3-270m": ("free.txt", "code_rewrite.txt", "json_table.txt", "summary_quotes.txt"),
    "smollm2-135m-instruct": ("summary_quotes.txt", "chat_reuse.txt", "code_rewrite.txt", "free.txt"),
}
# --mix repetitive: the peers workloads whose answers copy their prompt (n-grams pay there), the
# same three for both models, each under 512 tokens
REPETITIVE = ("code_rewrite.txt", "summary_quotes.txt", "chat_reuse.txt")
MIX_SETS = {"default": MIXES, "repetitive": {m: REPETITIVE for m in MIXES}}
WARMUP_TOKENS = 8
BEGIN, END = "<!-- serve-load:begin -->", "<!-- serve-load:end -->"   # docs/benchmarks.md's block (--docs)


# ---- measuring ------------------------------------------------------------------------------------


def phase(url: str, pid: int, prompts: list[tuple[str, str]], clients: int, n_predict: int) -> dict:
    """The requests of `prompts` (name, text), in this order, through `clients` threads that each take
    the next one as soon as their last one answered. Returns the phase's wall time, the other work's
    share of the CPUs while it ran, and one record per request (in `prompts`' order)."""
    out: list[dict] = [{} for _ in prompts]
    errors: list[BaseException] = []
    lock = threading.Lock()
    todo = iter(range(len(prompts)))
    t0 = 0.0

    def client(cid: int) -> None:
        while not errors:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            name, text = prompts[i]
            start = time.monotonic()
            try:
                r = complete(url, text, n_predict)
            except (ServerFailed, OSError) as e:   # OSError: the connection died with the server
                errors.append(e)
                return
            end = time.monotonic()
            out[i] = {"prompt": name, "client": cid, "start_s": start - t0, "latency_s": end - start, **r}

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    before = cpu_ticks(), cpu_ticks(pid)
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    busy = others_share(before, (cpu_ticks(), cpu_ticks(pid)))
    if errors:
        raise errors[0] if isinstance(errors[0], ServerFailed) else ServerFailed(f"{type(errors[0]).__name__}: "
                                                                               f"{errors[0]}")
    return {"wall_s": wall, "others_busy": busy, "requests": out}


def warm_up(url: str, prompts: list[tuple[str, str]], clients: int) -> None:
    """`clients` requests at once, WARMUP_TOKENS tokens each: every slot has decoded once."""
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            complete(url, prompts[i % len(prompts)][1], WARMUP_TOKENS)
        except (ServerFailed, OSError) as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise ServerFailed(f"warm-up: {errors[0]}")


def server_command(system: str, model: str, path: str, setting: str, clients: int, port: int, args) -> list[str]:
    common = ["-np", str(clients), "--host", "127.0.0.1", "--port", str(port), *SETTINGS[setting]]
    if system.startswith("specrun"):
        nocb = ["-nocb"] if system == "specrun-nocb" else []
        return [args.specrun, "serve", "-m", model, "-c", str(args.ctx), *nocb, *common]
    env, flags = (EXACT_ENV, EXACT_FLAGS) if system == "llama-server-exact" else ((), ())
    return [*env, args.llama_server, "-m", path, *flags, "-t", str(args.threads), "-c", str(args.ctx * clients),
            *common]


def slot_ctx(url: str) -> int | None:
    """A slot's context as the server reports it (/props default_generation_settings.n_ctx)."""
    try:
        status, d = http(url + "/props", timeout=30)
    except OSError:
        return None
    return d.get("default_generation_settings", {}).get("n_ctx") if status == 200 else None


def measure_cell(model: str, path: str, setting: str, clients: int, systems: list[str], mix: list[tuple[str, str]],
                 args, texts: dict[str, str]) -> tuple[list[dict], list[dict]]:
    """Both servers up with -np `clients`, a warm-up each, then --reps phases on each, who goes first
    alternating. A server that fails keeps the phases it finished; the other goes on. Returns (the
    phases, one record per server)."""
    prompts = [mix[i % len(mix)] for i in range(args.requests)]
    systems = [s for s in systems if not (s == "specrun-nocb" and clients == 1)]
    tag = f"{model}-{setting}-np{clients}"
    cmds = {s: server_command(s, model, path, setting, clients, free_port(), args) for s in systems}
    logs = {s: LOGS / f"serve_load-{s}-{tag}.log" for s in systems}
    env_before = os.environ.get("LLAMA_ARG_THREADS")
    busy = wait_quiet(args.max_busy, args.wait_quiet)
    print(f"[serve_load] {model} / {setting} / {clients} client{'s' * (clients > 1)} (others busy {busy:.0%}, "
          f"load {os.getloadavg()[0]:.2f})", file=sys.stderr, flush=True)
    servers = {s: {"model": model, "setting": setting, "clients": clients, "system": s, "command": cmds[s],
                   "slot_ctx": None, "error": None} for s in systems}
    phases: list[dict] = []

    def failed(s: str, e: Exception) -> None:
        servers[s]["error"] = f"{e}; log: {last_error(logs[s])}" if logs[s].is_file() else str(e)
        print(f"[serve_load]   {s} failed: {servers[s]['error']} (see {logs[s]})", file=sys.stderr, flush=True)

    os.environ["LLAMA_ARG_THREADS"] = str(args.threads)      # both children: specrun's threads, llama-server's too
    try:
        with ExitStack() as stack:
            live = {}
            for s in systems:
                try:
                    live[s] = stack.enter_context(serving(cmds[s], logs[s]))
                    servers[s]["slot_ctx"] = slot_ctx(live[s][0])
                    warm_up(live[s][0], prompts, clients)
                except (ServerFailed, OSError) as e:
                    failed(s, e)
                    live.pop(s, None)
            for rep in range(args.reps):
                for s in (systems if rep % 2 == 0 else systems[::-1]):
                    if s not in live or servers[s]["error"]:
                        continue
                    url, pid = live[s]
                    try:
                        ph = phase(url, pid, prompts, clients, args.n_predict)
                    except (ServerFailed, OSError) as e:
                        failed(s, e)
                        continue
                    for r in ph["requests"]:                 # texts stored once, by hash
                        key = hashlib.sha1(r["text"].encode()).hexdigest()[:12]
                        texts[key] = r.pop("text")
                        r["text_id"] = key
                    tokens = sum(r["predicted_n"] for r in ph["requests"])
                    phases.append({"model": model, "setting": setting, "clients": clients, "system": s, "rep": rep,
                                   "tokens": tokens, "tok_s": tokens / ph["wall_s"], **ph})
                    lat = sorted(r["latency_s"] for r in ph["requests"])
                    print(f"[serve_load]   rep {rep + 1} {s}: {tokens / ph['wall_s']:.1f} tok/s, {tokens} tokens in "
                          f"{ph['wall_s']:.1f} s, latency p50 {percentile(lat, 50):.2f} s p95 {percentile(lat, 95):.2f} s, "
                          f"other work {ph['others_busy']:.0%}", file=sys.stderr, flush=True)
    finally:
        if env_before is None:
            os.environ.pop("LLAMA_ARG_THREADS", None)
        else:
            os.environ["LLAMA_ARG_THREADS"] = env_before
    return phases, list(servers.values())


def run(args, save=None) -> dict:
    commit, dirty = git_state()
    version = ""
    if any(s.startswith("llama-server") for s in args.systems):
        v = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, timeout=60)
        version = next((ln for ln in (v.stdout + v.stderr).splitlines() if ln.startswith("version")), "")
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit, "dirty": dirty,
            "cpu": cpu_model(), "cores": os.cpu_count(), "llama_server_version": version, "threads": args.threads,
            "ctx_per_slot": args.ctx, "n_predict": args.n_predict, "requests": args.requests, "reps": args.reps,
            "clients": args.clients, "settings": {s: " ".join(SETTINGS[s]) for s in args.settings},
            "mix": args.mix, "mixes": {m: [f"benchmarks/prompts/{f}" for f in MIX_SETS[args.mix][m]] for m in args.models}}
    phases: list[dict] = []
    servers: list[dict] = []
    texts: dict[str, str] = {}
    for model in args.models:
        path = model_path(args.specrun, model)
        mix = [(f, (PROMPTS / f).read_text(encoding="utf-8")) for f in MIX_SETS[args.mix][model]]
        for setting in args.settings:
            for c in args.clients:
                ph, sv = measure_cell(model, path, setting, c, args.systems, mix, args, texts)
                phases += ph
                servers += sv
                if save:                                 # what is measured so far survives a stopped run
                    save({"meta": meta, "servers": servers, "phases": phases, "texts": texts})
    return {"meta": meta, "servers": servers, "phases": phases, "texts": texts}


# ---- the table (pure) -----------------------------------------------------------------------------


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile of xs, linear between the closest ranks (numpy's default)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def alone_texts(run: dict) -> dict[tuple[str, str, str], str]:
    """(model, system, prompt) -> the text id of that prompt at 1 client, `none` (its first rep)."""
    out: dict[tuple[str, str, str], str] = {}
    for p in run["phases"]:
        if p["clients"] == 1 and p["setting"] == "none":
            for r in p["requests"]:
                out.setdefault((p["model"], p["system"], r["prompt"]), r["text_id"])
    for (model, system, prompt), t in list(out.items()):      # -nocb at 1 client is specrun's server
        if system == "specrun":
            out.setdefault((model, "specrun-nocb", prompt), t)
    return out


def summarize(run: dict) -> list[dict]:
    """One row per (model, setting, clients, system): median tokens/s over reps, p50 / p95 latency
    over all their requests, and how many requests' texts equal the alone text (None: no alone run)."""
    ref = alone_texts(run)
    groups: dict[tuple, list[dict]] = {}
    for p in run["phases"]:
        groups.setdefault((p["model"], p["setting"], p["clients"], p["system"]), []).append(p)
    rows = []
    for (model, setting, clients, system), ps in groups.items():
        reqs = [r for p in ps for r in p["requests"]]
        lat = [r["latency_s"] for r in reqs]
        refs = [ref.get((model, system, r["prompt"])) for r in reqs]
        drafted = sum(r.get("draft_n") or 0 for r in reqs)
        accepted = sum(r.get("draft_n_accepted") or 0 for r in reqs)
        rows.append({"model": model, "setting": setting, "clients": clients, "system": system,
                     "tok_s": statistics.median(p["tok_s"] for p in ps), "tok_s_rep": {p["rep"]: p["tok_s"] for p in ps},
                     "p50_s": percentile(lat, 50), "p95_s": percentile(lat, 95), "requests": len(reqs),
                     "equal_alone": None if None in refs else sum(r["text_id"] == t for r, t in zip(reqs, refs,
                                                                                                     strict=True)),
                     "reused": sum(r["prompt_n"] < (r.get("tokens_evaluated") or 0) - 1 for r in reqs),
                     "acceptance": accepted / drafted if drafted else None,
                     "others_busy": max(p["others_busy"] for p in ps)})
    return rows


def _f(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def paired(a: dict | None, b: dict | None) -> list[float]:
    """a's tok/s over b's, rep by rep (the two phases of a rep ran back to back, so a drift in the
    machine's speed between reps cancels); [] when they share no rep."""
    if not a or not b:
        return []
    return [a["tok_s_rep"][r] / b["tok_s_rep"][r] for r in sorted(a["tok_s_rep"]) if r in b["tok_s_rep"]]


def _pairs(xs: list[float]) -> str:
    """The median of paired ratios, with their range when there are several."""
    if not xs:
        return "—"
    med = f"{statistics.median(xs):.2f}"
    return med if len(xs) == 1 else f"{med} ({min(xs):.2f}–{max(xs):.2f})"


def table(run: dict) -> list[str]:
    m = run["meta"]
    rows = summarize(run)
    by = {(r["model"], r["setting"], r["clients"], r["system"]): r for r in rows}
    dirty = f", with uncommitted changes in {', '.join(m['dirty'])}" if m["dirty"] else ""
    out = [f"Measured {m['date']} at commit `{m['commit']}`{dirty}; {m['cpu']}, {m['cores']} cores; llama-server "
           f"`{m['llama_server_version'] or '?'}`. Both servers up at once with -np = clients, each idle but for "
           f"the phase measured; {m['threads']} threads for each server, context {m['ctx_per_slot']} per slot, "
           f"greedy, n_predict {m['n_predict']}, cache_prompt false; a phase is {m['requests']} requests "
           f"of the mix below, {m['reps']} rep{'s' * (m['reps'] > 1)} a cell. tok/s: all generated tokens / the phase's wall time "
           "(median over reps); p50 / p95: request latency in seconds, over every request of the cell; `= alone`: "
           "requests whose text equals the same system's text at 1 client, `none`."
           + (f" Measured again: {m['rerun']}." if m.get("rerun") else ""), "",
           "`-nocb`: specrun serve -nocb, an engine per slot (the -np before the batched decode). "
           "`÷` columns: specrun (batched) over llama-server, and over -nocb. `÷ by rep`: specrun's tok/s over "
           "llama-server's in each rep (their phases ran back to back), the median (min–max).", "",
           "| model | setting | clients | specrun tok/s | p50 | p95 | = alone | -nocb tok/s | p95 | = alone "
           "| llama-server tok/s | p50 | p95 | = alone | tok/s ÷ | ÷ by rep | p95 ÷ | tok/s ÷ -nocb |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cells = dict.fromkeys((r["model"], r["setting"], r["clients"]) for r in rows)
    for model, setting, clients in cells:
        a, n, b = (by.get((model, setting, clients, s)) for s in DEFAULT_SYSTEMS)
        line = [model, setting, str(clients)]
        for r, cols in ((a, 4), (n, 3), (b, 4)):
            eq = r and ("—" if r["equal_alone"] is None else f"{r['equal_alone']}/{r['requests']}")
            line += ([f"{r['tok_s']:.1f}", f"{r['p50_s']:.2f}", f"{r['p95_s']:.2f}", eq][4 - cols:] if cols == 4
                     else [f"{r['tok_s']:.1f}", f"{r['p95_s']:.2f}", eq]) if r else ["—"] * cols
        line += [_f(a["tok_s"] / b["tok_s"] if a and b else None, ".2f"), _pairs(paired(a, b)),
                 _f(a["p95_s"] / b["p95_s"] if a and b else None, ".2f"),
                 _f(a["tok_s"] / n["tok_s"] if a and n else None, ".2f")]
        out.append("| " + " | ".join(line) + " |")
    pairs = [(by[(*k, "specrun")], by[(*k, "llama-server")]) for k in cells
             if (*k, "specrun") in by and (*k, "llama-server") in by]
    if pairs:
        spec = [(a, b) for a, b in pairs if a["setting"] != "none"]
        by_rep = [statistics.median(x) for x in (paired(a, b) for a, b in pairs) if x]
        out += ["", f"Issue 49's goals: specrun's tok/s ≥ llama-server's at {sum(a['tok_s'] >= b['tok_s'] for a, b in pairs)} "
                    f"of {len(pairs)} rows" + (f" (≥ 1.2× with n-gram drafts at {sum(a['tok_s'] >= 1.2 * b['tok_s'] for a, b in spec)}"
                                               f" of {len(spec)})" if spec else "")
                + (f"; by rep (median of the paired ratios) at {sum(x >= 1 for x in by_rep)} of {len(by_rep)}"
                   if m["reps"] > 1 and by_rep else "")
                + f"; p95 no worse at {sum(a['p95_s'] <= b['p95_s'] for a, b in pairs)} of {len(pairs)}."]
    out += exact_table(by, cells)
    out += ["", "Prompt mixes (benchmarks/prompts/, sent in this order, again from the first):"]
    out += [f"- {model}: {', '.join(Path(f).name for f in fs)}" for model, fs in m["mixes"].items()]
    ref = alone_texts(run)
    for model in m["mixes"]:
        prompts = [Path(f).name for f in m["mixes"][model]]
        both = [p for p in prompts if (model, "specrun", p) in ref and (model, "llama-server", p) in ref]
        if both:
            same = [p for p in both if ref[(model, "specrun", p)] == ref[(model, "llama-server", p)]]
            out.append(f"- {model}: specrun's alone text = llama-server's on {len(same)} of {len(both)} prompts.")
    reused = [r for r in rows if r["reused"]]
    if reused:
        out.append("- Prompt tokens reused despite cache_prompt false: " + "; ".join(
            f"{r['system']} {r['model']} {r['setting']} {r['clients']} clients: {r['reused']} requests" for r in reused)
                   + ".")
    busy = [p["others_busy"] for p in run["phases"]]
    if busy:
        out.append(f"- Other work on the machine while a phase ran: median {statistics.median(busy):.0%} of the CPUs, "
                   f"at most {max(busy):.0%}.")
    failed = [sv for sv in run["servers"] if sv.get("error")]
    if failed:
        out.append("- Failed: " + "; ".join(f"{sv['system']} {sv['model']} {sv['setting']} -np {sv['clients']}: "
                                           f"{sv['error']}" for sv in failed) + ".")
    return out


def exact_table(by: dict, cells) -> list[str]:
    """Where llama-server also ran with exact mode's flags: the three side by side."""
    keys = [k for k in cells if (*k, "llama-server-exact") in by]
    if not keys:
        return []
    out = ["", "`llama-server-exact`: llama-server with exact mode's flags (`-nr -ctk q8_0`, `GGML_CPU_TILED_MM=0`), "
               "the kernels that make its batched rows equal its one-token rows, as specrun's are.", "",
           "| model | setting | clients | specrun tok/s | llama-server | llama-server-exact | p95 | = alone "
           "| specrun ÷ exact | llama-server ÷ exact |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k in keys:
        a, b, x = (by.get((*k, s)) for s in ("specrun", "llama-server", "llama-server-exact"))
        eq = "—" if x["equal_alone"] is None else f"{x['equal_alone']}/{x['requests']}"
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {_f(a and a['tok_s'], '.1f')} | {_f(b and b['tok_s'], '.1f')} "
                   f"| {x['tok_s']:.1f} | {x['p95_s']:.2f} | {eq} | {_f(a and a['tok_s'] / x['tok_s'], '.2f')} "
                   f"| {_f(b and b['tok_s'] / x['tok_s'], '.2f')} |")
    return out


def compare(before: dict, after: dict) -> list[str]:
    """specrun's tok/s and p95 in two runs, and its ratio to llama-server in each."""
    a_rows = {(r["model"], r["setting"], r["clients"], r["system"]): r for r in summarize(before)}
    b_rows = {(r["model"], r["setting"], r["clients"], r["system"]): r for r in summarize(after)}
    keys = [k[:3] for k in b_rows if k[3] == "specrun" and k in a_rows]
    if not keys:
        return []
    out = ["| model | setting | clients | specrun tok/s before | after | after ÷ before | p95 before | after "
           "| ÷ llama-server before | after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k in keys:
        x, y = a_rows[(*k, "specrun")], b_rows[(*k, "specrun")]
        lx, ly = a_rows.get((*k, "llama-server")), b_rows.get((*k, "llama-server"))
        out.append(f"| {k[0]} | {k[1]} | {k[2]} | {x['tok_s']:.1f} | {y['tok_s']:.1f} | {y['tok_s'] / x['tok_s']:.2f} "
                   f"| {x['p95_s']:.2f} | {y['p95_s']:.2f} | {_f(lx and x['tok_s'] / lx['tok_s'], '.2f')} "
                   f"| {_f(ly and y['tok_s'] / ly['tok_s'], '.2f')} |")
    return out


def markdown(data: dict, level: int = 1) -> str:
    """The results page (level 1: with its title) or docs/benchmarks.md's block (level 3: run headings only)."""
    runs = data["runs"]
    h = "#" * max(level, 2)
    out = ["# specrun serve beside llama-server at 1 to 8 clients (benchmarks/serve_load.py)", ""] if level == 1 else []
    if "before" in runs and "after" in runs:
        out += [f"{h} specrun after against before", ""] + compare(runs["before"], runs["after"]) + [""]
    for label, run in runs.items():
        out += [f"{h} {label}", ""] + table(run) + [""]
    return "\n".join(out)


# ---- the command line -----------------------------------------------------------------------------


def _list(ap: argparse.ArgumentParser, opt: str, value: str, known: tuple[str, ...] | None = None) -> list[str]:
    names = [x.strip() for x in value.split(",") if x.strip()]
    if not names:
        ap.error(f"{opt}: empty; give a comma-separated list")
    if known is not None and set(names) - set(known):
        ap.error(f"{opt}: unknown {', '.join(sorted(set(names) - set(known)))} (known: {', '.join(known)})")
    return list(dict.fromkeys(names))


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--llama-server", default=str(ROOT / "build" / "peers" / "cmake" / "bin" / "llama-server"))
    ap.add_argument("--specrun", default=str(Path(sys.executable).with_name("specrun")))
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MIXES)}")
    ap.add_argument("--clients", default="1,2,4,8", help="comma-separated client counts (each server: -np that)")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    ap.add_argument("--mix", choices=tuple(MIX_SETS), default="default",
                    help="the prompts: default (MIXES), or repetitive (answers that copy their prompt)")
    ap.add_argument("--reps", type=int, default=1, help="phases per server and client count")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--requests", type=int, default=8, help="requests a phase sends (at least the most clients)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of each server (default: all cores)")
    ap.add_argument("--ctx", type=int, default=2048, help="context of one slot")
    ap.add_argument("--max-busy", type=float, default=0.25,
                    help="before each client count, wait until other work uses at most this share of the CPUs")
    ap.add_argument("--wait-quiet", type=float, default=60, help="seconds to wait for that, at most (then run)")
    ap.add_argument("--label", default="latest", help="the run's name in the JSON (before, after); other labels stay")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: gemma-3-270m, 1 and 2 clients, none, 16 tokens, 2 requests, to build/peers/")
    ap.add_argument("--out", help="JSON; the markdown goes next to it (default: benchmarks/results/serve_load.json)")
    ap.add_argument("--docs", action="store_true", help=f"put the tables between {BEGIN} and {END} in docs/benchmarks.md")
    ap.add_argument("--from-json", help="render an earlier run's JSON (its .md next to it) instead of measuring")
    args = ap.parse_args(argv)
    if args.quick:
        args.models, args.clients, args.settings = "gemma-3-270m", "1,2", "none"
        args.n_predict, args.requests, args.reps = 16, 2, 1
        args.out = args.out or str(ROOT / "build" / "peers" / "serve_load_quick.json")
    args.out = args.out or str(RESULTS / "serve_load.json")
    args.models = _list(ap, "--models", args.models, tuple(MIXES))
    args.settings = _list(ap, "--settings", args.settings, tuple(SETTINGS))
    args.systems = [s for s in SYSTEMS if s in _list(ap, "--systems", args.systems, SYSTEMS)]
    try:
        args.clients = sorted({int(c) for c in _list(ap, "--clients", args.clients)})
    except ValueError:
        ap.error(f"--clients: {args.clients!r} is not a comma-separated list of integers")
    for opt, value, low in (("--clients", min(args.clients), 1), ("--reps", args.reps, 1), ("-n", args.n_predict, 1),
                            ("--requests", args.requests, 1), ("--threads", args.threads, 1), ("--ctx", args.ctx, 256)):
        if value < low:
            ap.error(f"{opt}: {value} is below {low}")
    if max(args.clients) > 64:
        ap.error(f"--clients: {max(args.clients)} is above 64, specrun serve's most slots")
    if args.requests < max(args.clients):
        ap.error(f"--requests {args.requests} is fewer than --clients {max(args.clients)}: some clients would idle; "
                 f"give --requests {max(args.clients)} or more")
    if not 0 <= args.max_busy <= 1:
        ap.error(f"--max-busy: {args.max_busy} is not a share between 0 and 1")
    if args.quick and args.docs:
        ap.error("--quick with --docs: a smoke run's table does not go into the docs; leave one out")
    if args.from_json and not Path(args.from_json).is_file():
        ap.error(f"--from-json: no file {args.from_json}")
    if not args.from_json:
        if any(s.startswith("llama-server") for s in args.systems) and not Path(args.llama_server).is_file():
            ap.error(f"no llama-server at {args.llama_server}: `make peers-server` builds it "
                     "(or --systems specrun)")
        if "specrun" in args.systems and not Path(args.specrun).is_file():
            ap.error(f"no specrun at {args.specrun}: `make install` installs it, or give --specrun PATH")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # stop the running servers on the way out
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        out = Path(args.from_json)
    else:
        out = Path(args.out)
        old = json.loads(out.read_text()) if out.is_file() else {}
        data = {"runs": {k: v for k, v in old.get("runs", {}).items() if k != args.label}}
        out.parent.mkdir(parents=True, exist_ok=True)

        def save(partial: dict) -> None:
            data["runs"][args.label] = partial
            out.write_text(json.dumps(data, indent=1) + "\n")

        data["runs"][args.label] = run(args, save)
    write_results(out, data, markdown(data))
    if args.docs:                                   # only this benchmark's block: the other tables stay
        DOCS.write_text(replace_block(DOCS.read_text(encoding="utf-8"), markdown(data, level=3), BEGIN, END),
                        encoding="utf-8")
        print(f"[serve_load] {DOCS.relative_to(ROOT)}: the table between {BEGIN} and {END} replaced", file=sys.stderr)


if __name__ == "__main__":
    main()
