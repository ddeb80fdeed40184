"""`specrun rpc-worker`: serve this machine's CPU to RPC clients (llama.cpp's rpc-server, in process).

A client (`specrun ... --rpc HOST:PORT[,...]`, or llama.cpp's own `--rpc`) puts model layers on
it. The worker runs exact mode's kernel settings (no repacking, the tiled matmul off), so verify
rows computed here are bit-identical to one-token decodes, as on the client's own CPU.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import click

from specrun.gguf_spec.errors import SpecrunError

from .runtime.console import err_console, handle_errors, setup_logging
from .runtime.options import MAX_THREADS


@click.command("rpc-worker")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="address to listen on; RPC has no authentication, so anything but loopback is exposed")
@click.option("-p", "--port", type=click.IntRange(1, 65535), default=50052, show_default=True)
@click.option("-t", "--threads", type=click.IntRange(0, MAX_THREADS), default=0,
              help="CPU threads for the layers computed here (default: half the cores, as rpc-server)")
@click.option("-c", "--cache", "use_cache", is_flag=True,
              help="keep large tensors in a local cache (~/.cache/specrun/rpc), so a model loads faster the "
                   "next time (rpc-server's -c)")
@click.option("-v", "--verbose", is_flag=True)
@handle_errors
def rpc_worker(host: str, port: int, threads: int, use_cache: bool, verbose: bool) -> None:
    """Serve this CPU to `--rpc` clients until Ctrl-C (llama.cpp's rpc-server)."""
    from specrun.kernels import rpc

    setup_logging(verbose)
    ep = rpc.parse_endpoint(f"{host}:{port}", flag="--host/--port")
    if ep.ip != "127.0.0.1":
        err_console.print("\n" + "!" * 59 + "\n" + rpc.NO_AUTH_WARNING.format(host=host) + "\n" + "!" * 59 + "\n",
                          style="bold red", markup=False, highlight=False)
    rpc.check_bind(ep)
    n = threads or max(1, (os.cpu_count() or 2) // 2)
    cache_dir = None
    if use_cache:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        cache_dir = os.path.join(base, "specrun", "rpc")
        try:
            os.makedirs(cache_dir, exist_ok=True)
        except OSError as e:
            raise SpecrunError(f"-c: cannot make the tensor cache folder {cache_dir} ({e.strerror}); set "
                               "XDG_CACHE_HOME to a folder you can write, or leave -c out") from None
    rpc._native()   # no RPC in this build: one line now, not in the thread
    err_console.print(f"specrun rpc-worker: serving this CPU ({n} threads, exact-mode kernels) at {ep}; "
                      "Ctrl-C stops it", markup=False, highlight=False, soft_wrap=True)
    # ggml prints its banner and each connection on stdout: keep stdout for nothing but output
    sys.stdout.flush()
    os.dup2(2, 1)
    worker = threading.Thread(target=rpc.serve_worker, args=(ep, n, cache_dir), name="rpc-worker", daemon=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.5)
    except KeyboardInterrupt:
        err_console.print("stopped", style="dim", markup=False)
        os._exit(0)   # ggml's accept loop never returns: end the process without waiting for it
    raise rpc.RpcError(f"the RPC worker at {ep} stopped: llama.cpp could not serve there (its reason is above)")
