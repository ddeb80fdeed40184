"""llama.cpp's RPC backend under the speculative engine (issue 16, items 1-3).

Real processes on loopback: two `specrun rpc-worker`s, the model split across them with
--tensor-split, and `specrun run --rpc` / `specrun serve --rpc` as clients. Every spec type over
RPC equals local `none` token for token, greedy and seeded (the workers run the same CPU kernels
under exact mode's settings). A worker killed mid-generation ends `run` with one line and exit 1,
and makes the server answer that request with a JSON 5xx while /health and /v1/models still answer.
Bad input (no worker there, another protocol version, a worker busy with another client, a split
that does not add up, a build without RPC, a port in use) is one line and exit 1, checked before
llama.cpp could abort the process.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import SPECRUN, ServerProcess, wait_for

from specrun.gguf_spec.testmodel_eagle3 import TINY as EAGLE3_TINY
from specrun.gguf_spec.testmodel_eagle3 import write_eagle3_pair
from specrun.kernels import rpc

MODEL = "smollm2-135m-instruct"
LONG = "the quick brown fox jumps over the lazy dog while the cat sleeps. " * 24    # > 256 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Worker:
    """`specrun rpc-worker --port P` as a subprocess, ready once a hello is answered."""

    def __init__(self, tmp: Path, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = tmp / f"worker-{self.port}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([SPECRUN, "rpc-worker", "--port", str(self.port), "-t", "1", *args],
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        self.endpoint = f"127.0.0.1:{self.port}"

    def wait_ready(self) -> Worker:
        def ready():
            assert self.proc.poll() is None, self.log()
            with contextlib.suppress(rpc.RpcError):
                return rpc.probe(rpc.parse_endpoint(self.endpoint), timeout=2)
        wait_for(f"rpc-worker on {self.endpoint}", ready, timeout=60)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    d = tmp_path_factory.mktemp("rpc")
    ws = [Worker(d) for _ in range(2)]
    try:
        yield [w.wait_ready() for w in ws]
    finally:
        for w in ws:
            w.kill()


def specrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SPECRUN, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr and "Fatal Python error" not in r.stderr, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("Error:") or ln.startswith("error:")]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# ---- units: addresses, splits, the hello probe (no model) ------------------------------------------


@pytest.mark.parametrize("text, says", [
    ("localhost", "expected HOST:PORT"), ("127.0.0.1:0", "port 1-65535"), ("127.0.0.1:70000", "port 1-65535"),
    (":50052", "expected HOST:PORT"), ("no-such-host.invalid:50052", "cannot resolve host"),
    ("127.0.0.1:\u00b2", "expected HOST:PORT"), ("127.0.0.1:\u0661\u0669\u0665", "expected HOST:PORT"),  # str.isdigit's
])
def test_bad_endpoints(text, says):
    with pytest.raises(rpc.RpcError, match=says):
        rpc.parse_endpoint(text)


def test_endpoints_list():
    eps = rpc.parse_endpoints("127.0.0.1:50052, localhost:50053")
    assert [str(e) for e in eps] == ["127.0.0.1:50052", "localhost:50053"]
    assert eps[1].native == "127.0.0.1:50053"
    with pytest.raises(rpc.RpcError, match="given twice"):
        rpc.parse_endpoints("127.0.0.1:50052,localhost:50052")
    with pytest.raises(rpc.RpcError, match="at most 16"):
        rpc.parse_endpoints(",".join(f"127.0.0.1:{5000 + i}" for i in range(17)))


@pytest.mark.parametrize("split, n, want", [
    ("3,1", 2, (3.0, 1.0)), ("1/1", 2, (1.0, 1.0)), ("0,1", 2, (0.0, 1.0)), (None, 2, ()), ("", 2, ()),
    ("1,1,1", 2, "3 values for 2 --rpc workers"), ("1", 2, "1 values for 2"), ("a,b", 2, "expected numbers"),
    ("-1,2", 2, ">= 0 and not all 0"), ("0,0", 2, "not all 0"), ("inf,1", 2, ">= 0"), ("1", 0, "needs --rpc"),
])
def test_tensor_split(split, n, want):
    if isinstance(want, str):
        with pytest.raises(rpc.RpcError, match=re.escape(want)):
            rpc.parse_split(split, n)
    else:
        assert rpc.parse_split(split, n) == want


def test_a_build_without_rpc_is_named_with_the_fix(tmp_path):
    with pytest.raises(rpc.RpcError, match=r"built without RPC .*CMAKE_ARGS=-DGGML_RPC=ON"):
        rpc._native(tmp_path / "libggml-rpc.so")
    assert rpc.available()     # this install has it (the Makefile builds it so)


@contextlib.contextmanager
def fake_worker(reply: bytes | None):
    """A TCP server that answers a hello with `reply` (raw payload), or never answers (None)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve():
        conn, _ = srv.accept()
        with conn:
            conn.recv(1 + 8 + 24)
            if reply is not None:
                conn.sendall(struct.pack("<Q", len(reply)) + reply)
                with contextlib.suppress(OSError):
                    conn.recv(9)
                    conn.sendall(struct.pack("<QI", 4, 1))
            stop.wait(10)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield rpc.parse_endpoint(f"127.0.0.1:{port}")
    finally:
        stop.set()
        srv.close()


