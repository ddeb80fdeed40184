"""llama.cpp's RPC backend: a model's layers on other machines' CPUs.

A worker (`specrun rpc-worker`) serves this process's CPU backend over TCP with
``ggml_backend_rpc_start_server``; a client registers each worker with
``ggml_backend_rpc_add_server`` and loads the model onto the workers' devices, its layers split by
``tensor_split`` (llama.cpp's ``--rpc`` and ``--tensor-split``). Both are reached through ctypes
in libggml-rpc.so, which llama-cpp-python builds with ``CMAKE_ARGS=-DGGML_RPC=ON`` (the Makefile's
install step).

llama.cpp aborts the process where this module checks first:
- ``ggml_backend_rpc_add_server`` on an address where nothing answers, or a worker of another
  protocol version (GGML_ABORT in rpc_dispatcher::start): ``probe()`` connects and says hello
  itself first (the wire format of ggml-rpc.cpp: cmd byte, u64 size, payload; reply u64 size,
  payload), with a timeout, since a worker serves one client at a time;
- a worker that dies mid-generation (RPC_STATUS_ASSERT in the dispatcher thread): the abort
  callback (``ggml_set_abort_callback``) hands a WorkerLost to the handler the front end set
  (``on_worker_lost``): the CLI prints one line and exits 1; the server fails the requests in
  flight and parks the dispatcher thread, so the process never reaches abort().

Exactness holds over RPC because a worker runs the same CPU kernels under the same settings: its
buffers are plain CPU buffers (a worker never repacks), and it sets GGML_CPU_TILED_MM=0 before its
first matmul, as exact mode does in the client (kernels/llama.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import llama_cpp as L

from specrun.gguf_spec.errors import SpecrunError

log = logging.getLogger(__name__)

PROTO = (7, 0, 0)        # RPC_PROTO_{MAJOR,MINOR,PATCH}_VERSION, ggml/include/ggml-rpc.h (0.3.36)
DEFAULT_PORT = 50052     # rpc-server's default (tools/rpc/rpc-server.cpp)
MAX_SERVERS = 16         # GGML_RPC_MAX_SERVERS
_CMD_HELLO, _CMD_DEVICE_COUNT = 14, 15      # enum rpc_cmd, ggml-rpc.cpp
_CAPS = 24               # RPC_CONN_CAPS_SIZE (transport.h): all zero = plain TCP, no RDMA
_DEVICE_CPU = 0          # GGML_BACKEND_DEVICE_TYPE_CPU
_TILED_ENV = "GGML_CPU_TILED_MM"
# rpc-server.cpp prints this for any host but 127.0.0.1; `specrun rpc-worker` prints the same
NO_AUTH_WARNING = ("WARNING: Host ('{host}') is != '127.0.0.1'\n"
                   "         Never expose the RPC server to an open network!\n"
                   "         This is an experimental feature and is not secure!")


class RpcError(SpecrunError):
    """An RPC set-up that cannot work: no RPC in this build, a bad address or split, a worker that
    does not answer or speaks another protocol version."""


class WorkerLost(SpecrunError):
    """A worker stopped answering while the model was running on it."""


# ---- the native library ------------------------------------------------------------------------

_lib: ctypes.CDLL | None = None
_fns: dict = {}                 # name -> typed ggml function (_native)
_lib_lock = threading.Lock()


def lib_path() -> Path:
    """Where llama-cpp-python keeps libggml-rpc.so (beside libllama.so)."""
    return Path(L.__file__).parent / "lib" / "libggml-rpc.so"


def _native(path: Path | None = None) -> ctypes.CDLL:
    """libggml-rpc.so with its functions typed (once); RpcError when this build has no RPC."""
    global _lib
    with _lib_lock:
        if _lib is not None and path is None:
            return _lib
        p = path or lib_path()
        try:
            lib = ctypes.CDLL(str(p))
            lib.ggml_backend_rpc_add_server  # noqa: B018  (AttributeError: the symbol is missing)
        except (OSError, AttributeError):
            raise RpcError(f"this llama-cpp-python was built without RPC ({p.name} not found in {p.parent}); "
                           "rebuild it with `CMAKE_ARGS=-DGGML_RPC=ON pip install --force-reinstall --no-cache-dir "
                           "llama-cpp-python==0.3.36` (what `make install` does)") from None
        lib.ggml_backend_rpc_add_server.argtypes = [ctypes.c_char_p]
        lib.ggml_backend_rpc_add_server.restype = ctypes.c_void_p
        lib.ggml_backend_rpc_start_server.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                                      ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
        lib.ggml_backend_rpc_start_server.restype = None
        # libggml-rpc links libggml-base (ggml_set_abort_callback); libllama links libggml (the registry)
        fns = {}
        for name, args, res in (("ggml_backend_reg_dev_get", [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_void_p),
                                ("ggml_backend_dev_by_type", [ctypes.c_int], ctypes.c_void_p),
                                ("ggml_backend_register", [ctypes.c_void_p], None),
                                ("ggml_set_abort_callback", [ctypes.c_void_p], ctypes.c_void_p)):
            f = _symbol(name, (lib, L.llama_cpp._lib, *_side_libs()))
            f.argtypes, f.restype = args, res
            fns[name] = f
        if path is None:
            _lib = lib
            _fns.update(fns)
        return lib


def _symbol(name: str, libs):
    """The first of libs (CDLLs) that exports name."""
    for cand in libs:
        try:
            return getattr(cand, name)
        except AttributeError:
            continue
    raise RpcError(f"this llama.cpp build has no {name}; specrun needs llama-cpp-python 0.3.36")


def _side_libs() -> list[ctypes.CDLL]:
    d = Path(L.__file__).parent / "lib"
    return [ctypes.CDLL(str(d / n)) for n in ("libggml.so", "libggml-base.so") if (d / n).exists()]


def available() -> bool:
    """Whether this llama-cpp-python was built with the RPC backend."""
    try:
        _native()
        return True
    except RpcError:
        return False


def _fn(name: str):
    """A ggml function typed by _native() (looked up there once)."""
    _native()
    return _fns[name]


# ---- addresses and the hello probe -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str    # as given
    port: int
    ip: str      # IPv4, resolved (ggml's server takes only a dotted address)

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def native(self) -> str:
        """The "IP:PORT" string ggml-rpc is given (and names its devices by)."""
        return f"{self.ip}:{self.port}"


def parse_endpoint(text: str, *, flag: str = "--rpc") -> Endpoint:
    """'HOST:PORT' -> Endpoint; RpcError (one line) otherwise."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise RpcError(f"{flag} {text!r}: expected HOST:PORT with a port 1-65535, e.g. 127.0.0.1:{DEFAULT_PORT}")
    try:
        ip = socket.gethostbyname(host)
    except OSError as e:
        raise RpcError(f"{flag} {text!r}: cannot resolve host {host!r} ({e.strerror or e}); "
                       "give its IPv4 address") from None
    return Endpoint(host, int(port), ip)


