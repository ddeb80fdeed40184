"""Does llama.cpp's AMX path work on this CPU? Asked once per machine and llama.cpp build, in a
child process, before a model loads with llama.cpp's extra buffer types (``Model(exact=False)``,
``--no-exact``).

On some Xeons in VMs (amx_tile / amx_int8 in /proc/cpuinfo) llama.cpp's AMX kernels kill the
process: SIGSEGV in ``ggml_backend_amx_mul_mat``, SIGILL on ``tilezero`` (llama.cpp issue 20824,
proposed fix PR 26954). A process cannot survive that, so a child process meets it first:

    CPU advertises no AMX, or llama.cpp lists no AMX buffer type  -> llama.cpp's choice, no probe
    probe("default") works                                         -> llama.cpp's choice
    it fails, probe("no-amx") works                                -> AMX dropped from the extra
                                                                      buffer types (CPU_REPACK stays)
    both fail                                                      -> no extra buffer types

and the last two log one warning. `decide` is that table, pure: the CPU, the listing and the
probe come in as arguments.

Why AMX is dropped from the list and not excluded with ``tensor_buft_overrides``: in llama.cpp
0.3.36 an override to the CPU buffer type makes the loader choose again among the extra types
(AMX first), and an override to CPU_REPACK for a tensor it cannot repack (Q6_K, F32) dereferences
a null pointer at load (llama-model-loader.cpp, repack.cpp). So `drop_extra_buft` rewrites the CPU
device's NULL-terminated array of extra buffer types (``ggml_backend_dev_get_extra_bufts``, a
static array the loader reads at every model load) without AMX, for this process; the "no-amx"
probe runs exactly that load and decode in its child before the parent relies on it.

Results are cached in ``cache_dir()/cpu-probe/`` (``$SPECRUN_CACHE_DIR``, else
``$XDG_CACHE_HOME/specrun``), one JSON file per (machine, llama.cpp build, mode); delete the
folder to probe again.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import logging
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import llama_cpp as L
from llama_cpp import _ggml

from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.registry import cache_dir

log = logging.getLogger(__name__)

AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")
AMX_BUFT = "AMX"                    # ggml_backend_amx_buffer_type's name
MODES: dict[str, tuple[str, ...]] = {"default": (), "no-amx": (AMX_BUFT,)}   # mode -> buffer types dropped
PROBE_TIMEOUT_S = 120.0
PROBE_QUANTS = ("q8_0", "q4_k_m")   # Q8_0, Q4_K and Q6_K: each takes AMX's tile kernels (M > 1)


# ---- inputs --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CpuInfo:
    model_name: str
    flags: frozenset[str]

    @property
    def amx(self) -> bool:
        """The CPU advertises AMX (which says nothing about whether the VM lets it run)."""
        return any(f in self.flags for f in AMX_FLAGS)


def read_cpuinfo(path: str | Path = "/proc/cpuinfo") -> CpuInfo:
    """The first processor's model name and flags; no flags where the file cannot be read."""
    name, flags = "", frozenset[str]()
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = frozenset(value.split())
    return CpuInfo(name or platform.processor() or "unknown CPU", flags)


@dataclass(frozen=True, slots=True)
class ProbeResult:
    mode: str                   # a MODES key
    works: bool                 # models loaded with these extra buffer types and decoded
    detail: str                 # "ok", "killed by SIGSEGV", "exit 1: ...", "timed out after 120 s"
    conclusive: bool = True     # False: the probe itself failed (cannot tell); never cached
    seconds: float = 0.0
    buffers: tuple[str, ...] = ()   # weight buffer types llama.cpp used in the child ("AMX", "CPU_REPACK", ...)


@dataclass(frozen=True, slots=True)
class Plan:
    extra_bufts: bool           # Model's use_extra_bufts outside exact mode
    drop_amx: bool              # drop AMX from llama.cpp's extra buffer types before loading
    notice: str | None = None   # the one line to log; None when llama.cpp's own choice stands