def test_probe_names_each_failure():
    port = free_port()   # nothing listens there
    with pytest.raises(rpc.RpcError, match=rf"cannot reach RPC worker 127.0.0.1:{port}: connection refused; "
                                           rf"start one there with `specrun rpc-worker --host 127.0.0.1 --port {port}`"):
        rpc.probe(rpc.parse_endpoint(f"127.0.0.1:{port}"))
    with fake_worker(bytes([6, 2, 0, 0]) + bytes(24)) as ep, \
            pytest.raises(rpc.RpcError, match=r"speaks RPC protocol 6\.2\.0 and this llama\.cpp speaks 7\.0\.0"):
        rpc.probe(ep)
    with fake_worker(bytes([7, 1, 0, 0]) + bytes(24)) as ep, pytest.raises(rpc.RpcError, match="7.1.0"):
        rpc.probe(ep)       # a newer minor version: llama.cpp refuses it too
    with fake_worker(None) as ep, pytest.raises(rpc.RpcError, match="did not answer within 0.5 s: a worker serves one client.*or the address is not an RPC worker"):
        rpc.probe(ep, timeout=0.5)
    with fake_worker(bytes([7, 0, 3, 0]) + bytes(24)) as ep:
        assert rpc.probe(ep).version == (7, 0, 3)    # a patch level apart: fine


# ---- the worker command --------------------------------------------------------------------------


def test_worker_cache_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([SPECRUN, "rpc-worker", "--port", str(port), "-c"], capture_output=True, text=True, timeout=60,
                       stdin=subprocess.DEVNULL, env=dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "a-file")))
    one_line_error(r, f"-c: cannot make the tensor cache folder {tmp_path / 'a-file'}/specrun/rpc (Not a directory)")


def test_worker_refuses_a_port_in_use_and_warns_off_loopback(tmp_path, workers):
    r = specrun("rpc-worker", "--port", str(workers[0].port), timeout=60)
    one_line_error(r, f"cannot listen on 127.0.0.1:{workers[0].port}", "choose another --port")
    w = Worker(tmp_path, "--host", "127.0.0.2")      # loopback, but not 127.0.0.1: llama.cpp's warning
    try:
        w.endpoint = f"127.0.0.2:{w.port}"
        w.wait_ready()
        assert "WARNING: Host ('127.0.0.2') is != '127.0.0.1'" in w.log()
        assert "Never expose the RPC server to an open network!" in w.log()
        w.proc.send_signal(signal.SIGTERM)
        assert w.proc.wait(10) == 0
    finally:
        w.kill()


def in_process(*args: str) -> subprocess.CompletedProcess:
    """`specrun ARGS` through click's CliRunner, as a CompletedProcess (for refusals made before
    llama.cpp is asked for anything)."""
    from click.testing import CliRunner

    from specrun.cli.main import cli

    r = CliRunner().invoke(cli, list(args))
    return subprocess.CompletedProcess([SPECRUN, *args], r.exit_code, r.stdout, r.stderr)