def parse_endpoints(text: str) -> tuple[Endpoint, ...]:
    """--rpc's 'HOST:PORT[,HOST:PORT...]' (at most 16, no repeats)."""
    eps = tuple(parse_endpoint(p) for p in text.split(",") if p.strip())
    if not eps:
        raise RpcError("--rpc: no worker given; expected HOST:PORT[,HOST:PORT...]")
    if len(eps) > MAX_SERVERS:
        raise RpcError(f"--rpc: {len(eps)} workers given, llama.cpp takes at most {MAX_SERVERS}")
    seen = [e.native for e in eps]
    dup = next((e for e in eps if seen.count(e.native) > 1), None)
    if dup is not None:
        raise RpcError(f"--rpc: worker {dup} is given twice; name each worker once")
    return eps


def parse_split(text: str | None, n_workers: int) -> tuple[float, ...]:
    """--tensor-split 'N0,N1,...': one non-negative proportion per worker, not all zero (llama.cpp
    normalizes them). None or '': () — llama.cpp then splits by each worker's free memory."""
    if not text:
        return ()
    parts = [p.strip() for p in text.replace("/", ",").split(",")]
    try:
        vals = tuple(float(p) for p in parts)
    except ValueError:
        raise RpcError(f"--tensor-split {text!r}: expected numbers N0,N1,... (one per --rpc worker), "
                       "e.g. 3,1") from None
    if n_workers == 0:
        raise RpcError("--tensor-split needs --rpc: it splits the layers across RPC workers")
    if len(vals) != n_workers:
        raise RpcError(f"--tensor-split {text!r} has {len(vals)} values for {n_workers} --rpc workers; "
                       f"give one proportion per worker, e.g. {','.join(['1'] * n_workers)}")
    if any(not math.isfinite(v) or v < 0 for v in vals) or sum(vals) <= 0:
        raise RpcError(f"--tensor-split {text!r}: proportions must be >= 0 and not all 0 "
                       f"(they are normalized: 3,1 puts three quarters of the layers on the first worker)")
    return vals


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    endpoint: Endpoint
    version: tuple[int, int, int]
    n_devices: int


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed by the worker")
        buf += chunk
    return buf


