"""/health's latency while `specrun serve` works on a heavy request (issue 48, item 7).

    python benchmarks/server_loop.py [--model smollm2-135m-instruct] [--src DIR] [--interval 0.01]
        [--out benchmarks/results/server_loop.json]

One server (1 thread, -c 512). For each heavy request (all under the 8 MiB body limit), a client
process sends it while this one polls GET /health every --interval seconds; the table gives the heavy
request's status and time, and /health's median and worst latency while it was in flight. The
server's event loop answers /health: its worst latency is the longest the loop was held. The first
row polls /health alone for 5 s: the machine's own noise.
--src DIR runs the server from another checkout of specrun (a `git worktree` of an older commit:
the numbers before a change), with that checkout first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from peers import RESULTS, free_port, git_state, serving, write_results  # noqa: E402

GREEDY = {"prompt": "The capital of France is", "n_predict": 1, "temperature": 0}


def heavy_requests() -> list[tuple[str, str | None, bytes]]:
    """(name, path, body): the issue's requests, and what the limits still let through."""
    def body(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    alternation = lambda n: "root ::= " + " | ".join(f'"w{i:06d}"' for i in range(n))   # noqa: E731
    return [
        ("nothing (/health alone)", None, b""),
        ("/detokenize, 3.9M ids", "/detokenize", b'{"tokens":[' + b",".join([b"7"] * 3_900_000) + b"]}"),
        ("/tokenize with_pieces, 7.8 MB", "/tokenize", body({"content": "hello world " * 650_000,
                                                               "with_pieces": True})),
        ("logit_bias, 300k text keys", "/completion", body({**GREEDY, "logit_bias": {f"w{i}x": -1.0
                                                                                     for i in range(300_000)}})),
        ("logit_bias, 262144 id pairs", "/completion", body({**GREEDY, "logit_bias": [[i % 1000, -1.0]
                                                                                     for i in range(262_144)]})),
        ("/completion, prompt of 3.9M ids", "/completion", b'{"n_predict":1,"prompt":['
         + b",".join([b"7"] * 3_900_000) + b"]}"),
        ("logit_bias, 4096 text keys", "/completion", body({**GREEDY, "logit_bias": {f"w{i}x": -1.0
                                                                                     for i in range(4096)}})),
        ("grammar, 769 KB", "/completion", body({**GREEDY, "grammar": alternation(64_000)})),
        ("grammar, 220 KB", "/completion", body({**GREEDY, "grammar": alternation(18_500)})),
        ("json_schema, enum of 20k", "/completion", body({**GREEDY, "json_schema": {
            "type": "object", "properties": {"a": {"enum": [f"value-{i:06d}" for i in range(20_000)]}}}})),
    ]


_CLIENT = """
import sys, time, urllib.request, urllib.error
body = open(sys.argv[2], "rb").read()
req = urllib.request.Request(sys.argv[1], data=body, headers={"Content-Type": "application/json"})
t0 = time.perf_counter()
try:
    with urllib.request.urlopen(req, timeout=900) as r:
        r.read()
        status = r.status
except urllib.error.HTTPError as e:
    status = e.code
print(status, time.perf_counter() - t0)
"""


def measure(url: str, path: str | None, body: bytes, interval: float, tmp: str) -> dict:
    """The heavy request from a process of its own (its client's work never delays the polls);
    path None: no heavy request, /health alone for 5 s (the machine's noise)."""
    if path is None:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5); print('- 5.0')"],
                                 stdout=subprocess.PIPE, text=True)
    else:
        Path(tmp, "body.json").write_bytes(body)
        child = subprocess.Popen([sys.executable, "-c", _CLIENT, url + path, str(Path(tmp, "body.json"))],
                                 stdout=subprocess.PIPE, text=True)
    lat: list[float] = []
    while child.poll() is None:
        t0 = time.perf_counter()
        with urllib.request.urlopen(url + "/health", timeout=900) as r:
            r.read()
        lat.append(time.perf_counter() - t0)
        time.sleep(interval)
    status, seconds = child.stdout.read().split()
    return {"status": None if status == "-" else int(status), "seconds": float(seconds), "health_n": len(lat),
            "health_median_ms": statistics.median(lat) * 1e3, "health_max_ms": max(lat) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--src", default=None, help="run the server from this checkout of specrun")
    ap.add_argument("--interval", type=float, default=0.01)
    ap.add_argument("--out", default=str(RESULTS / "server_loop.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.src:   # `import specrun` finds the other checkout first (the server inherits the variable)
            os.symlink(Path(args.src).resolve(), Path(tmp) / "specrun")
            os.environ["PYTHONPATH"] = tmp
        cmd = [sys.executable, "-c", "from specrun.cli.main import main; main()", "serve", "-m", args.model, "-t", "1", "-c", "512",
               "--host", "127.0.0.1", "--port", str(free_port())]
        rows = []
        with serving(cmd, Path(tmp) / "server.log") as (url, _pid):
            for name, path, body in heavy_requests():
                row = {"request": name, "body_bytes": len(body), **measure(url, path, body, args.interval, tmp)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    commit, dirty = git_state()
    data = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit, "dirty": dirty,
            "src": args.src, "model": args.model, "cpus": os.cpu_count(), "rows": rows}
    md = [f"# /health while the server works on a heavy request ({args.model}, {args.src or 'this checkout'})", "",
          "| request | body | status | its time | /health median | /health worst |", "|---|---|---|---|---|---|"]
    md += [f"| {r['request']} | {r['body_bytes'] / 2**20:.1f} MiB | {r['status'] or '-'} | {r['seconds']:.2f} s | "
           f"{r['health_median_ms']:.1f} ms | {r['health_max_ms']:.0f} ms |" for r in rows]
    write_results(args.out, data, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