def test_client_errors_are_one_line(workers):
    dead = free_port()
    one_line_error(specrun("-m", MODEL, "-p", "hi", "-n", "4", "--rpc", f"127.0.0.1:{dead}"),
                   f"cannot reach RPC worker 127.0.0.1:{dead}")
    one_line_error(in_process("-m", MODEL, "-p", "hi", "-n", "4", "--rpc", ",".join(w.endpoint for w in workers),
                              "--tensor-split", "1,2,3"), "3 values for 2 --rpc workers")
    one_line_error(in_process("-m", MODEL, "-p", "hi", "-n", "4", "--tensor-split", "1,1"), "needs --rpc")
    one_line_error(in_process("-m", MODEL, "-p", "hi", "-n", "4", "--rpc", "127.0.0.1"), "expected HOST:PORT")


# ---- every spec type over RPC == local none ----------------------------------------------------


def generate(model: str, prompt: str, *args: str, n: int = 48, seed: str | None = None) -> str:
    """`specrun run`'s text for this model, prompt and sampling."""
    # seeded: sample-and-match (auto would verify model drafts by speculative sampling: the same
    # distribution, another sample than plain decoding's)
    sampling = ["--temp", "0"] if seed is None else ["--temp", "0.8", "--seed", seed, "--spec-verify", "match"]
    r = specrun("-m", model, "-p", prompt, "-n", str(n), "-c", "1024", "-t", "1", "--ignore-eos", "-no-cnv", *sampling, *args)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """name -> (target, draft) files of the synthetic models, each written when a test first asks."""
    d = tmp_path_factory.mktemp("rpc-models")

    def mtp() -> tuple[Path, ...]:
        path = d / "mtp.gguf"
        r = specrun("make-test-model", str(path), "--head", "noisy:0.1", "--quant", "q8_0")   # partial acceptance
        assert r.returncode == 0, r.stderr
        r = specrun("extract-mtp", str(path), "-o", str(d / "heads.gguf"))   # -md heads: drafting stays local
        assert r.returncode == 0, r.stderr
        return path, d / "heads.gguf"

    makers = {"mtp": mtp,
              "eagle3": lambda: write_eagle3_pair(d / "e3-target.gguf", d / "e3-draft.gguf", EAGLE3_TINY, "q8_0")}
    made: dict[str, tuple[Path, ...]] = {}

    def get(model: str) -> tuple[Path, ...] | None:
        if model in makers and model not in made:
            made[model] = makers[model]()
        return made.get(model)

    return get


_local: dict[tuple, str] = {}


def local_none(path: str, prompt: str, seed: str | None) -> str:
    """Local `none`'s text, once per model, prompt and seed for the module. Over RPC the fast
    prompt path is off (its state copy would cross the network): locally too."""
    key = (path, prompt, seed)
    if key not in _local:
        _local[key] = generate(path, prompt, "--spec-type", "none", "--no-fast-prefill", seed=seed)
        assert _local[key].strip()
    return _local[key]


CASES = {   # name -> (model, extra flags); n-gram drafts need a prompt that repeats
    "none": (MODEL, ("--spec-type", "none")),
    "ngram-simple": (MODEL, ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                             "--spec-ngram-simple-size-m", "16")),
    "ngram-mod": (MODEL, ("--spec-type", "ngram-mod")),
    "draft": (MODEL, ("--spec-type", "draft", "-md", MODEL, "--spec-draft-n-max", "4")),
    "draft-mtp": ("mtp", ("--spec-type", "draft-mtp", "--spec-draft-n-max", "3")),
    "draft-mtp -md heads": ("mtp", ("--spec-type", "draft-mtp", "-md", "{draft}", "--spec-draft-n-max", "3")),
    "draft-eagle3": ("eagle3", ("--spec-type", "draft-eagle3", "-md", "{draft}", "--spec-draft-n-max", "4")),
}
PROMPTS = {"short": "Write a short story about a fox.", "long": LONG}


# make test: ngram-simple, greedy, on the long prompt (past 256 tokens, and it repeats, so drafts are
# verified over RPC); every other spec type, seeded sampling and the short prompt are the grid's tail
@pytest.mark.slow
@pytest.mark.parametrize("name, seed, prompt", [
    pytest.param(name, seed, prompt, id=f"{'greedy' if seed is None else 'seeded'}-{name}-{prompt}",
                 marks=() if (name, seed, prompt) == ("ngram-simple", None, "long") else pytest.mark.full)
    for seed in (None, "7") for name in CASES for prompt in PROMPTS])
