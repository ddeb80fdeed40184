"""Suffix drafting on multi-request sessions where earlier answers recur (issue 50).

    python benchmarks/suffix_bench.py [--models smollm2-135m-instruct,gemma-3-270m]
        [--workloads agent-edit,tool-calls,chat-quotes,code-review] [--systems none,ngram-simple,...]
        [--reps 2] [-n 128] [--quick] [--docs]
    python benchmarks/suffix_bench.py --from-json benchmarks/results/suffix_bench.json --docs   # re-render

A workload is a session: a fixed list of requests sent in order to one server, greedy, n_predict
tokens each. Its prompts are built from the files under benchmarks/prompts/suffix/:

- agent-edit: a coding agent edits one file across turns. Each request holds the whole file and asks
  for the whole file back with one small change; the next request holds the file with that change
  made (the script makes it, from agent_edit_steps.json), so every system gets the same requests.
- tool-calls: requests to one assistant with the same two tool schemas, each asking for one JSON tool
  call with other arguments. Each request stands alone: earlier calls are in no prompt.
- chat-quotes: one conversation whose later turns ask the model to quote its own earlier answers.
  Each request carries the conversation so far with that system's own earlier answers, as a chat
  client does (specrun's answers must all equal `none`'s, so its requests do too).
- code-review: review rounds of one function; each round stands alone and holds the function after
  the author's last fix (review_fixes.json).

SmolLM2-135M-Instruct gets the requests as /v1/chat/completions messages (its chat template, with a
system message); Gemma 3 270M, a base model, as one /completion prompt (the system text, then
`User:` and `Assistant:` lines, stop at "\\nUser:").

Systems: specrun serve with `none`, `ngram-simple` (n3 m16, n-max 16: peers.py's best setting),
`ngram-mod` (llama.cpp's defaults) and `suffix` (its defaults, plus --suffix-args), and llama-server
with `ngram-simple` n3 m16 and `ngram-mod` (its best n-gram settings in results/spec_peers.md).
Every session starts a fresh server per system (nothing earlier in any drafter's memory), all up at
once on 127.0.0.1 (2 threads, one slot, context 4096); each server gets a warm-up request (8 tokens
of an unrelated prompt), then request i goes to each system in turn, in an order that rotates with
i and the rep, so a drift in the machine's speed meets every system alike. Prompt caching stays on
(llama-server's default; specrun reuses the slot's KV prefix).

Per model, workload and system: generated tokens/s over the session (Σ predicted_n / Σ predicted_ms,
from each server's `timings`), the median over --reps sessions; acceptance = Σ draft_n_accepted /
Σ draft_n over every request of every rep; `× none` and `× llama-server best` are the medians of the
per-rep ratios to specrun `none` and to llama-server's fastest system on that workload (each rep's
sessions ran side by side); `= none` whether every request's text equals specrun `none`'s in the same
rep. A specrun text that differs is a bug: the table lists each one (rep, request, character offset).
Writes benchmarks/results/suffix_bench.json (every request) and .md (the table); --docs puts the
table between docs/benchmarks.md's suffix-bench markers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass
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
    SETTINGS,
    ServerFailed,
    auto_line,
    chosen,
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

SUFFIX_PROMPTS = PROMPTS / "suffix"
BEGIN, END = "<!-- suffix-bench:begin -->", "<!-- suffix-bench:end -->"
WARMUP = "The capital of France is"
STOP = ("\nUser:",)                # /completion's stop strings (the base model would go on with the dialogue)
# the model's request shape: chat messages through its template, or one raw prompt
MODELS = {"smollm2-135m-instruct": "chat", "gemma-3-270m": "completion"}


@dataclass(frozen=True)
class System:
    name: str                      # --systems' name
    server: str                    # "specrun" | "llama-server"
    args: tuple[str, ...]          # its speculative flags
    exact: bool = False            # llama-server with exact mode's kernels (exact_peers.py): specrun's text

    @property
    def specrun(self) -> bool:
        return self.server == "specrun"


N3M16 = next(s for s in SETTINGS if s.name == "ngram-simple n3 m16").args
SYSTEMS = (
    System("none", "specrun", ("--spec-type", "none")),
    System("ngram-simple", "specrun", N3M16),
    System("ngram-mod", "specrun", ("--spec-type", "ngram-mod")),
    System("suffix", "specrun", ("--spec-type", "suffix")),                   # adaptive lengths: its default
    System("suffix-fixed", "specrun", ("--spec-type", "suffix", "--no-spec-draft-adaptive")),
    System("llama-server:ngram-simple", "llama-server", N3M16),
    System("llama-server:ngram-mod", "llama-server", ("--spec-type", "ngram-mod")),
    System("llama-server:none", "llama-server", ("--spec-type", "none")),
    # the same, on exact mode's kernels: its text is specrun's, so the ratio compares the drafters alone
    System("llama-server-exact:ngram-simple", "llama-server", N3M16, exact=True),
    System("llama-server-exact:ngram-mod", "llama-server", ("--spec-type", "ngram-mod"), exact=True),
    System("auto", "specrun", ("--spec-type", "auto")),
    # what serve's auto keeps on where no setting wins on its built-in prompt (an explicit twin of it)
    System("ngram-n2-adaptive", "specrun", ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "2",
                                            "--spec-ngram-simple-size-m", "16", "--spec-ngram-simple-match",
                                            "longest", "--spec-draft-adaptive")),
    # both copy drafters, adaptive: each step drafts from the one whose cut pays more
    System("ngram-n2+suffix", "specrun", ("--spec-type", "ngram-simple,suffix", "--spec-ngram-simple-size-n", "2",
                                          "--spec-ngram-simple-size-m", "16", "--spec-ngram-simple-match",
                                          "longest", "--spec-draft-adaptive")),
)
DEFAULT_SYSTEMS = ("none", "ngram-simple", "ngram-mod", "suffix", "suffix-fixed", "llama-server:ngram-simple",
                   "llama-server:ngram-mod")
LABELS = {"ngram-simple": "ngram-simple n3 m16", "suffix-fixed": "suffix --no-spec-draft-adaptive",
          "llama-server:ngram-simple": "llama-server ngram-simple n3 m16",
          "llama-server:ngram-mod": "llama-server ngram-mod", "llama-server:none": "llama-server none",
          "llama-server-exact:ngram-simple": "llama-server exact ngram-simple n3 m16",
          "llama-server-exact:ngram-mod": "llama-server exact ngram-mod",
          "ngram-n2-adaptive": "ngram-simple n2 m16 longest, adaptive",
          "ngram-n2+suffix": "ngram-simple n2 m16 longest + suffix, adaptive"}


@dataclass(frozen=True)
class Workload:
    name: str
    what: str
    system: str                    # the system message (chat) / the prompt's first paragraph (completion)
    users: tuple[str, ...]         # the session's user messages, in order
    history: bool                  # each request carries the earlier turns, with this system's own answers
    lead: str = ""                 # completion only: the text after "Assistant:" that the answer continues


# ---- the workloads: user messages from the files under benchmarks/prompts/suffix/ ---------------


def edited(text: str, step: dict) -> str:
    """`text` with a step's edit made: old -> new (once each), then each of step["also"]'s pairs
    everywhere. A step whose old text is not in `text` is a broken prompt file: ValueError."""
    for old, new, count in ((step["old"], step["new"], 1), *((o, n, -1) for o, n in step.get("also", ()))):
        if old:
            if old not in text:
                raise ValueError(f"{old!r} is not in the file: fix the steps file")
            text = text.replace(old, new, count)
    return text


def versions(start: str, steps: list[dict]) -> list[str]:
    """The file before each step: [start, start + step 0, ...], one per step."""
    out = [start]
    for step in steps[:-1]:
        out.append(edited(out[-1], step))
    return out


def fenced(code: str) -> str:
    return f"```python\n{code}```"


def lines(path: Path) -> tuple[str, ...]:
    return tuple(ln.strip() for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip())


def load_workloads() -> tuple[Workload, ...]:
    p = SUFFIX_PROMPTS
    steps = json.loads((p / "agent_edit_steps.json").read_text(encoding="utf-8"))
    files = versions((p / "agent_edit_start.py").read_text(encoding="utf-8"), steps)
    schema = json.loads((p / "tools_schema.json").read_text(encoding="utf-8"))
    fixes = json.loads((p / "review_fixes.json").read_text(encoding="utf-8"))
    rounds = [edited(c, f) for c, f in zip(versions((p / "review_start.py").read_text(encoding="utf-8"), fixes),
                                           fixes, strict=True)]
    return (
        Workload("agent-edit", "a coding agent edits ratelimit.py in 6 turns: the whole file in, the whole file out",
                 "You are a coding agent. You edit one file, ratelimit.py. Apply the requested change and reply "
                 "with the complete updated file in one ```python block, and nothing else.",
                 tuple(f"Here is ratelimit.py:\n\n{fenced(f)}\n\nChange: {s['ask']}" for f, s in zip(files, steps,
                                                                                                     strict=True)),
                 history=False, lead="```python\n"),
        Workload("tool-calls", "6 requests to one assistant with the same 2 tool schemas, one JSON call each",
                 "You are an order desk assistant. Answer every request with exactly one tool call, as JSON: "
                 '{"name": TOOL, "arguments": {...}}. The tools:\n\n' + json.dumps(schema, indent=1),
                 lines(p / "tools_requests.txt"), history=False),
        Workload("chat-quotes", "a 5-turn chat whose later turns quote the model's own earlier answers",
                 "You are a helpful assistant. You answer briefly and precisely.", lines(p / "chat_turns.txt"),
                 history=True),
        Workload("code-review", "5 review rounds of load_users(), each after the author's fix",
                 "You are a senior Python reviewer. List the problems in the code as numbered items, each with "
                 "the fix in one line.",
                 tuple(f"Review round {i + 1}. {f['note']}\n\n{fenced(c)}" for i, (c, f) in enumerate(zip(rounds, fixes,
                                                                                                          strict=True))),
                 history=False),
    )


def request_body(w: Workload, kind: str, i: int, answers: list[str], n_predict: int) -> tuple[str, dict]:
    """(endpoint, JSON body) of request i of session `w` for a model of `kind`; answers: this system's
    answers to requests 0 .. i-1 (used when w.history)."""
    earlier = [(w.users[j], answers[j]) for j in range(i)] if w.history else []
    if kind == "chat":
        msgs = [{"role": "system", "content": w.system}]
        for u, a in earlier:
            msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": a}]
        msgs.append({"role": "user", "content": w.users[i]})
        return "/v1/chat/completions", {"messages": msgs, "max_tokens": n_predict, "temperature": 0.0,
                                        "stream": False}
    turns = "".join(f"User: {u}\nAssistant: {a.strip()}\n" for u, a in earlier)
    prompt = f"{w.system}\n\n{turns}User: {w.users[i]}\nAssistant: {w.lead}"
    return "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "stop": list(STOP),
                           "stream": False}


# ---- running the sessions ------------------------------------------------------------------------


def ask(url: str, endpoint: str, body: dict) -> dict:
    status, d = http(url + endpoint, body)
    if status != 200:
        raise ServerFailed(f"POST {endpoint} answered {status}: {str(d)[:200]}")
    t = d.get("timings")
    if not t:
        raise ServerFailed(f"POST {endpoint}: no timings in the answer")
    text = d["choices"][0]["message"]["content"] if "choices" in d else d["content"]
    return {"text": text, "predicted_n": t["predicted_n"], "predicted_ms": t["predicted_ms"],
            "gen_tps": t["predicted_per_second"], "prompt_n": t["prompt_n"], "prompt_ms": t["prompt_ms"],
            "draft_n": t.get("draft_n") or 0, "draft_n_accepted": t.get("draft_n_accepted") or 0}


def command(s: System, model: str, path: str, port: int, args) -> list[str]:
    common = ["-t", str(args.threads), "-c", str(args.ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
    extra = tuple(shlex.split(args.suffix_args)) if s.name == "suffix" else ()
    if s.specrun:
        return [args.specrun, "serve", "-m", model, *common, *s.args, *extra]
    if s.exact:
        return [*EXACT_ENV, args.llama_server, "-m", path, *EXACT_FLAGS, *common, *s.args]
    return [args.llama_server, "-m", path, *common, *s.args]


def session(model: str, path: str, w: Workload, systems: list[System], rep: int, args) -> tuple[list[dict], list[dict]]:
    """One rep of one workload: every system's server started fresh, up at once, a warm-up each, then
    request i to each system in an order rotated by i + rep. A server that fails keeps no numbers
    from this session; the others go on. Returns (request records, one record per server)."""
    kind = MODELS[model]
    cmds = {s.name: command(s, model, path, free_port(), args) for s in systems}
    logs = {s.name: LOGS / f"suffix-{s.name.replace(':', '-')}-{model}-{w.name}.log" for s in systems}
    busy = wait_quiet(args.max_busy, args.wait_quiet)
    print(f"[suffix] {model} / {w.name} / rep {rep + 1} (others busy {busy:.0%}, load {os.getloadavg()[0]:.2f})",
          file=sys.stderr, flush=True)
    errors: dict[str, str | None] = {s.name: None for s in systems}
    records: dict[str, list[dict]] = {s.name: [] for s in systems}
    answers: dict[str, list[str]] = {s.name: [] for s in systems}

    def failed(name: str, e: Exception) -> None:       # OSError: the connection died with the server
        errors[name] = f"{e}" if isinstance(e, ServerFailed) else f"{type(e).__name__}: {e}; {last_error(logs[name])}"
        print(f"[suffix]   {name} failed: {errors[name]} (see {logs[name]})", file=sys.stderr, flush=True)

    with contextlib.ExitStack() as stack:
        live: dict[str, tuple[str, int]] = {}
        for s in systems:
            try:
                live[s.name] = stack.enter_context(serving(cmds[s.name], logs[s.name]))
                ask(live[s.name][0], "/completion", {"prompt": WARMUP, "n_predict": 8, "temperature": 0.0})
            except (ServerFailed, OSError) as e:
                failed(s.name, e)
        for i in range(len(w.users)):
            k = (i + rep) % len(systems)
            for s in systems[k:] + systems[:k]:
                if s.name not in live or errors[s.name]:
                    continue
                url, pid = live[s.name]
                endpoint, body = request_body(w, kind, i, answers[s.name], args.n_predict)
                before = cpu_ticks(), cpu_ticks(pid)
                try:
                    r = ask(url, endpoint, body)
                except (ServerFailed, OSError) as e:
                    failed(s.name, e)
                    continue
                r["others_busy"] = others_share(before, (cpu_ticks(), cpu_ticks(pid)))
                answers[s.name].append(r["text"])
                records[s.name].append({"model": model, "workload": w.name, "system": s.name, "rep": rep,
                                        "turn": i, **r})
                print(f"[suffix]   request {i + 1}/{len(w.users)} {s.name}: {r['predicted_n']} tokens, "
                      f"{r['gen_tps']:.1f} tok/s, {r['draft_n_accepted']} / {r['draft_n']} accepted, "
                      f"other work {r['others_busy']:.0%}", file=sys.stderr, flush=True)
    servers = [{"model": model, "workload": w.name, "rep": rep, "system": s.name, "command": cmds[s.name],
                "busy_before": busy, "error": errors[s.name], **({"auto": auto_choice(logs[s.name])}
                                                                   if s.name == "auto" else {})} for s in systems]
    return [r for s in systems if not errors[s.name] for r in records[s.name]], servers


def auto_choice(log: Path) -> str | None:
    """What `--spec-type auto` chose, from its server's `spec auto: CHOICE: why` line (None: no line)."""
    line = auto_line(log)
    return chosen(line, None) if line else None


