"""The fast prompt context in a child process of its own, where llama.cpp's tiled matmul is on.

Exact mode turns the tiled K-quant matmul off (``GGML_CPU_TILED_MM=0``, kernels/llama.py), and
ggml reads that switch once per process, so the fast prompt context (kernels/prefill.py) in the
exact context's process runs without it, where llama-server uses it. On x86 the tiled kernel takes
Q2_K..Q6_K and the IQ types that are not repacked: Q6_K in a Q4_K_M file (what the kernel is worth:
`make bench-prompt-kernels`). So for a file with such tensors (uses_worker) the engine's FastPrefill runs in
``python -m specrun.kernels.prefill_worker``, started at the first long prompt, with the variable
removed from its environment: the same block rules, the same re-encoding (kvstate.quantize_k),
only the kernels differ, and only in the prompt's KV (a function of the tokens, as before).

Protocol over the child's stdin / stdout: frames of a u32 length, a JSON header, then the payload
the header sizes. Parent -> child: {"op": "state", "id", "n", "layers", "rows_from"} + int32 [n]
tokens (layers: [] unless rows are wanted, prefill.RowsWanted); {"op": "cancel", "id"} (polled by
the child between blocks; one for an older request is ignored); {"op": "forget"}; {"op": "exit"}.
Child -> parent: {"ok": true, "weights_mib"} once loaded; per state request first, when layers
were given, {"ok": true, "rows": pos0, "n": m, "width": w} + float32 [m, w] after each decode,
then {"ok": true, "cancelled": true}, or {"ok": true, "state": S, "logits": V, "n_evaluated",
"kv_mib"} + S bytes + float32 [V], or {"ok": false, "error", "kv_state"}. The child's stderr is
the parent's.

If the child cannot start or dies (a signal, memory), one warning, and the same FastPrefill runs in
this process from then on (without the tiled kernel): the prompt in flight is evaluated again here.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import select
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable

import numpy as np

from .kvstate import KVStateError
from .llama import LlamaError, Model
from .prefill import FastPrefill, RowsWanted

log = logging.getLogger(__name__)

TILED_ENV = "GGML_CPU_TILED_MM"
# ggml-cpu/tiled/tiled.cpp, ggml_tiled_supported; Q4_K is left out: x86 repacks it (CPU_REPACK's
# q4_K_8x8 on AVX2), and a repacked tensor never takes the tiled kernel
TILED_TYPES = frozenset({"Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                         "IQ3_S", "IQ1_S", "IQ1_M"})
START_TIMEOUT_S = 300.0     # the child's load of the model (its file pages are this process's)
POLL_S = 0.05               # how often the parent asks cancel() while the child evaluates
# The worker keeps prefill.MIN_PROMPT's line (256 tokens): below it, starting the child costs a
# one-shot run more than the kernel saves (docs/design.md, "The fast prompt path"). A server starts
# its worker with the model (start()), so that no request waits for it; its slots (-np > 1) share
# one worker (SharedPrefill), one prompt at a time: a worker per slot would hold a repacked copy of
# the weights per slot.


def uses_worker(model: Model) -> bool:
    """Whether a model's fast prompt context should run in a child process: on x86 (where ggml has
    the tiled kernel), for a file with tensors of a type the tiled kernel takes (as llama.cpp's
    loader counted them)."""
    return (platform.machine().lower() in ("x86_64", "amd64")
            and any(model.tensor_types.get(t, 0) > 0 for t in TILED_TYPES))


class _WorkerGone(Exception):
    pass


def _send(f, header: dict, *payloads: bytes | memoryview) -> None:
    h = json.dumps(header).encode()
    f.write(struct.pack("<I", len(h)) + h)
    for p in payloads:
        f.write(p)
    f.flush()


def _read_exact(f, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = f.readinto(view[got:])
        if not k:
            raise _WorkerGone("its pipe closed")
        got += k
    return buf


def _recv_header(f) -> dict:
    (n,) = struct.unpack("<I", _read_exact(f, 4))
    return json.loads(bytes(_read_exact(f, n)))


class PrefillWorker:
    """FastPrefill's interface (state, logits, n_evaluated, kv_mib, weights_mib, forget, close),
    its work done by a child process; see the module docstring."""

    def __init__(self, model: Model, n_ctx_max: int, n_threads: int, rot: tuple[int, int],
                 k_type: str = "q8_0") -> None:
        self.model, self.n_ctx_max, self.n_threads, self.rot = model, n_ctx_max, n_threads, rot
        self.k_type = k_type
        self.proc: subprocess.Popen | None = None
        self.local: FastPrefill | None = None      # set once the child is gone: the work stays here
        self.n_evaluated = 0
        self.kv_mib = 0.0
        self.weights_mib = 0.0
        self.logits: np.ndarray | None = None
        self._id = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    @property
    def process_mib(self) -> float:
        """The child's private memory (Linux's RssAnon: its heap, repacked weights, KV cache and
        compute buffers; the model file's pages are shared with this process); 0 when it is not
        running (or the system does not say)."""
        pid = self.pid
        if pid is None:
            return 0.0
        try:
            for line in open(f"/proc/{pid}/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def _start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != TILED_ENV}
        cmd = [sys.executable, "-m", __name__, self.model.path, str(self.n_ctx_max), str(self.n_threads),
               str(self.rot[0]), str(self.rot[1]), self.k_type]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        if not select.select([self.proc.stdout], [], [], START_TIMEOUT_S)[0]:
            raise _WorkerGone(f"it did not load the model within {START_TIMEOUT_S:.0f} s")
        hdr = _recv_header(self.proc.stdout)
        if not hdr.get("ok"):
            raise _WorkerGone(hdr.get("error", "it could not load the model"))
        self.weights_mib = float(hdr["weights_mib"])
        log.info("fast prompts in a child process (pid %d, tiled matmul on)", self.proc.pid)

    def start(self) -> None:
        """Start the child now rather than at the first long prompt (a server, at load, so that no
        request waits for it); if it cannot start, one warning and the work stays in this process."""
        if self.local is None and self.proc is None:
            try:
                self._start()
            except (_WorkerGone, OSError, ValueError) as e:
                self._stay_here(e)

    def _stay_here(self, e: BaseException) -> None:
        code = self.proc.poll() if self.proc is not None else None
        why = f"{e}" + (f"; exit status {code}" if code is not None else "")
        log.warning("the fast prompt worker stopped (%s); fast prompts go on in this process", why)
        self._kill()
        self.local = FastPrefill(self.model, self.n_ctx_max, self.n_threads, self.rot, self.k_type)

    def state(self, prompt: np.ndarray, cancel: Callable[[], bool], rows: RowsWanted | None = None
              ) -> bytes | bytearray | None:
        """As FastPrefill.state."""
        if self.local is None:
            try:
                if self.proc is None:
                    self._start()
                return self._remote(np.ascontiguousarray(prompt, dtype=np.int32), cancel, rows)
            except (KVStateError, LlamaError):
                raise                # the worker's answer, read whole: the pipe is in step
            except (_WorkerGone, OSError, ValueError) as e:
                self._stay_here(e)
            except BaseException:
                # interrupted mid-request (Ctrl-C in cancel(), a signal): its answer may still come,
                # or come in part, so the pipe is out of step; the next prompt starts another worker
                self._kill()
                raise
        got = self.local.state(prompt, cancel, rows)
        self.n_evaluated, self.kv_mib, self.weights_mib = self.local.n_evaluated, self.local.kv_mib, self.local.weights_mib
        self.logits = self.local.logits
        return got

    def _remote(self, prompt: np.ndarray, cancel: Callable[[], bool], rows: RowsWanted | None
                ) -> bytearray | None:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self._id += 1
        self.logits = None
        _send(self.proc.stdin, {"op": "state", "id": self._id, "n": len(prompt),
                                "layers": list(rows.layers) if rows else [], "rows_from": rows.start if rows else 0},
              prompt.tobytes())
        asked = False
        while True:
            while not select.select([self.proc.stdout], [], [], POLL_S)[0]:
                if self.proc.poll() is not None:
                    raise _WorkerGone("it exited")
                if not asked and cancel():
                    _send(self.proc.stdin, {"op": "cancel", "id": self._id})
                    asked = True
            hdr = _recv_header(self.proc.stdout)
            if "rows" not in hdr:
                break
            n, width = int(hdr["n"]), int(hdr["width"])
            got = np.frombuffer(_read_exact(self.proc.stdout, 4 * n * width), dtype=np.float32).reshape(n, width)
            if rows is not None:
                rows.on_rows(int(hdr["rows"]), got)
        if not hdr.get("ok"):
            raise (KVStateError if hdr.get("kv_state") else LlamaError)(hdr.get("error", "the worker failed"))
        if hdr.get("cancelled"):
            return None
        state = _read_exact(self.proc.stdout, int(hdr["state"]))
        self.logits = np.frombuffer(_read_exact(self.proc.stdout, 4 * int(hdr["logits"])), dtype=np.float32)
        self.n_evaluated, self.kv_mib = int(hdr["n_evaluated"]), float(hdr["kv_mib"])
        return state

    def forget(self) -> None:
        """Drop the blocks held (the child's, or this process's)."""
        if self.local is not None:
            self.local.forget()
        elif self.pid is not None:
            try:
                _send(self.proc.stdin, {"op": "forget"})
            except OSError:
                pass                 # gone: the next state() says so and starts over here
        self.logits = None

    def _kill(self) -> None:
        if self.proc is None:
            return
        p, self.proc = self.proc, None
        if p.poll() is None:
            p.kill()
        p.wait()
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                _send(self.proc.stdin, {"op": "exit"})
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()
        if self.local is not None:
            self.local.close()
            self.local = None
        self.logits = None

    def __del__(self) -> None:
        if self.proc is not None:
            self._kill()


class SharedPrefill:
    """One PrefillWorker for the engines of a server's slots over one model (-np > 1): one repacked
    copy of the weights and one child for them all, one prompt at a time (a prompt already takes
    every thread). handle() gives each engine FastPrefill's interface; the blocks held serve every
    slot (a prompt's result is a function of its tokens alone); the last handle closed ends the
    worker."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker
        self.lock = threading.Lock()
        self.users = 0

    def handle(self) -> PrefillHandle:
        self.users += 1
        return PrefillHandle(self)


class PrefillHandle:
    """An engine's share of a SharedPrefill: state() waits for the worker (polling cancel() every
    POLL_S: None if it says stop) and keeps that prompt's numbers (logits, n_evaluated, kv_mib,
    weights_mib, process_mib) for its engine, whatever the other slots ask next."""

    def __init__(self, shared: SharedPrefill) -> None:
        self.shared: SharedPrefill | None = shared
        self.n_evaluated = 0
        self.kv_mib = self.weights_mib = self.process_mib = 0.0
        self.logits: np.ndarray | None = None

    @property
    def worker(self) -> PrefillWorker:
        if self.shared is None:
            raise RuntimeError("this engine's share of the prompt worker was closed")
        return self.shared.worker

    @property
    def pid(self) -> int | None:
        return self.worker.pid

    def state(self, prompt: np.ndarray, cancel: Callable[[], bool], rows: RowsWanted | None = None
              ) -> bytes | bytearray | None:
        """As FastPrefill.state, after the other slots' prompts."""
        w = self.worker                          # (raises once this share is closed)
        lock = self.shared.lock
        while not lock.acquire(timeout=POLL_S):
            if cancel():
                return None
        try:
            got = w.state(prompt, cancel, rows)
            self.logits = None if got is None or w.logits is None else w.logits.copy()
            self.n_evaluated, self.kv_mib, self.weights_mib, self.process_mib = (
                w.n_evaluated, w.kv_mib, w.weights_mib, w.process_mib)
            return got
        finally:
            lock.release()

    def forget(self) -> None:
        """Drop the blocks held: every slot's (they are shared)."""
        if self.shared is not None:
            with self.shared.lock:
                self.shared.worker.forget()
        self.logits = None

    def close(self) -> None:
        shared, self.shared = self.shared, None
        if shared is not None:
            shared.users -= 1
            if shared.users == 0:
                with shared.lock:
                    shared.worker.close()
        self.logits = None


def _child_main(argv: list[str]) -> int:
    """`python -m specrun.kernels.prefill_worker MODEL N_CTX_MAX N_THREADS ROT_K ROT_V K_TYPE`."""
    path, (n_ctx_max, n_threads, rot_k, rot_v), k_type = argv[0], map(int, argv[1:5]), argv[5]
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a terminal's Ctrl-C is the parent's to handle
    rd, wr = os.fdopen(0, "rb", buffering=0), os.fdopen(1, "wb", buffering=0)
    sys.stdout = sys.stderr                  # nothing else may write into the protocol
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        model = Model(path, exact=False)
    except Exception as e:                   # noqa: BLE001 - reported to the parent, which goes on without us
        _send(wr, {"ok": False, "error": str(e)})
        return 1
    fast = FastPrefill(model, n_ctx_max, n_threads, (rot_k, rot_v), k_type)
    _send(wr, {"ok": True, "weights_mib": model.repacked_mib})
    current = 0

    def cancelled() -> bool:
        while select.select([rd], [], [], 0)[0]:
            hdr = _recv_header(rd)
            if hdr.get("op") == "cancel" and hdr.get("id") == current:
                return True
        return False

    while True:
        try:
            hdr = _recv_header(rd)
        except _WorkerGone:
            return 0                         # the parent is gone
        op = hdr.get("op")
        if op == "exit":
            return 0
        if op == "forget":
            fast.forget()
        elif op == "state":
            current = int(hdr["id"])
            prompt = np.frombuffer(_read_exact(rd, 4 * int(hdr["n"])), dtype=np.int32)
            layers = tuple(int(x) for x in hdr.get("layers") or ())

            def send_rows(pos0: int, got: np.ndarray) -> None:
                got = np.ascontiguousarray(got, dtype=np.float32)
                _send(wr, {"ok": True, "rows": pos0, "n": got.shape[0], "width": got.shape[1]}, got.tobytes())

            want = RowsWanted(layers, int(hdr.get("rows_from", 0)), send_rows) if layers else None
            try:
                state = fast.state(prompt, cancelled, want)
            except (KVStateError, LlamaError) as e:
                _send(wr, {"ok": False, "error": str(e), "kv_state": isinstance(e, KVStateError)})
                continue
            if state is None:
                _send(wr, {"ok": True, "cancelled": True})
                continue
            logits = np.ascontiguousarray(fast.logits, dtype=np.float32)
            _send(wr, {"ok": True, "state": len(state), "logits": logits.size, "n_evaluated": fast.n_evaluated,
                       "kv_mib": fast.kv_mib}, state, logits.tobytes())


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