DEFAULT = Plan(extra_bufts=True, drop_amx=False)

Probe = Callable[[str], ProbeResult]


# ---- the decision --------------------------------------------------------------------------


def decide(cpu: CpuInfo, amx_listed: bool | None, probe: Probe) -> Plan:
    """The module docstring's table. amx_listed: llama.cpp lists an AMX extra buffer type (None:
    it could not be asked, so probe). `probe` runs only when AMX is advertised and may be listed."""
    if not cpu.amx or amx_listed is False:
        return DEFAULT
    first = probe("default")
    if first.works:
        return DEFAULT
    verb = "fail" if first.conclusive else "could not be checked"
    why = f"llama.cpp's AMX kernels {verb} on this CPU ({cpu.model_name}; probe: {first.detail})"
    second = probe("no-amx")
    if second.works:
        return Plan(extra_bufts=True, drop_amx=True, notice=f"{why}: weights are repacked without AMX")
    return Plan(extra_bufts=False, drop_amx=False,
                notice=f"{why}, and without AMX too ({second.detail}): weights are not repacked")


# ---- the cache -----------------------------------------------------------------------------


def _file_stamp(p: Path) -> str:
    try:
        st = p.stat()
    except OSError:
        return f"{p}:missing"
    return f"{p}:{st.st_size}:{st.st_mtime_ns}"


def cache_key(cpu: CpuInfo) -> dict[str, str]:
    """What the answer depends on: the CPU (model name, flags), the kernel (AMX needs its XFD
    permission), the llama.cpp build (llama_cpp version, libllama and the CPU backend's files)."""
    lib = Path(L.llama_cpp._lib._name)
    libs = sorted({p.resolve() for p in (lib, *lib.parent.glob("libggml-cpu*"))})
    return {
        "cpu": cpu.model_name,
        "flags": hashlib.sha256(" ".join(sorted(cpu.flags)).encode()).hexdigest()[:16],
        "kernel": platform.release(),
        "llama_cpp": L.__version__,
        "libs": ";".join(_file_stamp(p) for p in libs),
    }


def cached(probe: Probe, directory: Path, key: Mapping[str, str]) -> Probe:
    """`probe` with its conclusive results kept in `directory`, one file per (key, mode); an
    unreadable or foreign file is probed again, an unwritable folder only costs the cache."""

    def run(mode: str) -> ProbeResult:
        entry = {"key": dict(key), "mode": mode}
        path = directory / (hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()[:24] + ".json")
        try:
            data = json.loads(path.read_text())
            if data["key"] == entry["key"] and data["mode"] == mode:
                r = data["result"]
                return ProbeResult(**{**r, "buffers": tuple(r["buffers"])})
        except (OSError, ValueError, KeyError, TypeError):
            pass
        result = probe(mode)
        if result.conclusive:
            try:
                directory.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({**entry, "result": asdict(result)}, indent=1))
                os.replace(tmp, path)
            except OSError as e:
                log.info("AMX probe result not cached in %s: %s", directory, e)
        return result

    return run


# ---- llama.cpp's list of extra buffer types --------------------------------------------------

_GGML_BACKEND_DEVICE_TYPE_CPU = 0
_P = ctypes.c_void_p


def ggml_fn(name: str, restype, *argtypes):
    """A function of libggml (the backend registry's), typed."""
    return ctypes.CFUNCTYPE(restype, *argtypes)((name, _ggml.libggml))