def has_suffix(specrun: str) -> bool:
    """Whether this specrun knows --spec-type suffix (its serve --help names the suffix flags)."""
    r = subprocess.run([specrun, "serve", "--help"], capture_output=True, text=True, timeout=300)
    return "--spec-suffix" in r.stdout


def run(args) -> dict:
    workloads = [w for w in load_workloads() if w.name in args.workloads]
    systems = [s for s in SYSTEMS if s.name in args.systems]
    if args.quick:
        workloads = [Workload(w.name, w.what, w.system, w.users[:2], w.history, w.lead) for w in workloads]
    commit, dirty = git_state()
    version = ""
    if any(not s.specrun for s in systems):
        v = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, timeout=60)
        version = next((ln for ln in (v.stdout + v.stderr).splitlines() if ln.startswith("version")), "")
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit, "dirty": dirty,
            "cpu": cpu_model(), "cores": os.cpu_count(), "llama_server_version": version, "threads": args.threads,
            "ctx": args.ctx, "n_predict": args.n_predict, "reps": args.reps, "quick": args.quick,
            "max_busy": args.max_busy, "suffix_args": args.suffix_args, "missing": args.missing,
            "systems": {s.name: {"server": s.server, "args": list(s.args)} for s in systems},
            "workloads": {w.name: {"what": w.what, "requests": len(w.users), "history": w.history} for w in workloads}}
    requests: list[dict] = []
    servers: list[dict] = []
    for model in args.models:
        path = model_path(args.specrun, model)
        for w in workloads:
            for rep in range(args.reps):
                kept, done = session(model, path, w, systems, rep, args)
                requests += kept
                servers += done
                partial = Path(args.out).with_suffix(".partial.json")   # what a stopped run keeps: --from-json it
                partial.parent.mkdir(parents=True, exist_ok=True)
                partial.write_text(json.dumps({"meta": meta, "servers": servers, "requests": requests}, indent=1) + "\n")
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)   # the run ended: main() writes args.out
    return {"meta": meta, "servers": servers, "requests": requests}


