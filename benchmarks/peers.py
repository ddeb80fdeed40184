"""specrun serve against llama.cpp's own llama-server: the same /completion requests to both.

    python benchmarks/peers.py --llama-server build/peers/cmake/bin/llama-server [--reps 3] [-n 128]
        [--workloads free,code-rewrite] [--settings none,ngram-simple] [--docs]
    python benchmarks/peers.py --from-json benchmarks/results/peers.json --docs   # re-render, no run
    python benchmarks/peers.py --table spec --docs     # the spec table: n-gram family and draft-eagle3

`make bench-peers` builds llama-server once (build/peers/) from the llama-cpp-python sdist the
project pins, so both servers run the same llama.cpp, and runs this with --docs.

Both servers run on 127.0.0.1, 2 threads, a 4096-token context, one slot. Per model and setting:
start both, wait for /health, send every workload once to each (warm-up), then --reps rounds; in a
round each workload goes to one server, then the other, and who goes first alternates round by
round, so the machine's drift in speed (on a shared VM host, tens of percent within minutes) meets
both systems alike; a request runs while the other server idles. --one-at-a-time runs each server
alone instead, one after the other. Before each request
an unrelated 800-token prompt (1 token asked) leaves nothing of the last prompt to reuse, so both
servers evaluate every prompt in full (llama-server also gets cache_prompt false); a request that
reused some, or that ran while other work took more than --max-busy of the CPUs, is measured again. Requests are greedy (temperature 0),
n_predict 128. The EAGLE-3 rows run on a synthetic pair that `specrun make-test-model --eagle3` writes
under build/peers/models (a 24-layer llama bigram target, n_embd 512, q8_0, and its exact eagle3 draft,
f16: llama.cpp accepts every greedy draft at any n-max), with the same -md flags for both servers. Speeds are each server's own `timings` (prompt_per_second, predicted_per_second),
median over the reps; `× none` is a system's median over its own `none` median, `= none` whether
every rep's text equals that system's own `none` text. Writes benchmarks/results/peers.json (every
request) and peers.md (the table); --docs puts the table between docs/benchmarks.md's peers markers.

`--table spec` (issue 15, item 4) is a second table from a second run, with its own results
(benchmarks/results/spec_peers.json / .md) and markers (spec-peers), so neither run can
wipe the other's rows: llama.cpp's n-gram family (ngram-simple, ngram-map-k, ngram-map-k4v,
ngram-mod, ngram-cache, each with llama.cpp's default flags, the same to both servers) on the
input-grounded workloads, and draft-eagle3 at n-max 3 to 47 (EAGLE3_N_MAX) on the synthetic pair. Besides
tok/s, × none and = none it shows, for both systems, acceptance = Σ draft_n_accepted / Σ draft_n
and tokens per target pass = Σ n_predicted / Σ (n_predicted − draft_n_accepted), summed over the
kept reps, from each server's /completion `timings` (llama-server leaves draft_n out when it
drafted nothing: 0). A server that exits while starting, refuses a flag or fails a request is
recorded (its log's last error line) and shown in the table instead of its numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "benchmarks" / "prompts"
RESULTS = ROOT / "benchmarks" / "results"
LOGS = ROOT / "build" / "peers" / "logs"
MODELS = ROOT / "build" / "peers" / "models"
DOCS = ROOT / "docs" / "benchmarks.md"       # the page whose marker blocks --docs rewrites
BEGIN, END = "<!-- peers:begin -->", "<!-- peers:end -->"
SPEC_BEGIN, SPEC_END = "<!-- spec-peers:begin -->", "<!-- spec-peers:end -->"
MTP_BEGIN, MTP_END = "<!-- mtp-peers:begin -->", "<!-- mtp-peers:end -->"
SYSTEMS = ("specrun", "llama-server")
# Sent (1 token asked) before every measured request: specrun reuses the slot's KV prefix whatever
# cache_prompt says, and its fast prompt context keeps whole 512-token blocks of earlier prompts; an
# unrelated prompt of more than 512 tokens leaves neither anything to reuse.
FLUSH = "The quick brown fox jumps over the lazy dog. " * 80


@dataclass(frozen=True)
class Workload:
    name: str
    model: str       # a name specrun's registry resolves (`specrun inspect NAME --json` gives the path)
    file: str        # under benchmarks/prompts/, sent exactly as stored
    what: str


@dataclass(frozen=True)
class Setting:
    name: str
    args: tuple[str, ...]                 # the same flags for both servers; {eagle3}: the synthetic draft's path
    systems: tuple[str, ...] = SYSTEMS
    models: tuple[str, ...] | None = None   # only these models; None: the registry models (and `none` everywhere)

    def applies(self, model: str) -> bool:
        if self.models is not None:
            return model in self.models
        return (self.name == "none" or not model.startswith(SYNTHETIC)
                or (self.name in HYBRID_NGRAM and model in MTP_MODELS))


SYNTHETIC = "synthetic:"
EAGLE3_MODEL = SYNTHETIC + "eagle3-realistic"     # `specrun make-test-model T --eagle3 D --quant q8_0`
# `specrun make-test-model OUT --head H` (qwen35, 24 trunk layers, n_embd 512, f16, one MTP block): issue 12's rows
MTP_MODELS = {SYNTHETIC + "mtp-exact": "exact", SYNTHETIC + "mtp-noisy": "noisy:0.1"}


WORKLOADS = (
    Workload("free", "gemma-3-270m", "free.txt", "free text: a story opening"),
    Workload("code-rewrite", "gemma-3-270m", "code_rewrite.txt", "rewrite a function with type hints"),
    Workload("verbatim", "gemma-3-270m", "verbatim_source.txt", "repeat a 61-line Python module exactly"),
    Workload("json-table", "gemma-3-270m", "json_table.txt", "a JSON list of 12 records as a Markdown table"),
    Workload("long-prompt", "gemma-3-270m", "long_prompt.txt", "a 2,200-token operations log, then its incident summary"),
    Workload("summary", "smollm2-135m-instruct", "summary_quotes.txt", "chat: summarize a notice, quoting it"),
    Workload("chat-reuse", "smollm2-135m-instruct", "chat_reuse.txt", "chat: repeat a paragraph corrected, then list its sentences"),
    Workload("code-rewrite-smollm2", "smollm2-135m-instruct", "code_rewrite.txt", "the code rewrite on SmolLM2"),
    Workload("long-prompt-smollm2", "smollm2-135m-instruct", "long_prompt.txt", "the long log on SmolLM2"),
    Workload("eagle3-free", EAGLE3_MODEL, "free.txt", "free text on the synthetic 24-layer llama target with its "
             "exact EAGLE-3 draft"),
    Workload("mtp-free", SYNTHETIC + "mtp-exact", "free.txt", "free text on the synthetic 24-layer qwen35 (f16) with "
             "its exact MTP head"),
    Workload("mtp-noisy-free", SYNTHETIC + "mtp-noisy", "free.txt", "the same with noise of sigma 0.1 on the MTP head"),
)
PEER_SETTINGS = ("none", "ngram-simple", "ngram-simple n3 m16")   # issue 12: auto >= llama-server's best of these
HYBRID_NGRAM = PEER_SETTINGS[1:]   # also on the synthetic qwen35 (a hybrid model: checkpoints, not snapshots)
NGRAM = ("--spec-type", "ngram-simple")
# llama.cpp's other n-gram drafters, each with its defaults (common/common.h: map-k and map-k4v size-n 12,
# size-m 48, min-hits 1; ngram-mod n-match 24, n-min 48, n-max 64; ngram-cache without lookup files)
NGRAM_FAMILY = ("ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
EAGLE3_N_MAX = (3, 5, 7, 11, 15, 31, 47)
MTP_N_MAX = (1, 3, 5)
SETTINGS = (
    Setting("none", ("--spec-type", "none")),
    Setting("ngram-simple", NGRAM),
    Setting("ngram-simple n3 m16", NGRAM + ("--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16",
                                            "--spec-draft-n-max", "16")),
    # each prompt goes to a server again and again: suffix's global tree (auto's, in serve) would draft
    # a repeat from the last answer, so auto runs without it here, as a first request would
    Setting("auto", ("--spec-type", "auto", "--spec-suffix-max-cached-requests", "0"), ("specrun",)),
    *(Setting(t, ("--spec-type", t)) for t in NGRAM_FAMILY),
    *(Setting(f"draft-eagle3 n-max {k}", ("-md", "{eagle3}", "--spec-type", "draft-eagle3", "--spec-draft-n-max", str(k)),
              models=(EAGLE3_MODEL,)) for k in EAGLE3_N_MAX),
    *(Setting(f"draft-mtp n-max {k}", ("--spec-type", "draft-mtp", "--spec-draft-n-max", str(k)),
              models=tuple(MTP_MODELS)) for k in MTP_N_MAX),
)


@dataclass(frozen=True)
class Table:
    name: str
    begin: str                   # markers in docs/benchmarks.md
    end: str
    out: str                     # under benchmarks/results/: the run's JSON (the markdown: .md next to it)
    workloads: tuple[str, ...]   # what a run for this table measures unless --workloads / --settings say
    settings: tuple[str, ...]


TABLES = {
    "peers": Table("peers", BEGIN, END, "peers.json", tuple(w.name for w in WORKLOADS),
                   (*PEER_SETTINGS, "auto", "draft-eagle3 n-max 3", "draft-eagle3 n-max 7")),
    # issue 15, item 4: the n-gram family where the output can reuse the input, and draft-eagle3 at each n-max
    "spec": Table("spec", SPEC_BEGIN, SPEC_END, "spec_peers.json",
                  ("code-rewrite", "verbatim", "json-table", "summary", "chat-reuse", "eagle3-free"),
                  ("none", "ngram-simple", *NGRAM_FAMILY, *(f"draft-eagle3 n-max {k}" for k in EAGLE3_N_MAX))),
    # issue 12, item 2: draft-mtp, the verify-heavy setting, on the synthetic qwen35 with an exact and a noisy head;
    # and the n-gram drafts on that hybrid model (llama-server: checkpoints, no recurrent-state snapshots)
    "mtp": Table("mtp", MTP_BEGIN, MTP_END, "mtp_peers.json", ("mtp-free", "mtp-noisy-free"),
                 ("none", *(f"draft-mtp n-max {k}" for k in MTP_N_MAX), "ngram-simple", "ngram-simple n3 m16")),
}


class ServerFailed(Exception):
    """A server exited while starting, never answered /health, or failed a request."""


# ---- running the servers -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 600.0) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def server_command(system: str, model: str, path: str, setting: Setting, port: int, args) -> list[str]:
    common = ["-t", str(args.threads), "-c", str(args.ctx), "-np", "1", "--host", "127.0.0.1", "--port", str(port)]
    flags = [a.replace("{eagle3}", str(synthetic_eagle3(args.specrun)[1])) if "{eagle3}" in a else a
             for a in setting.args]
    if system == "specrun":
        return [args.specrun, "serve", "-m", path if model.startswith(SYNTHETIC) else model, *common, *flags]
    return [args.llama_server, "-m", path, *common, *flags]


def synthetic_eagle3(specrun: str) -> tuple[Path, Path]:
    """The realistic synthetic target and its exact EAGLE-3 draft, written once (deterministic)."""
    target, draft = MODELS / "eagle3-target-q8_0.gguf", MODELS / "eagle3-draft-f16.gguf"
    if not (target.is_file() and draft.is_file()):
        MODELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([specrun, "make-test-model", str(target), "--eagle3", str(draft), "--shape", "realistic",
                        "--head", "exact", "--quant", "q8_0", "--draft-quant", "f16"], check=True, timeout=600)
    return target, draft


def synthetic_mtp(specrun: str, head: str) -> Path:
    """The realistic synthetic qwen35 (f16) with an MTP head of that kind, written once (deterministic)."""
    path = MODELS / f"mtp-{head.replace(':', '')}-f16.gguf"
    if not path.is_file():
        MODELS.mkdir(parents=True, exist_ok=True)
        subprocess.run([specrun, "make-test-model", str(path), "--shape", "realistic", "--head", head, "--quant", "f16"],
                       check=True, timeout=600)
    return path


@contextmanager
def serving(cmd: list[str], log: Path, timeout: float = 600.0):
    """Starts `cmd` (output to `log`), yields (base URL, pid) once /health answers 200, stops it after."""
    port = cmd[cmd.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            t0 = time.monotonic()
            while True:
                if proc.poll() is not None:
                    raise ServerFailed(f"exited with {proc.returncode} while starting: {last_error(log)}")
                try:
                    if http(url + "/health", timeout=5)[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() - t0 > timeout:
                    raise ServerFailed(f"no answer on /health in {timeout:.0f} s")
                time.sleep(0.5)
            yield url, proc.pid
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (field 3, state, first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    """pid and every live process descended from it (a server's fast prompt worker)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                children.setdefault(int(_stat(int(d.name))[1]), []).append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass                                   # gone while we looked
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_ticks(pid: int | None = None) -> tuple[int, int]:
    """(all CPUs' ticks, busy ticks) from /proc/stat; with `pid`, busy = the ticks of that process and
    of every process descended from it (all threads; a child that ended and was waited for is in
    its parent's cutime / cstime)."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total, busy = sum(v), sum(v) - v[3] - v[4]                      # less idle and iowait
    if pid is not None:
        busy = 0
        for p in process_tree(pid):
            try:
                f = _stat(p)
            except OSError:
                continue
            busy += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])   # utime, stime, cutime, cstime
    return total, busy


def others_share(before: tuple, after: tuple) -> float:
    """The share of all CPUs that work other than the server used between two samples of
    (cpu_ticks(), cpu_ticks(server_pid))."""
    (t0, b0), (_, s0) = before
    (t1, b1), (_, s1) = after
    return max(0.0, ((b1 - b0) - (s1 - s0)) / max(t1 - t0, 1))


def cpu_busy(seconds: float = 2.0) -> float:
    """The share of all CPUs busy over `seconds`, 0..1."""
    t0, b0 = cpu_ticks()
    time.sleep(seconds)
    t1, b1 = cpu_ticks()
    return (b1 - b0) / max(t1 - t0, 1)


def wait_quiet(max_busy: float, limit_s: float) -> float:
    """Waits (at most limit_s) until other work uses at most max_busy of the CPUs; returns the last
    share measured. On a shared machine another process's threads make llama.cpp's spin-waiting
    threads many times slower, which no median repairs."""
    t0, busy = time.monotonic(), cpu_busy()
    if busy > max_busy:
        print(f"[peers] other work uses {busy:.0%} of the CPUs: waiting (at most {limit_s:.0f} s) for "
              f"{max_busy:.0%} or less", file=sys.stderr, flush=True)
    while busy > max_busy and time.monotonic() - t0 < limit_s:
        time.sleep(8)
        busy = cpu_busy()
    return busy


def last_error(log: Path) -> str:
    """The last line of a server's log that names an error (else its last line), for the table."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"error|invalid|unknown|abort|exception|what\(\)", ln, re.I)]
    return (errors or lines or ["(empty log)"])[-1][:200]


def complete(url: str, prompt: str, n_predict: int) -> dict:
    status, d = http(url + "/completion", {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                                           "cache_prompt": False, "stream": False})
    if status != 200:
        raise ServerFailed(f"POST /completion answered {status}: {str(d)[:200]}")
    t = d["timings"]
    spec = d.get("generation_settings", {}).get("speculative")
    return {"gen_tps": t["predicted_per_second"], "prompt_tps": t["prompt_per_second"], "prompt_n": t["prompt_n"],
            "predicted_n": t["predicted_n"], "draft_n": t.get("draft_n"), "draft_n_accepted": t.get("draft_n_accepted"),
            "tokens_evaluated": d.get("tokens_evaluated"), "text": d["content"], "spec": spec}


def measure(url: str, pid: int, prompt: str, name: str, rep: int, args) -> dict:
    """One kept request: flush, then `prompt`; measured again while it reused the last prompt or other
    work took more than --max-busy of the CPUs (rep < 0, the warm-up: only the reuse check)."""
    for attempt in range(args.retries + 1):
        complete(url, FLUSH, 1)
        before = cpu_ticks(), cpu_ticks(pid)
        r = complete(url, prompt, args.n_predict)
        r["others_busy"] = others_share(before, (cpu_ticks(), cpu_ticks(pid)))
        r["attempt"] = attempt
        reused = r["prompt_n"] < (r["tokens_evaluated"] or 0) - 1     # all but BOS
        print(f"[peers]   {'warm-up' if rep < 0 else f'rep {rep + 1}'} {name}: "
              f"{r['gen_tps']:.1f} tok/s, prompt {r['prompt_tps']:.0f} tok/s "
              f"({r['prompt_n']} of {r['tokens_evaluated']} tokens evaluated), other work "
              f"{r['others_busy']:.0%}", file=sys.stderr, flush=True)
        if reused and attempt < args.retries:
            continue
        if rep < 0 or r["others_busy"] <= args.max_busy or attempt == args.retries:
            break
        wait_quiet(args.max_busy, 120)      # then measure this one again
    return r


def model_path(specrun: str, name: str) -> str:
    if name == EAGLE3_MODEL:
        return str(synthetic_eagle3(specrun)[0])
    if name in MTP_MODELS:
        return str(synthetic_mtp(specrun, MTP_MODELS[name]))
    r = subprocess.run([specrun, "inspect", name, "--json"], capture_output=True, text=True, check=True, timeout=300)
    return json.loads(r.stdout)["path"]


def run(args) -> dict:
    workloads = [next(w for w in WORKLOADS if w.name == n) for n in dict.fromkeys(args.workloads)]   # in that order
    settings = [s for s in SETTINGS if s.name in args.settings]
    systems = [s for s in SYSTEMS if s in args.systems]
    texts = {w.name: (PROMPTS / w.file).read_text(encoding="utf-8") for w in workloads}
    requests: list[dict] = []
    servers: list[dict] = []
    info = meta(args, texts)                                    # the commit measured: as the run starts
    for model in dict.fromkeys(w.model for w in workloads):
        path = model_path(args.specrun, model)
        mine = [w for w in workloads if w.model == model]
        for setting in (s for s in settings if s.applies(model)):
            here = [s for s in systems if s in setting.systems]
            partners = auto_partners(requests, mine) if setting.name == "auto" and "llama-server" in systems \
                and not args.one_at_a_time else {}
            for best, ws in partners.items():   # auto beside llama-server's best of each workload, in one block
                kept, done = measure_group(model, path, setting, ["specrun", "llama-server"], ws, texts, args,
                                           partner=next(x for x in SETTINGS if x.name == best))
                requests += kept
                servers += done
            rest = [w for w in mine if not any(w in ws for ws in partners.values())]
            if not rest:
                continue
            for group in ([[s] for s in here] if args.one_at_a_time else [here]):
                kept, done = measure_group(model, path, setting, group, rest, texts, args)
                requests += kept
                servers += done
    return {"meta": info, "servers": servers, "requests": requests}


def auto_partners(requests: list[dict], mine: list[Workload]) -> dict[str, list[Workload]]:
    """{llama-server's fastest setting of PEER_SETTINGS so far in this run: the workloads of `mine`
    where it is}: whom `auto` runs beside, so that the verdict is measured within one block (a VM's
    speed drifts by tens of percent between blocks)."""
    rows = summarize([r for r in requests if r["system"] == "llama-server" and r["setting"] in PEER_SETTINGS])
    by = {(r["workload"], r["setting"], r["system"]): r for r in rows}
    out: dict[str, list[Workload]] = {}
    for w in mine:
        b = best_peer(by, w.name)
        if b:
            out.setdefault(b["setting"], []).append(w)
    return out


def measure_group(model: str, path: str, setting: Setting, group: list[str], mine: list[Workload],
                  texts: dict, args, partner: Setting | None = None) -> tuple[list[dict], list[dict]]:
    """The servers of `group` up at once (idle but for the request measured), then the warm-up and
    --reps rounds; in each round every workload goes to each server in turn, and who goes first
    alternates round by round, so a drift in the machine's speed meets both systems alike. A server
    that fails keeps no numbers; the others go on. partner: llama-server's setting in this block when
    it is not `setting` (`auto`'s block: llama-server's best; its rows keep `setting`'s name and say
    `partner`). Returns (kept requests, one record per server)."""
    own = {s: partner if partner and s == "llama-server" else setting for s in group}
    cmds = {s: server_command(s, model, path, own[s], free_port(), args) for s in group}
    logs = {s: LOGS / f"{s}-{model}-{setting.name.replace(' ', '_')}"
                      f"{'-' + partner.name.replace(' ', '_') if partner else ''}.log" for s in group}
    busy = wait_quiet(args.max_busy, args.wait_quiet)
    load = os.getloadavg()[0]
    print(f"[peers] {model} / {setting.name}{f' beside llama-server {partner.name}' if partner else ''} / "
          f"{' + '.join(group)} (others busy {busy:.0%}, load {load:.2f})", file=sys.stderr, flush=True)
    kept: dict[str, list[dict]] = {s: [] for s in group}
    errors: dict[str, str | None] = {s: None for s in group}

    def failed(s: str, e: Exception) -> None:   # OSError: the connection died with the server
        errors[s] = f"{e}" if isinstance(e, ServerFailed) else f"{type(e).__name__}: {e}; {last_error(logs[s])}"
        print(f"[peers]   {s} failed: {errors[s]} (see {logs[s]})", file=sys.stderr, flush=True)
        kept[s] = []

    with contextlib.ExitStack() as stack:
        live = {}
        for s in group:
            try:
                live[s] = stack.enter_context(serving(cmds[s], logs[s]))
            except (ServerFailed, OSError) as e:
                failed(s, e)
        for rep in range(-1, args.reps):                        # rep -1: the warm-up, not kept
            order = group if rep % 2 else group[::-1]
            for w in mine:
                for s in (s for s in order if s in live and errors[s] is None):
                    url, pid = live[s]
                    try:
                        r = measure(url, pid, texts[w.name], f"{w.name} {s}", rep, args)
                    except (ServerFailed, OSError) as e:
                        failed(s, e)
                        continue
                    if rep >= 0:
                        kept[s].append({"model": model, "workload": w.name, "setting": setting.name,
                                        "system": s, "rep": rep, **r,
                                        **({"partner": own[s].name} if own[s] is not setting else {})})
    done = []
    for s in group:
        done.append({"model": model, "setting": own[s].name, "system": s, "command": cmds[s],
                     "load_avg_1m": load, "busy_before": busy, "auto": auto_line(logs[s]),
                     "error": errors[s]})
    return [r for s in group for r in kept[s]], done


def write_results(out: str | Path, data: dict, md: str) -> None:
    """A benchmark's numbers as JSON at `out` and its markdown table next to it (.md), and the table on stdout."""
    out = Path(out)
    out.write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(md)
    print(md)


def git_state() -> tuple[str, list[str]]:
    """(HEAD's short commit, the tracked files changed since it): what a results file was measured at."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD"), git("diff", "--name-only", "HEAD").split()


def meta(args, texts: dict) -> dict:
    version = ""
    if "llama-server" in args.systems:
        v = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True, timeout=60)
        version = next((ln for ln in (v.stdout + v.stderr).splitlines() if ln.startswith("version")), "")
    cpu = cpu_model()
    commit, dirty = git_state()
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": commit,
            "dirty": dirty, "cpu": cpu, "cores": os.cpu_count(),
            "llama_server_version": version, "max_busy": args.max_busy, "threads": args.threads, "ctx": args.ctx,
            "n_predict": args.n_predict, "reps": args.reps, "together": not args.one_at_a_time, "workloads": {w.name: {"model": w.model, "file": f"benchmarks/prompts/{w.file}",
                                                      "what": w.what} for w in WORKLOADS if w.name in texts}}


# ---- the table (pure: tests feed it fake timings) ------------------------------------------------


def summarize(requests: list[dict]) -> list[dict]:
    """One row per (workload, setting, system): medians over reps, the ratio to the same system's
    `none`, whether every rep's text equals that system's `none` text (of its first rep), and over
    all reps together: drafted, accepted, acceptance = accepted / drafted (None: nothing drafted)
    and tokens per target pass = predicted / (predicted - accepted).

    Example: 3 reps of 128 tokens, 300 drafted, 256 accepted: acceptance 0.85, 384 / 128 = 3.0
    tokens per pass."""
    groups: dict[tuple, list[dict]] = {}
    for r in requests:
        groups.setdefault((r["workload"], r["setting"], r["system"]), []).append(r)
    rows = []
    for (workload, setting, system), rs in groups.items():
        none = groups.get((workload, "none", system))
        gen, prompt = statistics.median(r["gen_tps"] for r in rs), statistics.median(r["prompt_tps"] for r in rs)
        none_gen = statistics.median(r["gen_tps"] for r in none) if none else None
        drafted = sum(r.get("draft_n") or 0 for r in rs)           # llama-server omits it when 0
        accepted = sum(r.get("draft_n_accepted") or 0 for r in rs)
        predicted = sum(r["predicted_n"] for r in rs)
        rows.append({"workload": workload, "setting": setting, "system": system, "gen_tps": gen, "prompt_tps": prompt,
                     "gen_min": min(r["gen_tps"] for r in rs), "gen_max": max(r["gen_tps"] for r in rs),
                     "prompt_n": statistics.median(r["prompt_n"] for r in rs),
                     "predicted_n": statistics.median(r["predicted_n"] for r in rs),
                     "x_none": gen / none_gen if none_gen else None,
                     "equal_none": all(r["text"] == none[0]["text"] for r in rs) if none else None,
                     "drafted": drafted, "accepted": accepted, "acceptance": accepted / drafted if drafted else None,
                     "tokens_per_pass": predicted / (predicted - accepted) if predicted > accepted else None,
                     "spec": rs[0].get("spec"), "text": rs[0]["text"], "partner": rs[0].get("partner")})
    return rows


def auto_line(log: Path) -> str | None:
    """The last `spec auto: ...` line of a server's log (None: no such line, or no log)."""
    lines = re.findall(r"spec auto: .*", log.read_text(errors="replace")) if log.is_file() else []
    return lines[-1] if lines else None


def chosen(auto_line: str | None, spec: dict | None) -> str:
    """What `auto` chose: from the server's `spec auto: CHOICE: why` line, else from the response's
    generation_settings.speculative."""
    m = re.match(r"spec auto: (.+?): ", auto_line or "")
    if m:
        return m.group(1)
    if not spec or spec.get("type") in (None, ["none"], []):
        return "none"
    return ",".join(spec["type"])


def best_peer(by: dict, workload: str, system: str = "llama-server") -> dict | None:
    """`system`'s fastest row of PEER_SETTINGS on a workload (llama-server's: what issue 12 asks `auto` to match)."""
    rows = [by[(workload, s, system)] for s in PEER_SETTINGS if (workload, s, system) in by]
    return max(rows, key=lambda r: r["gen_tps"]) if rows else None


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def _eq(x: bool | None) -> str:
    return "—" if x is None else ("yes" if x else "**no**")


def preamble(data: dict, ranges: bool = True) -> str:
    """The paragraph above a table: when, what, how, and how busy the machine was."""
    m = data["meta"]
    dirty = f", with uncommitted changes in {', '.join(m['dirty'])}" if m["dirty"] else ""
    text = (f"Measured {m['date']} at commit `{m['commit']}`{dirty}; {m['cpu']}, {m['cores']} cores; llama-server "
            f"`{m['llama_server_version'] or '?'}`. "
            + ("Both servers up at once, each idle but for the request measured, requests alternating between "
               "them (who goes first alternates each round); " if m.get("together") else "Each server alone, ")
            + f"{m['threads']} threads, context {m['ctx']}, "
            f"greedy, n_predict {m['n_predict']}; tokens/s are each server's own `timings`, the median of "
            f"{m['reps']} requests after one warm-up{' (min–max in brackets)' if ranges else ''}. `× none` is "
            "against the same system's `none`; `= none` compares the text with that system's own `none` text.")
    during = [r["others_busy"] for r in data["requests"] if r.get("others_busy") is not None]
    if during:
        cap = m.get("max_busy", 0.25)
        text += (f" Other work on the machine while a kept request ran: median {statistics.median(during):.0%} of "
                 f"the CPUs, {sum(x > cap for x in during)} of {len(during)} requests above {cap:.0%} "
                 f"({sum(r.get('attempt', 0) for r in data['requests'])} measured again for that).")
    return text


def workload_lines(data: dict, rows: list[dict], workloads: list[str]) -> list[str]:
    m = data["meta"]
    out = ["", "Workloads (prompt files under `benchmarks/prompts/`; prompt tokens as the servers evaluated them):", ""]
    for w in workloads:
        info = m["workloads"][w]
        ns = sorted({int(r["prompt_n"]) for r in rows if r["workload"] == w})
        out.append(f"- `{w}` ({info['model']}, `{Path(info['file']).name}`, {' / '.join(map(str, ns)) or 'no'} prompt "
                   f"tokens): {info['what']}")
    return out


def failures(data: dict) -> dict[tuple[str, str, str], str]:
    """(model, setting, system) -> why its server failed, for every server of the run that did."""
    return {(sv["model"], sv["setting"], sv["system"]): sv["error"] for sv in data.get("servers", []) if sv.get("error")}


def markdown(data: dict) -> str:
    m, rows = data["meta"], summarize(data["requests"])
    by = {(r["workload"], r["setting"], r["system"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in data["requests"]))
    settings = [s.name for s in SETTINGS if any(r["setting"] == s.name for r in rows)]
    autos = {sv["model"]: sv["auto"] for sv in data.get("servers", []) if sv["setting"] == "auto"}
    out = [preamble(data)]
    out += ["",
            "| workload | setting | specrun tok/s | × none | = none | llama-server tok/s | × none | = none "
            "| specrun ÷ llama-server | specrun prompt tok/s | llama-server prompt tok/s | prompt ÷ |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    marked = 0        # ratios over two different texts
    for w in workloads:
        for s in settings:
            a, b = by.get((w, s, "specrun")), by.get((w, s, "llama-server"))
            if not a and not b:
                continue
            label = s
            if s == "auto" and a:
                label = f"auto → {chosen(autos.get(m['workloads'][w]['model']), a['spec'])}"
                b = by.get((w, "auto", "llama-server")) or best_peer(by, w)
                if b:
                    label += (f" (llama-server beside it: its best, {b['partner']})" if b.get("partner")
                              else f" (llama-server: its best, {b['setting']})")
            both = a is not None and b is not None
            other = both and a["text"] != b["text"]
            marked += other
            if s == "auto" and both:
                verdicts.append((w, a["gen_tps"] >= b["gen_tps"], a["equal_none"], other))
            cells = [w, label]
            for r in (a, b):
                tps = f"{r['gen_tps']:.1f} ({r['gen_min']:.0f}–{r['gen_max']:.0f})" if r else "—"
                cells += [tps, _f(r and r["x_none"], ".2f"), _eq(r and r["equal_none"])]
            cells += [_f(a["gen_tps"] / b["gen_tps"] if both else None, ".2f") + "†" * other,
                      _f(a and a["prompt_tps"], ".0f"), _f(b and b["prompt_tps"], ".0f"),
                      _f(a["prompt_tps"] / b["prompt_tps"] if both else None, ".2f")]
            out.append("| " + " | ".join(cells) + " |")
    if marked:
        out += ["", "†: the two servers wrote different texts (llama.cpp's default kernels are not specrun's exact "
                    "ones), so the ratio compares two texts, not two ways of drafting one; `benchmarks/exact_peers.py` "
                    "runs llama-server on exact mode's kernels."]
    if verdicts:
        won = [w for w, faster, _, _ in verdicts if faster]
        same = [w for w, _, eq, _ in verdicts if eq]
        differ = sum(d for *_, d in verdicts)
        out += ["", f"`auto` ≥ llama-server's best of {{{', '.join(PEER_SETTINGS)}}}: {len(won)} of {len(verdicts)} "
                    f"workloads" + (f" (not on: {', '.join(w for w, f, _, _ in verdicts if not f)})"
                                    if len(won) < len(verdicts) else "")
                    + (f"; the two texts differ on {differ} of the {len(verdicts)} (†)" if differ else "")
                    + f"; `auto`'s text = `none`'s: {len(same)} of {len(verdicts)}."]
    twins = [by[(w, "auto", "specrun")]["x_none"] for w in workloads if (w, "auto", "specrun") in by
             and chosen(autos.get(m["workloads"][w]["model"]), by[(w, "auto", "specrun")]["spec"]) == "none"]
    if twins:
        dev = [abs(x - 1) for x in twins]
        out += ["", f"Where `auto` chose `none`, its row measures `none` again in another server process: the two "
                    f"differ by {statistics.median(dev):.0%} in the median and up to {max(dev):.0%} ({len(dev)} "
                    "workloads), this machine's run-to-run spread; smaller differences between rows mean little."]
    out += workload_lines(data, rows, workloads)
    out += none_identical(by, workloads)
    failed = failures(data)
    if failed:
        out += ["", "Failed (no numbers): " + "; ".join(f"{md} / {s} / {sy}: {e}" for (md, s, sy), e in failed.items())
                + "."]
    return "\n".join(out) + "\n"


def none_identical(by: dict, workloads: list[str]) -> list[str]:
    both = [w for w in workloads if (w, "none", "specrun") in by and (w, "none", "llama-server") in by]
    if not both:
        return []
    eq = [w for w in both if by[(w, "none", "specrun")]["text"] == by[(w, "none", "llama-server")]["text"]]
    return ["", f"`none` text identical between specrun and llama-server: {len(eq)} of {len(both)} workloads"
                + (f" (differs: {', '.join(w for w in both if w not in eq)})." if len(eq) < len(both) else ".")]


def _acc(r: dict) -> str:
    """acceptance with its counts, as llama.cpp prints it: 0.85 (256 / 300)."""
    return "—" if r["acceptance"] is None else f"{r['acceptance']:.2f} ({r['accepted']} / {r['drafted']})"


def spec_markdown(data: dict) -> str:
    """The spec table (--table spec): for each workload and setting of the run, both systems' tok/s,
    × none, acceptance, tokens per target pass and = none, then specrun ÷ llama-server; a server
    that failed shows why. Under it: draft-eagle3's best n-max against the goals of issue 15, item 4
    (≥ 2.5× over none; ≥ 1.0× llama-server at that setting) and every row where llama-server's
    output differs from its own `none`."""
    m, rows = data["meta"], summarize(data["requests"])
    by = {(r["workload"], r["setting"], r["system"]): r for r in rows}
    failed = failures(data)
    workloads = [w for w in m["workloads"] if any(r["workload"] == w for r in rows)
                 or any(sv.get("error") and sv["model"] == m["workloads"][w]["model"] for sv in data.get("servers", []))]
    ran = {(sv["model"], sv["setting"]) for sv in data.get("servers", [])}
    ran |= {(r["model"], r["setting"]) for r in data["requests"]}
    out = [preamble(data, ranges=False) + " Acceptance is draft tokens accepted / drafted and tokens/pass is "
           "n_predicted / (n_predicted − accepted), both over the kept reps together, from each server's `timings`; "
           "`—` where nothing was drafted.",
           "",
           "| workload | setting | specrun tok/s | × none | acceptance | tokens/pass | = none "
           "| llama-server tok/s | × none | acceptance | tokens/pass | = none | specrun ÷ llama-server |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    differs = []
    for w in workloads:
        model = m["workloads"][w]["model"]
        for s in (s.name for s in SETTINGS if (model, s.name) in ran):
            cells = [w, s]
            pair = [by.get((w, s, sy)) for sy in SYSTEMS]
            for sy, r in zip(SYSTEMS, pair, strict=True):
                if r:
                    cells += [f"{r['gen_tps']:.1f}", _f(r["x_none"], ".2f"), _acc(r), _f(r["tokens_per_pass"], ".2f"),
                              _eq(r["equal_none"])]
                elif (model, s, sy) in failed:
                    cells += [f"failed: {failed[(model, s, sy)]}", "—", "—", "—", "—"]
                else:
                    cells += ["not run"] + ["—"] * 4
            a, b = pair
            cells.append(_f(a["gen_tps"] / b["gen_tps"] if a and b else None, ".2f"))
            if b and b["equal_none"] is False:
                differs.append(f"{w} / {s}")
            out.append("| " + " | ".join(cells) + " |")
    out += eagle3_verdict(by, workloads)
    out += mtp_verdict(by, workloads)
    if differs:
        out += ["", f"llama-server's output differs from its own `none` on: {', '.join(differs)}."]
    elif any(r["system"] == "llama-server" and r["setting"] != "none" for r in rows):
        out += ["", "llama-server's output equals its own `none` on every row."]
    out += workload_lines(data, rows, workloads)
    out += none_identical(by, workloads)
    return "\n".join(out) + "\n"


def eagle3_verdict(by: dict, workloads: list[str]) -> list[str]:
    """Issue 15, item 4's goals for the realistic exact EAGLE-3 head, per EAGLE-3 workload: specrun's
    best n-max ≥ 2.5× over its none, and ≥ 1.0× llama-server's tok/s at that setting."""
    out = []
    for w in workloads:
        mine = [by[k] for k in by if k[0] == w and k[2] == "specrun" and k[1].startswith("draft-eagle3")
                and by[k]["x_none"] is not None]
        if not mine:
            continue
        best = max(mine, key=lambda r: r["gen_tps"])
        peer = by.get((w, best["setting"], "llama-server"))
        ratio = best["gen_tps"] / peer["gen_tps"] if peer else None
        out += ["", f"`{w}`: specrun's best EAGLE-3 setting is {best['setting']}, {best['x_none']:.2f}× its `none` "
                    f"(goal ≥ 2.5×: {'met' if best['x_none'] >= 2.5 else '**not met**'}); specrun ÷ llama-server "
                    f"there: {_f(ratio, '.2f')} (goal ≥ 1.0: "
                    f"{'—' if ratio is None else 'met' if ratio >= 1.0 else '**not met**'})."]
    return out


def mtp_verdict(by: dict, workloads: list[str]) -> list[str]:
    """Issue 12, item 2's goal for draft-mtp, per MTP workload: specrun ≥ 1.0× llama-server's tok/s at
    each n-max (the issue names n-max 5), with both systems' × none."""
    out = []
    for w in workloads:
        pairs = [(by[k], by.get((w, k[1], "llama-server"))) for k in by
                 if k[0] == w and k[2] == "specrun" and k[1].startswith("draft-mtp")]
        ratios = [(a, b, a["gen_tps"] / b["gen_tps"]) for a, b in pairs if b]
        if ratios:
            parts = [f"{a['setting'].removeprefix('draft-mtp ')} {q:.2f} ({_f(a['x_none'], '.2f')}× / "
                     f"{_f(b['x_none'], '.2f')}× none)" for a, b, q in ratios]
            out += ["", f"`{w}`: specrun ÷ llama-server for draft-mtp (issue 12's goal ≥ 1.0) at " + ", ".join(parts)
                    + f": met at {sum(q >= 1.0 for *_, q in ratios)} of {len(ratios)}."]
    return out


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else platform.processor()."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    return next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), platform.processor())


def replace_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    """`text` (a page) with everything between the markers `begin` and `end` replaced by `block`."""
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise SystemExit(f"no {begin} ... {end} block in the page")
    return text[:i + len(begin)] + "\n" + block + text[j:]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-server", default=str(ROOT / "build" / "peers" / "cmake" / "bin" / "llama-server"))
    ap.add_argument("--specrun", default=str(Path(sys.executable).with_name("specrun")))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--table", choices=sorted(TABLES), default="peers",
                    help="peers: speed against llama-server (peers markers, results/peers.json); spec: "
                         "n-gram family and draft-eagle3 with acceptance and tokens per pass (spec-peers markers, "
                         "results/spec_peers.json); mtp: draft-mtp on the synthetic qwen35, as spec (mtp-peers markers, "
                         "results/mtp_peers.json). Sets the defaults of --workloads, --settings and --out")
    ap.add_argument("--workloads", help="comma-separated (default: the table's)")
    ap.add_argument("--settings", help="comma-separated (default: the table's)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="run each server alone, one after the other (default: both up at once, requests alternating)")
    ap.add_argument("--max-busy", type=float, default=0.25,
                    help="before each server, wait until other work uses at most this share of the CPUs")
    ap.add_argument("--wait-quiet", type=float, default=900, help="seconds to wait for that, at most (then run)")
    ap.add_argument("--retries", type=int, default=5,
                    help="measure a request again (at most this often) when other work took more than --max-busy "
                         "of the CPUs while it ran")
    ap.add_argument("--out", help="JSON; the markdown goes next to it (.md) (default: the table's, in benchmarks/results)")
    ap.add_argument("--from-json", help="render an earlier run's JSON (its .md next to it) instead of measuring")
    ap.add_argument("--docs", action="store_true", help="put the table between its markers in docs/benchmarks.md")
    args = ap.parse_args(argv)
    table = TABLES[args.table]
    args.out = args.out or str(RESULTS / table.out)
    for opt, known in (("workloads", WORKLOADS), ("settings", SETTINGS)):
        names = [x.strip() for x in (getattr(args, opt) or ",".join(getattr(table, opt))).split(",") if x.strip()]
        bad = set(names) - {k.name for k in known}
        if bad:
            ap.error(f"--{opt}: unknown {', '.join(sorted(bad))} (known: {', '.join(k.name for k in known)})")
        setattr(args, opt, names)
    args.systems = [s.strip() for s in args.systems.split(",")]
    if set(args.systems) - set(SYSTEMS):
        ap.error(f"--systems: one or both of {', '.join(SYSTEMS)}")
    if "llama-server" in args.systems and not args.from_json and not Path(args.llama_server).is_file():
        ap.error(f"no llama-server at {args.llama_server}: `make peers-server` builds it")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))       # stop the running server on the way out
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        data = run(args)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
    md = (markdown if table.name == "peers" else spec_markdown)(data)
    Path(args.from_json or args.out).with_suffix(".md").write_text(md)
    print(md)
    if args.docs:                                   # only this table's block: the other tables' rows stay
        DOCS.write_text(replace_block(DOCS.read_text(encoding="utf-8"), md, table.begin, table.end), encoding="utf-8")
        print(f"[peers] {DOCS.relative_to(ROOT)}: the table between {table.begin} and {table.end} replaced",
              file=sys.stderr)


if __name__ == "__main__":
    main()