def _call(sock: socket.socket, cmd: int, payload: bytes) -> bytes:
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv(sock, 8))
    if size > 1 << 20:
        raise ConnectionError(f"a reply of {size} bytes to a hello")
    return _recv(sock, size)


def probe(ep: Endpoint, timeout: float = 10.0) -> WorkerInfo:
    """Connect to a worker, say hello and ask its device count, then hang up. RpcError (one line,
    with the fix) when nothing listens there, it does not answer within timeout (a worker serves
    one client at a time), or it speaks another protocol version."""
    try:
        sock = socket.create_connection((ep.ip, ep.port), timeout=timeout)
    except OSError as e:
        why = "connection refused" if isinstance(e, ConnectionRefusedError) else (e.strerror or str(e))
        raise RpcError(f"cannot reach RPC worker {ep}: {why}; start one there with "
                       f"`specrun rpc-worker --host {ep.host} --port {ep.port}` (or llama.cpp's rpc-server)") from None
    try:
        with sock:
            sock.settimeout(timeout)
            hello = _call(sock, _CMD_HELLO, bytes(_CAPS))
            if len(hello) < 3:
                raise ConnectionError(f"a {len(hello)}-byte hello")
            version = (hello[0], hello[1], hello[2])
            if version[0] != PROTO[0] or version[1] > PROTO[1]:
                raise RpcError(f"RPC worker {ep} speaks RPC protocol {'.'.join(map(str, version))} and this "
                               f"llama.cpp speaks {'.'.join(map(str, PROTO))}: run the same llama.cpp on both ends "
                               "(`specrun rpc-worker` from this install, llama-cpp-python 0.3.36)")
            (n_dev,) = struct.unpack("<I", _call(sock, _CMD_DEVICE_COUNT, b"")[:4])
    except TimeoutError:
        raise RpcError(f"RPC worker {ep} accepted the connection but did not answer within {timeout:g} s: a "
                       "worker serves one client at a time, so another may be using it (stop that client or "
                       "start another worker), or the address is not an RPC worker") from None
    except (ConnectionError, OSError, struct.error) as e:
        raise RpcError(f"{ep} did not answer as an RPC worker ({e}); is it `specrun rpc-worker` or "
                       "llama.cpp's rpc-server of the same version?") from None
    if n_dev < 1:
        raise RpcError(f"RPC worker {ep} reports no device; restart it")
    return WorkerInfo(ep, version, n_dev)