# ---- the table (pure: tests feed it fake timings) ------------------------------------------------


def first_difference(a: str, b: str) -> str:
    """Where text b first differs from a: 'at character 41: "...abc" vs "...abd"' (20 characters from
    there, JSON-quoted), or the length difference when one is the other's prefix."""
    i = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"at character {i} of {len(a)}: {json.dumps(a[i:i + 20])} vs {json.dumps(b[i:i + 20])}"


def summarize(requests: list[dict]) -> list[dict]:
    """One row per (model, workload, system), in the run's order: session tok/s (Σ predicted_n /
    Σ predicted_ms of a rep's session), its median, min and max over reps; drafted, accepted and
    acceptance over every request; `x_none` and `x_best`, the medians of the per-rep ratios to
    specrun `none` and to llama-server's fastest system on that (model, workload) (its median);
    `x_exact` and `best_exact` the same for llama-server's exact-kernel systems;
    `equal_none` (None without `none`), and `diffs`, each request whose text differs from specrun
    `none`'s in the same rep and turn: (rep, turn, where).

    Example: a session of 2 requests, 128 tokens in 1000 ms and 128 in 600 ms: 256 / 1.6 s = 160 tok/s."""
    sessions: dict[tuple, dict] = {}                 # (model, workload, system) -> {rep: [requests]}
    for r in requests:
        sessions.setdefault((r["model"], r["workload"], r["system"]), {}).setdefault(r["rep"], []).append(r)
    tps = {key: {rep: sum(r["predicted_n"] for r in rs) / (sum(r["predicted_ms"] for r in rs) / 1e3)
                 for rep, rs in reps.items()} for key, reps in sessions.items()}
    med = {key: statistics.median(v.values()) for key, v in tps.items()}
    best: dict[tuple, tuple] = {}        # llama-server's fastest system per (model, workload)
    best_exact: dict[tuple, tuple] = {}  # ... of its exact-kernel systems (specrun's text)
    for (model, workload, system), m in med.items():
        of = best_exact if system.startswith("llama-server-exact:") else best if system.startswith("llama-server") \
            else None
        if of is not None and m > med.get(of.get((model, workload)), -1):
            of[(model, workload)] = (model, workload, system)

    def ratio(key: tuple, ref: tuple | None) -> float | None:
        if ref is None or ref not in tps:
            return None
        xs = [v / tps[ref][rep] for rep, v in tps[key].items() if rep in tps[ref]]
        return statistics.median(xs) if xs else None

    rows = []
    for key, reps in sessions.items():
        model, workload, system = key
        none = sessions.get((model, workload, "none"))
        texts = {(r["rep"], r["turn"]): r["text"] for rs in (none or {}).values() for r in rs}
        diffs = [(r["rep"], r["turn"], first_difference(texts[(r["rep"], r["turn"])], r["text"]))
                 for rs in reps.values() for r in rs if (r["rep"], r["turn"]) in texts
                 and r["text"] != texts[(r["rep"], r["turn"])]]
        everything = [r for rs in reps.values() for r in rs]
        drafted = sum(r["draft_n"] for r in everything)
        accepted = sum(r["draft_n_accepted"] for r in everything)
        b, be = best.get((model, workload)), best_exact.get((model, workload))
        rows.append({"model": model, "workload": workload, "system": system, "gen_tps": med[key],
                     "gen_min": min(tps[key].values()), "gen_max": max(tps[key].values()), "reps": len(reps),
                     "requests": len(everything), "predicted_n": sum(r["predicted_n"] for r in everything),
                     "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
                     "x_none": ratio(key, (model, workload, "none") if none else None),
                     "x_best": ratio(key, b), "best": b[2] if b else None,
                     "x_exact": ratio(key, be), "best_exact": be[2] if be else None,
                     "equal_none": not diffs if none else None, "diffs": diffs,
                     "others_busy": max(r["others_busy"] for r in everything)})
    return rows


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def goals(rows: list[dict], exact: bool) -> str:
    """Issue 50's verdicts for one system's rows: ≥ 1.3× the best llama-server (and its exact-kernel
    best, when measured), never below `none`."""
    def over(key: str, what: str) -> str:
        fast = [r for r in rows if r[key] is not None and r[key] >= 1.3]
        on = ", ".join(f"{r['model']} / {r['workload']}" for r in fast)
        return (f"≥ 1.3× the best {what} on {len(fast)} of {sum(r[key] is not None for r in rows)} workloads"
                + (f" (on: {on})" if on else ""))

    slow = [r for r in rows if r["x_none"] is not None and r["x_none"] < 1.0]
    below = ", ".join(f"{r['model']} / {r['workload']} {r['x_none']:.2f}×" for r in slow)
    return (over("x_best", "llama-server") + ("; " + over("x_exact", "llama-server exact") if exact else "")
            + f"; below `none` on {len(slow)} of {sum(r['x_none'] is not None for r in rows)}"
            + (f" ({below})" if below else "") + ".")


