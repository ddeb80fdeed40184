"""Speculative decoding over llama.cpp's RPC backend: local against two loopback workers.

    python benchmarks/rpc_bench.py [--reps 3] [-n 96] [--latency 0,1,5,20] [--docs]

The model is the realistic MTP test model (`specrun make-test-model --shape realistic`: qwen35, 24
trunk layers, n_embd 512, q8_0, exact head), written once under build/rpc-bench. Settings: none,
ngram-simple (n3 m16, n-max 16), draft-mtp n-max 3 with the model's own heads (on the workers, with
the layers) and with the same heads extracted (`specrun extract-mtp`) and given as -md (on this
machine: a draft step costs no round trip), greedy, on one prompt. Conditions: local
(this process's CPU), then two `specrun rpc-worker`s on 127.0.0.1 holding half the layers each,
reached directly (0 ms) and through a TCP relay that adds the given round-trip latency (half each
way) to every message. Each condition runs in a child process of its own (llama.cpp registers an
RPC endpoint once per process); the relays run in that child and count round trips: the worker's
replies (each a framed message: u64 size, payload), which the client waits for one by one.

Reports generation tokens/s (median of --reps, after one warm-up), x none within the condition,
tokens/s against local none, round trips per generated token, and whether the tokens equal local
none's. Writes benchmarks/results/rpc.json and rpc.md; --docs puts the table between
docs/benchmarks.md's rpc markers. On this 2-core machine the workers and the client share the same cores, so the
latency columns are the honest part: what the network adds, and how much of it a verify pass of
k+1 rows pays once for up to k+1 tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from peers import DOCS, cpu_model, replace_block  # benchmarks/peers.py, beside this script

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "build" / "rpc-bench"
RESULTS = ROOT / "benchmarks" / "results"
BEGIN, END = "<!-- rpc:begin -->", "<!-- rpc:end -->"
PROMPT = "Hello world, this is a test of speculative decoding over the network with the MTP head of a model"
SETTINGS = {   # name: SpecParams keyword arguments
    "none": {},
    "ngram-simple n3 m16": {"types": ("ngram-simple",), "ngram_size_n": 3, "ngram_size_m": 16, "n_max": 16},
    "draft-mtp n-max 3": {"types": ("draft-mtp",), "n_max": 3},
    "draft-mtp n-max 3, -md heads": {"types": ("draft-mtp",), "n_max": 3},   # extract-mtp's heads: local
}
LOCAL_HEADS = "draft-mtp n-max 3, -md heads"   # the heads on this machine, the trunk on the workers


# ---- a latency relay -------------------------------------------------------------------------------


class Relay:
    """127.0.0.1:port -> upstream, adding `delay` seconds each way to every chunk and counting the
    upstream's framed replies (round trips). One client at a time, as a worker serves."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        self.upstream, self.delay = upstream, delay
        self.replies = 0
        self.srv = socket.create_server(("127.0.0.1", 0))
        self.port = self.srv.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.srv.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            for s in (down, up):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._pipe(down, up, count=False)
            self._pipe(up, down, count=True)

    def _pipe(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        q: deque = deque()
        cv = threading.Condition()
        parser = _Frames(self) if count else None

        def read():
            while True:
                try:
                    data = src.recv(1 << 16)
                except OSError:
                    data = b""
                with cv:
                    q.append((time.perf_counter() + self.delay, data))
                    cv.notify()
                if not data:
                    return
                if parser:
                    parser.feed(data)

        def write():
            while True:
                with cv:
                    while not q:
                        cv.wait()
                    due, data = q.popleft()
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                if not data:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    return
                try:
                    dst.sendall(data)
                except OSError:
                    return

        threading.Thread(target=read, daemon=True).start()
        threading.Thread(target=write, daemon=True).start()


class _Frames:
    """Counts the worker's replies in its byte stream: | u64 size | size bytes |, back to back."""

    def __init__(self, relay: Relay) -> None:
        self.relay, self.buf, self.need = relay, b"", None

    def feed(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need is None:
                if len(self.buf) < 8:
                    return
                self.need = struct.unpack("<Q", self.buf[:8])[0]
                self.buf = self.buf[8:]
            if len(self.buf) < self.need:
                self.need -= len(self.buf)
                self.buf = b""
                return
            self.buf = self.buf[self.need:]
            self.need = None
            self.relay.replies += 1


# ---- one condition, in a child process --------------------------------------------------------------


def child(args) -> None:
    from specrun.kernels import rpc
    from specrun.kernels.engine import Engine
    from specrun.kernels.params import EngineParams, SpecParams
    from specrun.kernels.types import SamplingParams

    relays: list[Relay] = []
    placement = None
    if args.workers:
        eps = []
        for w in args.workers.split(","):
            host, port = w.rsplit(":", 1)
            if args.latency_ms > 0:
                relays.append(Relay((host, int(port)), args.latency_ms / 2000))
                eps.append(rpc.parse_endpoint(f"127.0.0.1:{relays[-1].port}"))
            else:
                eps.append(rpc.parse_endpoint(w))
        placement = rpc.Placement(tuple(eps), (1.0,) * len(eps))
    params = EngineParams(n_ctx=2048, n_threads=args.threads, placement=placement, spec=SpecParams(types=("draft-mtp",)))
    main = Engine(args.model, params)
    heads = Engine(args.model, replace(params, draft_model=args.heads))    # the target without its own heads
    prompt = main.tokenize(PROMPT)
    out = {}
    for rep in range(args.reps + 1):           # rep 0: warm-up
        for name, kw in SETTINGS.items():
            engine = heads if name == LOCAL_HEADS else main
            engine.reset()
            before = sum(r.replies for r in relays)
            gen = engine.generate(prompt, args.n_predict, SamplingParams(temp=0.0), spec=SpecParams(**kw))
            toks = [t for ch in gen for t in ch]
            st = gen.stats
            if rep == 0:
                continue
            o = out.setdefault(name, {"tps": [], "tokens": toks, "tokens_per_pass": st.tokens_per_pass,
                                      "acceptance": st.acceptance_rate if st.drafters else None, "round_trips": []})
            o["tps"].append(st.gen_tps)
            if relays:
                # round trips of the whole request (prompt included) per generated token
                o["round_trips"].append((sum(r.replies for r in relays) - before) / max(1, st.n_gen))
    heads.close()
    main.close()
    print(json.dumps(out))


# ---- the parent -------------------------------------------------------------------------------------


def model_path(specrun: str) -> tuple[Path, Path]:
    """The realistic MTP test model and its heads alone (`specrun extract-mtp`), written once."""
    p, h = OUT / "mtp-realistic-q8_0.gguf", OUT / "mtp-realistic-q8_0-heads.gguf"
    if not p.exists():
        OUT.mkdir(parents=True, exist_ok=True)
        subprocess.run([specrun, "make-test-model", str(p), "--shape", "realistic", "--head", "exact",
                        "--quant", "q8_0"], check=True)
    if not h.exists():
        subprocess.run([specrun, "extract-mtp", str(p), "-o", str(h)], check=True)
    return p, h


def start_workers(specrun: str, n: int, threads: int) -> tuple[list[subprocess.Popen], list[str]]:
    from specrun.kernels import rpc

    procs, eps = [], []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs.append(subprocess.Popen([specrun, "rpc-worker", "--port", str(port), "-t", str(threads)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        eps.append(f"127.0.0.1:{port}")
    for ep in eps:
        deadline = time.monotonic() + 60
        while True:
            try:
                rpc.probe(rpc.parse_endpoint(ep), timeout=2)
                break
            except rpc.RpcError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    return procs, eps


def render(res: dict) -> str:
    local_none = statistics.median(res["conditions"]["local"]["none"]["tps"])
    ref = res["conditions"]["local"]["none"]["tokens"]
    lines = [f"Measured {res['date']} at commit `{res['commit']}`; {res['cpu']}. Realistic MTP test model "
             f"(qwen35, 24 layers, n_embd 512, q8_0, exact head), greedy, {res['n_predict']} tokens, median of "
             f"{res['reps']} after a warm-up. RPC: two `specrun rpc-worker`s on 127.0.0.1, half the layers each "
             "(--tensor-split 1,1); added latency is per round trip, half each way, through a relay that also "
             "counts the round trips (the worker's replies, prompt included, per generated token).", "",
             "| condition | setting | tok/s | × none | × local none | round trips / token | tokens / pass | = local none |",
             "|---|---|---|---|---|---|---|---|"]
    for cond, rows in res["conditions"].items():
        none = statistics.median(rows["none"]["tps"])
        for name, r in rows.items():
            tps = statistics.median(r["tps"])
            rt = f"{statistics.median(r['round_trips']):.1f}" if r["round_trips"] else "–"
            lines.append(f"| {cond} | {name} | {tps:.1f} | {tps / none:.2f} | {tps / local_none:.2f} | {rt} | "
                         f"{r['tokens_per_pass']:.2f} | {'yes' if r['tokens'] == ref else '**no**'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("-n", "--n-predict", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--latency", default="0,1,5,20", help="added round-trip latencies in ms (0: direct)")
    ap.add_argument("--specrun", default=str(Path(sys.executable).with_name("specrun")))
    ap.add_argument("--docs", action="store_true", help="put the table between its markers in docs/benchmarks.md")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--heads", help=argparse.SUPPRESS)
    ap.add_argument("--workers", default="", help=argparse.SUPPRESS)
    ap.add_argument("--latency-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    model, heads = model_path(args.specrun)
    procs, eps = start_workers(args.specrun, 2, args.threads)
    base = [sys.executable, __file__, "--child", "--model", str(model), "--heads", str(heads), "--reps", str(args.reps),
            "-n", str(args.n_predict), "--threads", str(args.threads)]
    conds = {"local": []} | {(f"RPC +{ms} ms" if float(ms) else "RPC direct"): ["--workers", ",".join(eps),
                                                                              "--latency-ms", ms]
                             for ms in args.latency.split(",")}
    res = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip(),
           "cpu": f"{cpu_model()}, {os.cpu_count()} cores", "n_predict": args.n_predict, "reps": args.reps, "conditions": {}}
    try:
        for cond, extra in conds.items():
            print(f"{cond} ...", file=sys.stderr, flush=True)
            r = subprocess.run(base + extra, capture_output=True, text=True, check=True, timeout=3600)
            res["conditions"][cond] = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            p.kill()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "rpc.json").write_text(json.dumps(res, indent=1))
    md = render(res)
    (RESULTS / "rpc.md").write_text(md)
    print(md)
    if args.docs:
        DOCS.write_text(replace_block(DOCS.read_text(encoding="utf-8"), md, BEGIN, END), encoding="utf-8")


if __name__ == "__main__":
    main()