# ---- client: placing a model on workers --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a model's layers go: every layer on the RPC workers, split in the proportions
    `split` (one per worker; () = by their free memory, llama.cpp's default). The input
    embeddings and sampling stay in this process, as in llama.cpp."""

    workers: tuple[Endpoint, ...]
    split: tuple[float, ...] = ()

    def __str__(self) -> str:
        s = ",".join(map(str, self.workers))
        return s + (f" split {':'.join(f'{v:g}' for v in self.split)}" if self.split else "")


def placement(rpc: str | None, tensor_split: str | None) -> Placement | None:
    """--rpc and --tensor-split -> a checked Placement (None without --rpc). Checks the build has
    RPC, then each worker with probe(), before llama.cpp is handed anything."""
    if not rpc:
        if tensor_split:
            parse_split(tensor_split, 0)
        return None
    eps = parse_endpoints(rpc)
    split = parse_split(tensor_split, len(eps))
    _native()
    for ep in eps:
        probe(ep)
    return Placement(eps, split)


_registered: dict[str, int] = {}   # endpoint.native -> device pointer (add_server is once per address)


def devices(p: Placement) -> list[int]:
    """The ggml device of each worker (its first; a CPU worker has one), registered with ggml once
    per address. The workers must have been probed (placement())."""
    lib = _native()
    out = []
    for ep in p.workers:
        dev = _registered.get(ep.native)
        if dev is None:
            probe(ep)   # add_server aborts the process where nothing answers: check again, just before
            install_abort_hook()
            reg = lib.ggml_backend_rpc_add_server(ep.native.encode())
            if not reg:
                raise RpcError(f"RPC worker {ep} reports no device; restart it")
            _fn("ggml_backend_register")(reg)
            dev = _fn("ggml_backend_reg_dev_get")(reg, 0)
            _registered[ep.native] = dev
            _watched.append(ep)
        out.append(dev)
    return out


# ---- a worker lost mid-generation ---------------------------------------------------------------

_ABORT_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_hook = None
_watched: list[Endpoint] = []
_handler: Callable[[WorkerLost], None] | None = None


def on_worker_lost(handler: Callable[[WorkerLost], None] | None) -> None:
    """Who hears of a worker lost mid-generation. The handler runs on llama.cpp's RPC dispatcher
    thread: if it returns, the process aborts (llama.cpp's own behaviour), so it exits the process
    (os._exit) or parks that thread for good (park()). Without a handler: one line on stderr and
    exit status 1."""
    global _handler
    _handler = handler


def park() -> None:
    """Block the calling (dispatcher) thread for good: the abort after the callback never comes,
    and the passes waiting on that worker wait forever (the server has answered them already)."""
    threading.Event().wait()


def lost_worker(tries: int = 10) -> Endpoint | None:
    """Which registered worker no longer accepts connections (the first), or None. A worker that
    just died may close its listening socket a moment after the connection: asked for up to a second."""
    for i in range(tries):
        for ep in _watched:
            try:
                socket.create_connection((ep.ip, ep.port), timeout=1.0).close()
            except OSError:
                return ep
        if i + 1 < tries:
            time.sleep(0.1)
    return None


def _default_lost(e: WorkerLost) -> None:
    sys.stdout.flush()
    os.write(2, f"error: {e}\n".encode())
    os._exit(1)


_LOST = ("Remote RPC server crashed", "Failed to connect to", "RPC handshake failed")   # ggml-rpc.cpp's aborts


def _on_abort(message: bytes) -> None:  # pragma: no cover - called from C, in a subprocess in the tests
    text = (message or b"").decode("utf-8", errors="replace").strip()
    if not any(m in text for m in _LOST):   # llama.cpp stopped for another reason: one line, exit 1, not SIGABRT
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        os.write(2, f"\nerror: llama.cpp stopped on an internal error ({text}); please report it\n".encode())
        os._exit(1)
    ep = lost_worker()
    who = f"RPC worker {ep}" if ep else f"an RPC worker ({','.join(map(str, _watched))})"
    err = WorkerLost(f"{who} stopped answering mid-generation (llama.cpp: {text.split(': ', 1)[-1].strip()}); "
                     "restart the worker and run again")
    log.info("%s", err)
    try:
        (_handler or _default_lost)(err)
    finally:
        park()   # a handler that returned: never let llama.cpp abort the process


def install_abort_hook() -> None:
    """Route llama.cpp's aborts through _on_abort (once per process)."""
    global _hook
    if _hook is None:
        _hook = _ABORT_FN(_on_abort)
        _fn("ggml_set_abort_callback")(ctypes.cast(_hook, ctypes.c_void_p))


# ---- worker --------------------------------------------------------------------------------------


def check_bind(ep: Endpoint) -> None:
    """RpcError (one line) when a worker could not listen on ep (in use, not this machine's)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((ep.ip, ep.port))
    except OSError as e:
        raise RpcError(f"cannot listen on {ep}: {e.strerror or e}; choose another --port "
                       "(or --host an address of this machine)") from None
    finally:
        s.close()


def serve_worker(ep: Endpoint, n_threads: int, cache_dir: str | None = None) -> None:
    """Serve this process's CPU backend at ep until the process ends (blocks; ggml's accept loop,
    one client at a time). Exact mode's kernel settings are set first. Returns only if ggml could
    not start the server (its reason is on stderr)."""
    os.environ[_TILED_ENV] = "0"    # read at the first matmul: verify rows stay bit-identical
    lib = _native()
    cpu = _fn("ggml_backend_dev_by_type")(_DEVICE_CPU)
    if not cpu:
        raise RpcError("this llama.cpp build has no CPU device to serve")
    devs = (ctypes.c_void_p * 1)(cpu)
    lib.ggml_backend_rpc_start_server(ep.native.encode(), cache_dir.encode() if cache_dir else None,
                                      max(1, n_threads), 1, devs)