def _extra_bufts() -> ctypes.Array | None:
    """The CPU device's NULL-terminated array of extra buffer types, the one llama.cpp's loader
    walks when use_extra_bufts is on; None where this build does not offer it."""
    dev = ggml_fn("ggml_backend_dev_by_type", _P, ctypes.c_int)(_GGML_BACKEND_DEVICE_TYPE_CPU)
    if not dev:
        return None
    reg = ggml_fn("ggml_backend_dev_backend_reg", _P, _P)(dev)
    addr = ggml_fn("ggml_backend_reg_get_proc_address", _P, _P, ctypes.c_char_p)(
        reg, b"ggml_backend_dev_get_extra_bufts") if reg else None
    if not addr:
        return None
    return ctypes.CFUNCTYPE(ctypes.POINTER(_P), _P)(addr)(dev)


def _buft_name(buft: int) -> str:
    return ggml_fn("ggml_backend_buft_name", ctypes.c_char_p, _P)(buft).decode()


def extra_buft_names() -> list[str] | None:
    """llama.cpp's extra buffer types in the order the loader tries them (e.g. ["AMX",
    "CPU_REPACK"]); None where they cannot be listed."""
    arr = _extra_bufts()
    if not arr:
        return None
    names, i = [], 0
    while arr[i]:
        names.append(_buft_name(arr[i]))
        i += 1
    return names


def drop_extra_buft(name: str) -> bool:
    """Remove buffer type `name` from the CPU device's extra buffer types, for every later model
    load in this process (the array only shrinks: later entries move up, NULL follows them).
    True if it was there."""
    arr = _extra_bufts()
    if not arr:
        return False
    kept, i = [], 0
    while arr[i]:
        if _buft_name(arr[i]) != name:
            kept.append(arr[i])
        i += 1
    for j, b in enumerate([*kept, None]):
        arr[j] = b
    return len(kept) < i


# ---- the probe in a child process ----------------------------------------------------------


class ChildProbe:
    """probe(mode): a child process loads small synthetic models (Q8_0 and Q4_K_M, built at the
    first call into a temporary folder by llama.cpp's quantizer) with the extra buffer types of
    `mode`, decodes a batch of 8 tokens (AMX's tile kernels) and 2 single tokens (its VNNI kernel)
    on 2-4 threads. A context manager: leaving it removes the folder."""

    def __init__(self, timeout: float = PROBE_TIMEOUT_S) -> None:
        self.timeout = timeout
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._models: list[Path] = []

    def __enter__(self) -> ChildProbe:
        return self

    def __exit__(self, *exc) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self._models = []

    def models(self) -> list[Path]:
        if not self._models:
            from specrun.gguf_spec.testmodel import write_test_model

            from .quantize import quantize

            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="specrun-cpu-probe-")
            folder = Path(self._tmp.name)
            src = write_test_model(folder / "probe-f32.gguf", dtype="f32")
            for q in PROBE_QUANTS:
                quantize(src, folder / f"probe-{q}.gguf", q, nthread=2)
                self._models.append(folder / f"probe-{q}.gguf")
        return self._models

    def __call__(self, mode: str) -> ProbeResult:
        t0 = time.monotonic()
        try:
            paths = self.models()
        except (SpecrunError, OSError) as e:
            return ProbeResult(mode, False, f"not run: {e}", conclusive=False)
        cmd = [sys.executable, "-m", __name__]
        cmd += [a for n in MODES[mode] for a in ("--drop", n)] + [str(p) for p in paths]
        try:
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=self.timeout)
        except subprocess.TimeoutExpired:
            return ProbeResult(mode, False, f"timed out after {self.timeout:.0f} s", seconds=time.monotonic() - t0)
        except OSError as e:
            return ProbeResult(mode, False, f"not run: {e}", conclusive=False)
        seconds = round(time.monotonic() - t0, 3)
        if p.returncode < 0:
            try:
                sig = signal.Signals(-p.returncode).name
            except ValueError:
                sig = f"signal {-p.returncode}"
            return ProbeResult(mode, False, f"killed by {sig}", seconds=seconds)
        last = (p.stderr.strip().splitlines() or [""])[-1][:200]
        if p.returncode != 0:
            return ProbeResult(mode, False, f"exit {p.returncode}: {last}", conclusive=False, seconds=seconds)
        try:
            buffers = tuple(json.loads(p.stdout.strip().splitlines()[-1])["buffers"])
        except (ValueError, KeyError, IndexError) as e:
            return ProbeResult(mode, False, f"unreadable answer ({e}): {p.stdout[-200:]!r}", conclusive=False,
                               seconds=seconds)
        return ProbeResult(mode, True, "ok", seconds=seconds, buffers=buffers)