def markdown(data: dict) -> str:
    """The preamble, the table (one row per model, workload and system), the verdicts on issue 50's
    goals for `suffix`, every specrun text that differs from `none`, the failed servers and the workloads."""
    m, rows = data["meta"], summarize(data["requests"])
    exact = any(r.get("x_exact") is not None for r in rows)
    dirty = f", with uncommitted changes in {', '.join(m['dirty'])}" if m["dirty"] else ""
    during = [r["others_busy"] for r in data["requests"]]
    out = [f"Measured {m['date']} at commit `{m['commit']}`{dirty}; {m['cpu']}, {m['cores']} cores; llama-server "
           f"`{m['llama_server_version'] or '—'}`. Each session starts one fresh server per system, all up at once; "
           f"request i goes to each in turn (the order rotates). {m['threads']} threads, context {m['ctx']}, one slot, "
           f"greedy, n_predict {m['n_predict']}, {m['reps']} sessions per workload"
           + (" (--quick: the first 2 requests of each)" if m.get("quick") else "") + ". tok/s is Σ generated / "
           "Σ generation time over a session (each server's own `timings`), the median of the sessions (min–max "
           "in brackets); `× none` and `× best llama-server` are medians of per-session ratios; acceptance is "
           "accepted / drafted over every request; `= none` compares every text with specrun `none`'s."
           + (f" Other work on the machine while a request ran: median {statistics.median(during):.0%} of the CPUs, "
              f"{sum(x > m['max_busy'] for x in during)} of {len(during)} requests above {m['max_busy']:.0%}."
              if during else "")
           + (f" suffix's extra flags: `{m['suffix_args']}`." if m.get("suffix_args") else "")
           + (f" Not in this build, so not run: {', '.join(m['missing'])}." if m.get("missing") else "")
           + (f" Renamed since: {m['renamed']}." if m.get("renamed") else ""),
           "",
           "| model | workload | system | tok/s | × none | × best llama-server | "
           + ("× best llama-server exact | " if exact else "") + "acceptance | = none |",
           "|---|---|---|---|---|---|---|---|" + "---|" * exact]
    for r in rows:
        acc = "—" if r["acceptance"] is None else f"{r['acceptance']:.2f} ({r['accepted']} / {r['drafted']})"
        eq = "—" if r["equal_none"] is None else "yes" if r["equal_none"] else "**no**"
        out.append(f"| {r['model']} | {r['workload']} | {LABELS.get(r['system'], r['system'])} | {r['gen_tps']:.1f} "
                   f"({r['gen_min']:.0f}–{r['gen_max']:.0f}) | {_f(r['x_none'], '.2f')} | {_f(r['x_best'], '.2f')} | "
                   + (f"{_f(r.get('x_exact'), '.2f')} | " if exact else "") + f"{acc} | {eq} |")
    for key, what in (("best", "Best llama-server"), ("best_exact", "Best llama-server exact")):
        best = sorted({(r["model"], r["workload"], r[key]) for r in rows if r.get(key)})
        if best:
            out += ["", f"{what} per workload: " + "; ".join(f"{md} / {w}: {LABELS.get(b, b)}" for md, w, b in best)
                    + "."]
    for system in ("suffix", "auto"):
        mine = [r for r in rows if r["system"] == system]
        if mine:
            out += ["", f"Issue 50's goals for `{system}`: " + goals(mine, exact)]
    autos = [sv for sv in data.get("servers", []) if sv["system"] == "auto" and not sv.get("error")]
    if autos:
        out += ["", "`auto` chose (at its server's start, on its built-in prompt): " + "; ".join(
            f"{sv['model']} / {sv['workload']} / rep {sv['rep'] + 1}: {sv.get('auto') or '?'}" for sv in autos) + "."]
    bad = [(r, d) for r in rows if r["system"] in {s.name for s in SYSTEMS if s.specrun} for d in r["diffs"]]
    if bad:
        out += ["", "**specrun texts that differ from `none` (a bug):**", ""]
        out += [f"- {r['model']} / {r['workload']} / {r['system']}: rep {rep + 1}, request {turn + 1}, {where}"
                for r, (rep, turn, where) in bad]
    elif any(r["equal_none"] is not None for r in rows if r["system"] != "none"):
        out += ["", "Every specrun text equals `none`'s."]
    other = [f"{r['model']} / {r['workload']} / {LABELS.get(r['system'], r['system'])}" for r in rows
             if r["system"].startswith("llama-server") and r["equal_none"] is False]
    if other:
        out += ["", "llama-server's text differs from specrun `none`'s on: " + ", ".join(other) + "."]
    failed = [sv for sv in data.get("servers", []) if sv.get("error")]
    if failed:
        out += ["", "Failed (no numbers for that session): " + "; ".join(
            f"{sv['model']} / {sv['workload']} / rep {sv['rep'] + 1} / {sv['system']}: {sv['error']}" for sv in failed)
            + "."]
    out += ["", "Workloads (prompt files under `benchmarks/prompts/suffix/`):", ""]
    out += [f"- `{name}` ({info['requests']} requests{', each with the conversation so far' if info['history'] else ''})"
            f": {info['what']}" for name, info in m["workloads"].items()]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--workloads", default="agent-edit,tool-calls,chat-quotes,code-review")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                    help=f"comma-separated, of {', '.join(s.name for s in SYSTEMS)}")
    ap.add_argument("--reps", type=int, default=2, help="sessions per workload")
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 1 rep, -n 32, the first 2 requests of each workload, written to "
                         "build/suffix_bench/quick.json unless --out")
    ap.add_argument("--suffix-args", default="", help="more flags for the suffix server, e.g. \"--spec-suffix-...\"")
    ap.add_argument("--llama-server", default=str(ROOT / "build" / "peers" / "cmake" / "bin" / "llama-server"))
    ap.add_argument("--specrun", default=str(Path(sys.executable).with_name("specrun")))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--max-busy", type=float, default=0.25,
                    help="before each session, wait until other work uses at most this share of the CPUs")
    ap.add_argument("--wait-quiet", type=float, default=120, help="seconds to wait for that, at most (then run)")
    ap.add_argument("--out", help="JSON; the markdown goes next to it (.md) (default: benchmarks/results/suffix_bench.json)")
    ap.add_argument("--from-json", help="render an earlier run's JSON (its .md next to it) instead of measuring")
    ap.add_argument("--docs", action="store_true", help="put the table between its markers in docs/benchmarks.md")
    args = ap.parse_args(argv)
    if args.quick:
        args.reps, args.n_predict = 1, 32
    args.out = args.out or str(ROOT / "build" / "suffix_bench" / "quick.json" if args.quick
                               else RESULTS / "suffix_bench.json")
    args.models = [x.strip() for x in args.models.split(",") if x.strip()]
    args.workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    args.systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    for opt, known in (("models", list(MODELS)), ("workloads", [w.name for w in load_workloads()]),
                       ("systems", [s.name for s in SYSTEMS])):
        bad = [x for x in getattr(args, opt) if x not in known]
        if bad:
            ap.error(f"--{opt}: unknown {', '.join(bad)} (known: {', '.join(known)})")
    args.missing = []
    if not args.from_json:
        peers = [s.name for s in SYSTEMS if not s.specrun and s.name in args.systems]
        if peers and not Path(args.llama_server).is_file():
            print(f"[suffix] no llama-server at {args.llama_server} (`make peers-server` builds it): measuring "
                  "without it", file=sys.stderr)
            args.systems = [x for x in args.systems if x not in peers]
            args.missing += peers
        if "suffix" in args.systems and not has_suffix(args.specrun):
            print("[suffix] this specrun has no --spec-type suffix: measuring without it", file=sys.stderr)
            args.systems.remove("suffix")
            args.missing.append("suffix")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # stop the running servers on the way out
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text(encoding="utf-8"))
        md = markdown(data)
        Path(args.from_json).with_suffix(".md").write_text(md, encoding="utf-8")
        print(md)
    else:
        data = run(args)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        md = markdown(data)
        write_results(args.out, data, md)
    if args.docs:
        DOCS.write_text(replace_block(DOCS.read_text(encoding="utf-8"), md, BEGIN, END), encoding="utf-8")
        print(f"[suffix] {DOCS.relative_to(ROOT)}: the table between {BEGIN} and {END} replaced", file=sys.stderr)


if __name__ == "__main__":
    main()