def test_every_spec_type_over_two_workers_equals_local_none(workers, synthetic, name, seed, prompt):
    model, flags = CASES[name]
    files = synthetic(model)
    path = str(files[0]) if files else model
    flags = tuple(str(files[1]) if f == "{draft}" else f for f in flags)
    rpc_flags = ("--rpc", ",".join(w.endpoint for w in workers), "--tensor-split", "1,2")
    local = local_none(path, PROMPTS[prompt], seed)
    assert generate(path, PROMPTS[prompt], *flags, *rpc_flags, seed=seed) == local, (name, prompt)


# ---- a worker lost mid-generation ------------------------------------------------------------------


def _long_run(endpoints: str) -> subprocess.Popen:
    return subprocess.Popen([SPECRUN, "-m", MODEL, "-no-cnv", "-p", "Count from one to one thousand:", "-n", "3000",
                             "--ignore-eos", "--temp", "0", "-c", "4096", "-t", "1", "--rpc", endpoints],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
def test_run_ends_with_one_line_when_a_worker_dies(tmp_path):
    ws = [Worker(tmp_path) for _ in range(2)]
    try:
        for w in ws:
            w.wait_ready()
        p = _long_run(",".join(w.endpoint for w in ws))
        first = p.stdout.read(64)                 # generating over both workers
        assert first, p.stderr.read().decode()
        ws[1].kill()
        out, err = p.communicate(timeout=60)
        err = err.decode()
        assert p.returncode == 1, (p.returncode, err)
        assert "Traceback" not in err and "Fatal Python error" not in err and "GGML_ASSERT" not in err, err
        lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and f"RPC worker {ws[1].endpoint} stopped answering mid-generation" in lines[0], err
        text = (first + out).decode()             # what was generated stays on stdout, whole lines of it
        assert text.strip() and "error" not in text
    finally:
        for w in ws:
            w.kill()


@pytest.mark.slow
def test_server_answers_5xx_and_keeps_answering_when_a_worker_dies(tmp_path):
    ws = [Worker(tmp_path) for _ in range(2)]
    srv = None
    try:
        for w in ws:
            w.wait_ready()
        srv = ServerProcess(tmp_path, "-m", MODEL, "-c", "4096", "-t", "1", "--rpc", ",".join(w.endpoint for w in ws))
        assert srv.completion("Hello", 8)["content"]          # served over RPC
        got: dict = {}

        def long_request():
            got["r"] = httpx.post(f"{srv.url}/completion", json={"prompt": "Count from one to one thousand:",
                                  "n_predict": 3000, "ignore_eos": True, "temperature": 0}, timeout=120)

        t = threading.Thread(target=long_request)
        t.start()
        wait_for("the long request running", lambda: httpx.get(f"{srv.url}/health").json().get("slots_processing"))
        time.sleep(0.5)
        ws[0].kill()
        t.join(90)
        r = got["r"]
        assert r.status_code == 502, r.text
        assert "rpc_worker_lost" in r.text and f"RPC worker {ws[0].endpoint} stopped answering" in r.json()["error"]["message"]
        h = httpx.get(f"{srv.url}/health", timeout=10)
        assert h.status_code == 503 and "stopped answering" in h.text
        assert httpx.get(f"{srv.url}/v1/models", timeout=10).status_code == 200
        again = httpx.post(f"{srv.url}/completion", json={"prompt": "Hi", "n_predict": 4}, timeout=10)
        assert again.status_code == 503 and "rpc_worker_lost" in again.text
        assert srv.proc.poll() is None                        # never aborted
        assert srv.terminate(30) == 1
        log = srv.log()
        assert "Traceback" not in log and "Fatal Python error" not in log, log
        assert re.search(r"^error: RPC worker .* stopped answering", log, re.M), log
    finally:
        if srv is not None and srv.proc.poll() is None:
            srv.proc.kill()
        for w in ws:
            w.kill()