_BUFFER_LINE = re.compile(r"(\S+) model buffer size")


def _child_main(argv: list[str]) -> int:
    """`python -m specrun.kernels.cpu_probe [--drop BUFT]... MODEL...`: load each model with
    extra buffer types (less the dropped ones), decode, print {"buffers": [...]} as JSON."""
    ap = argparse.ArgumentParser(prog=f"python -m {__name__}")
    ap.add_argument("--drop", action="append", default=[], metavar="BUFT")
    ap.add_argument("models", nargs="+")
    args = ap.parse_args(argv)
    buffers: set[str] = set()
    errors: list[str] = []

    @L.llama_log_callback
    def on_log(level, text, user_data):  # pragma: no cover - called from C
        msg = text.decode("utf-8", errors="replace")
        buffers.update(_BUFFER_LINE.findall(msg))
        if level == 4:      # GGML_LOG_LEVEL_ERROR
            errors.append(msg.strip())

    L.llama_log_set(on_log, ctypes.c_void_p(0))
    L.llama_backend_init()
    for name in args.drop:
        drop_extra_buft(name)
    threads = max(2, min(4, os.cpu_count() or 1))
    for path in args.models:
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_extra_bufts = True
        model = L.llama_model_load_from_file(path.encode(), mp)
        if not model:
            print(f"{path}: llama.cpp could not load it: {errors[-1:]}", file=sys.stderr)
            return 2
        cp = L.llama_context_default_params()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = 64
        cp.n_threads = cp.n_threads_batch = threads
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            print(f"{path}: llama.cpp could not create a context: {errors[-1:]}", file=sys.stderr)
            return 2
        n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
        for chunk in ([1, 2, 3, 4, 5, 6, 7, 8], [9], [10]):
            toks = (L.llama_token * len(chunk))(*chunk)
            rc = L.llama_decode(ctx, L.llama_batch_get_one(toks, len(chunk)))
            if rc != 0:
                print(f"{path}: llama_decode returned {rc}", file=sys.stderr)
                return 2
            row = L.llama_get_logits_ith(ctx, -1)
            if not row or not all(abs(row[i]) < float("inf") for i in range(n_vocab)):
                print(f"{path}: logits missing or not finite", file=sys.stderr)
                return 2
        L.llama_free(ctx)
        L.llama_model_free(model)
    print(json.dumps({"buffers": sorted(buffers)}))
    return 0


# ---- this process ----------------------------------------------------------------------------

_lock = threading.Lock()
_plan: Plan | None = None


def extra_bufts_plan() -> Plan:
    """The plan for this process, decided once (a probe at most once per machine and llama.cpp
    build) and applied: AMX dropped from llama.cpp's list where the plan says so, its notice
    logged once as a warning."""
    global _plan
    with _lock:
        if _plan is None:
            cpu = read_cpuinfo()
            listed = None
            if cpu.amx:
                names = extra_buft_names()
                listed = None if names is None else AMX_BUFT in names
            folder = cache_dir() / "cpu-probe"
            with ChildProbe() as probe:
                plan = decide(cpu, listed, cached(probe, folder, cache_key(cpu)))
            if plan.drop_amx:
                drop_extra_buft(AMX_BUFT)
            if plan.notice:
                log.warning("%s (probe results in %s)", plan.notice, folder)
            elif cpu.amx:
                log.info("llama.cpp's AMX kernels work on this CPU (probe results in %s)", folder)
            _plan = plan
        return _plan


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1:]))
