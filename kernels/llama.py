"""Thin, checked wrappers over llama-cpp-python's low-level API: a model, a context, a batch.

Handles close exactly once (idempotent ``close()``, also on garbage collection); every native
return code is checked and turned into a SpecrunError carrying the numbers.

Exact mode (the default) configures llama.cpp so that a position's logits are bit-identical
whether it is decoded alone or inside a verify batch of up to 63 rows (README, "Why the output is
exactly the model's"; `specrun check-exact` measures it): weights are not repacked (``use_extra_bufts=False``), the tiled K-quant matmul is off
(``GGML_CPU_TILED_MM=0``, read once per process at the first matmul), flash attention is on
and the KV cache keeps K in Q8_0 and V in F16: flash attention's split-KV path, which one-token
decodes take past 256 tokens of context and which sums V in another order than a batch, needs K and
V of one F16/F32 type (ggml-cpu/ops.cpp), so a mixed cache never takes it. V stays F16, llama.cpp's
default, whose attention is cheaper than over Q8_0 V rows (no dequantization, no Hadamard rotation).
Where Q8_0's 32-value blocks do not divide the head size (80), K is BF16 instead: as bit-exact
(`check-exact`), at F16's size.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import threading
from dataclasses import dataclass

import numpy as np

from specrun.gguf_spec.errors import SpecrunError

log = logging.getLogger(__name__)

# Must be in the environment before llama.cpp's first matmul; see module docstring.
_TILED_ENV = "GGML_CPU_TILED_MM"
MAX_EXACT_BATCH = 63  # flash attention switches to its tiled kernel at 64 query rows

import llama_cpp as L  # noqa: E402  (after the module docstring's contract; imports the native lib)
from llama_cpp import llama_cpp_ext as X  # noqa: E402

from . import cpu_probe, rpc, threads  # noqa: E402
from .kvstate import to_streams  # noqa: E402

_backend_lock = threading.Lock()
_backend_ready = False
_exact_process: bool | None = None  # whether this process runs with the tiled matmul off


class LlamaError(SpecrunError):
    """A llama.cpp call failed (bad model file, out of context, native error code)."""


# ---- logging ---------------------------------------------------------------------------------

_llama_log = logging.getLogger("llama.cpp")
_GGML_LOG_ERROR = 4
_LOAD_ERROR = "error loading model: "
_now = threading.local()   # .heard: the _Heard of the call running on this thread, or None


class _Heard:
    """What llama.cpp logs on this thread inside ``with _Heard() as heard:`` (one call: a model load,
    a context creation, an encode): its error lines, the latest 8, which say why the call failed; and
    the lines that state what its API does not return (the sizes of the buffers it allocated, the KV
    cache's Hadamard rotation, the file's tensor types), read by the methods below."""

    __slots__ = ("errors", "facts", "_outer")

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.facts: list[str] = []
        self._outer: _Heard | None = None

    def __enter__(self) -> _Heard:
        self._outer = getattr(_now, "heard", None)
        _now.heard = self
        return self

    def __exit__(self, *exc) -> None:
        _now.heard = self._outer

    def reason(self) -> str:
        """'; llama.cpp says: ...' for the error lines heard, or '': the reason of "llama_model_load:
        error loading model: REASON" when there is one (the line after it, "failed to load model",
        says nothing more), else the latest line."""
        said = [line.split(_LOAD_ERROR, 1)[1] for line in self.errors if _LOAD_ERROR in line]
        return f"; llama.cpp says: {(said or self.errors)[-1]}" if self.errors else ""

    def weight_buffers_mib(self) -> dict[str, float]:
        """MiB of each weight buffer a model load allocated, by buffer name: "CPU_Mapped" (the
        file's pages), "CPU_REPACK" (weights copied into repacked layouts), ... (llama-model.cpp
        "CPU_Mapped model buffer size =   96.00 MiB")."""
        mib: dict[str, float] = {}
        for m in filter(None, map(_BUF_LINE.search, self.facts)):
            mib[m.group(1)] = mib.get(m.group(1), 0.0) + float(m.group(2))
        return mib

    def tensor_types(self) -> dict[str, int]:
        """Tensors of each ggml type in the file a model load read, in ggml's type order
        (llama-model-loader.cpp "- type q6_K:    9 tensors" -> {"Q6_K": 9}). llama.cpp's API has no
        count of them, and gguf_spec's reader parses every metadata field (a whole vocabulary) first."""
        return {m.group(1).upper(): int(m.group(2)) for m in filter(None, map(_TYPE_LINE.search, self.facts))}

    def kv_buffers_mib(self) -> float:
        """MiB of the KV buffers a context creation allocated (an iSWA model's two caches summed;
        llama-kv-cache.cpp "CPU KV buffer size =    4.50 MiB")."""
        return sum(float(m.group(1)) for m in filter(None, map(_KV_LINE.search, self.facts)))

    def kv_rot(self) -> tuple[int, int]:
        """The Hadamard block sizes (K, V) a context creation's KV cache rotates its rows in; 0: not
        rotated. llama-kv-cache.cpp rotates quantized rows: K in blocks of the largest power of two
        >= 64 dividing the head size, V in blocks of 64; it says so in "attn_rot_k = 1,
        n_embd_head_k_all = 64". An iSWA model has two caches: the last one's lines count (its SWA
        cache's)."""
        said = {m.group(1): (int(m.group(2)), int(m.group(3)))
                for m in filter(None, map(_ROT_LINE.search, self.facts))}
        rot_k, head_k = said.get("k", (0, 0))
        return (_k_rot_block(head_k) if rot_k else 0, 64 if said.get("v", (0, 0))[0] else 0)


_ROT_LINE = re.compile(r"attn_rot_([kv]) = (\d+), n_embd_head_k_all = (-?\d+)")
_KV_LINE = re.compile(r"KV buffer size =\s*([\d.]+) MiB")
_BUF_LINE = re.compile(r"(\S+) model buffer size =\s*([\d.]+) MiB")
_TYPE_LINE = re.compile(r"- type\s+(\w+):\s*(\d+) tensors")


@L.llama_log_callback
def _log_callback(level, text, user_data):  # pragma: no cover - called from C
    """llama.cpp's own log goes to the `llama.cpp` logger at INFO (shown with -v); inside a _Heard
    block on this thread, its error lines and its lines of sizes and rotation are kept there."""
    heard = getattr(_now, "heard", None)
    if heard is not None and (b" buffer size =" in text or b"attn_rot_" in text or b"- type " in text):
        heard.facts.append(text.decode("ascii", errors="replace"))
    if level == _GGML_LOG_ERROR or _llama_log.isEnabledFor(logging.INFO):
        msg = text.decode("utf-8", errors="replace").strip()
        if msg and level == _GGML_LOG_ERROR and heard is not None:
            heard.errors[:] = [*heard.errors[-7:], msg]
        if msg:
            _llama_log.info(msg)


_K_BLOCKS = "K cache type q8_0 with block size 32 does not divide n_embd_head_k"   # llama_init_from_model
GGML_TYPE_BF16 = 30      # ggml.h; llama-cpp-python 0.3.36 names no constant for it


def _ensure_backend(exact: bool) -> None:
    global _backend_ready, _exact_process
    with _backend_lock:
        if _exact_process is None:
            if exact:
                os.environ[_TILED_ENV] = "0"
            _exact_process = os.environ.get(_TILED_ENV, "1") == "0"
        elif exact and not _exact_process:
            raise LlamaError("exact mode needs the tiled matmul off from llama.cpp's first matmul, and this "
                             "process already loaded a model without it; use --no-exact for every model here, "
                             f"or set {_TILED_ENV}=0 in the environment")
        if not _backend_ready:
            L.llama_log_set(_log_callback, ctypes.c_void_p(0))
            L.llama_backend_init()
            _backend_ready = True


# ---- llama-ext.h functions that llama_cpp_ext does not bind ------------------------------------
# libllama.so exports them as C++ symbols (Itanium-mangled, as llama_cpp_ext binds the nextn ones).

_EXT = {  # name: (mangled symbol, argtypes, restype)
    "llama_set_embeddings_layer_inp": ("_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                                       [L.llama_context_p_ctypes, ctypes.c_uint32, ctypes.c_bool], None),
    "llama_get_embeddings_layer_inp": ("_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                                       [L.llama_context_p_ctypes, ctypes.c_uint32], ctypes.c_void_p),   # an address
    "llama_model_target_layer_ids": ("_Z28llama_model_target_layer_idsPK11llama_model",
                                     [L.llama_model_p_ctypes], ctypes.POINTER(ctypes.c_int32)),
    "llama_model_target_layer_ids_n": ("_Z30llama_model_target_layer_ids_nPK11llama_model",
                                       [L.llama_model_p_ctypes], ctypes.c_uint32),
}
_ext_fns: dict = {}


def _addr_fn(fn):
    """The C function behind the bound ctypes function fn, returning its pointer as an int (None
    for NULL): the per-token getters below skip ctypes' POINTER objects and numpy's as_array, which
    cost tens of microseconds a call right after a decode has flushed the caches."""
    return ctypes.CFUNCTYPE(ctypes.c_void_p, *fn.argtypes)(ctypes.cast(fn, ctypes.c_void_p).value)


_views: dict[tuple[int, int, int], np.ndarray] = {}


def _view(addr: int, n: int, width: int) -> np.ndarray:
    """float32 [n, width] over llama.cpp's memory at addr (not a copy). llama.cpp's output buffers
    keep their address from decode to decode, so the views are kept, keyed by address and shape."""
    v = _views.get((addr, n, width))
    if v is None:
        if len(_views) >= 4096:
            _views.clear()
        v = _views[addr, n, width] = np.ctypeslib.as_array((ctypes.c_float * (n * width)).from_address(addr)).reshape(n, width)
    return v


def _ext(name: str):
    """The bound llama-ext.h function `name` (bound on first use)."""
    f = _ext_fns.get(name)
    if f is None:
        symbol, argtypes, restype = _EXT[name]
        try:
            f = getattr(L.llama_cpp._lib, symbol)
        except AttributeError:
            raise LlamaError(f"this libllama has no {name} (symbol {symbol}); specrun needs llama-cpp-python "
                             "0.3.36's build") from None
        f.argtypes, f.restype = argtypes, restype
        _ext_fns[name] = f
    return f


_logits_ith = _addr_fn(L.llama_get_logits_ith)
_nextn = _addr_fn(X.llama_get_embeddings_nextn)
_nextn_ith = _addr_fn(X.llama_get_embeddings_nextn_ith)

try:   # the draft loop in C (kernels/_draftloop.c), built by `pip install` where it finds a C compiler
    from . import _draftloop
except ImportError:   # pragma: no cover - an install without the compiled part
    _draftloop = None
    log.info("specrun.kernels._draftloop is not built: model drafters run their draft loop in Python")
_fn_addr = {name: ctypes.cast(fn, ctypes.c_void_p).value for name, fn in (
    ("decode", L.llama_decode), ("logits_ith", L.llama_get_logits_ith),
    ("nextn_ith", X.llama_get_embeddings_nextn_ith))}


# ---- model -----------------------------------------------------------------------------------


class Model:
    """A loaded GGUF. ``load_mtp=True`` also loads the nextn (MTP) blocks, required before any
    MTP context is created (llama.cpp aborts the process otherwise)."""

    def __init__(self, path: str | os.PathLike, *, exact: bool = True, load_mtp: bool = False,
                 use_mmap: bool = True, placement: rpc.Placement | None = None) -> None:
        """placement: every layer on these RPC workers (kernels/rpc.py), or None: this CPU."""
        _ensure_backend(exact)
        self.path = str(path)
        self.exact = exact
        self.load_mtp = load_mtp
        self.placement = placement
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        mp.use_mmap = use_mmap
        mp.load_mtp = load_mtp
        # an explicit, NULL-terminated device list: none for this CPU alone (so that RPC devices this
        # process registered never take a local model's ops), the workers' under --rpc
        devs = rpc.devices(placement) if placement is not None else []
        self._devices = (ctypes.c_void_p * (len(devs) + 1))(*devs, None)
        mp.devices = ctypes.addressof(self._devices)   # ggml_backend_dev_t * (bound as void *)
        if placement is not None:   # llama-server --rpc ... -ngl all [--tensor-split ...]
            mp.n_gpu_layers = -1
            if placement.split:
                self._split = (ctypes.c_float * L.llama_max_devices())(*placement.split)
                mp.tensor_split = self._split
        if exact:
            mp.use_extra_bufts = False
        else:   # repacked weights: AMX's only where a child process has seen it work (cpu_probe)
            mp.use_extra_bufts = cpu_probe.extra_bufts_plan().extra_bufts
        self._twin: Model | None = None
        self._twin_lock = threading.Lock()
        with _Heard() as heard:
            self._ptr = L.llama_model_load_from_file(self.path.encode(), mp)
        if not self._ptr:
            raise LlamaError(f"{self.path}: llama.cpp could not load this model{heard.reason()} "
                             f"(see `specrun inspect {self.path}`)")
        # MiB of each weight buffer, as llama.cpp said: "CPU_Mapped" (the file's pages, shared by every
        # load of the file), "CPU_REPACK" (weights copied into llama.cpp's repacked layouts), ...
        self.buffers_mib = heard.weight_buffers_mib()
        self.tensor_types = heard.tensor_types()   # {"F32": 109, "Q6_K": 9, ...}, as llama.cpp's loader counted them
        self.vocab = L.llama_model_get_vocab(self._ptr)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        self.n_embd = int(L.llama_model_n_embd(self._ptr))
        self.n_embd_out = int(L.llama_model_n_embd_out(self._ptr))
        self.n_ctx_train = int(L.llama_model_n_ctx_train(self._ptr))
        self.n_layer_nextn = int(L.llama_model_n_layer_nextn(self._ptr))
        self.n_layer = int(L.llama_model_n_layer(self._ptr))      # trunk layers (llama.cpp's n_layer())
        self.arch = self.meta("general.architecture") or ""
        self.recurrent = bool(L.llama_model_is_recurrent(self._ptr) or L.llama_model_is_hybrid(self._ptr))
        self.bos = int(L.llama_vocab_bos(self.vocab))
        self.eos = int(L.llama_vocab_eos(self.vocab))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self._eog = frozenset(t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t))
        self._pieces: dict[int, bytes] = {}

    @property
    def ptr(self):
        if self._ptr is None:
            raise LlamaError(f"{self.path}: model already closed")
        return self._ptr

    def repacked(self) -> Model:
        """This file loaded again with llama.cpp's extra buffer types (repacked weights: its fast
        batch kernels; AMX only where cpu_probe saw it work), at the first call; later calls, from
        any thread, share it, and it closes with this model. A model loaded with them is its own.
        Its memory beyond this model's: repacked_mib (its other tensors map the same file pages).
        Raises LlamaError when the second load fails."""
        if not self.exact or self.placement is not None:
            return self
        with self._twin_lock:
            if self._twin is None:
                twin = Model(self.path, exact=False, load_mtp=self.load_mtp)
                if twin.repacked_mib > 0:
                    log.info("%s: loaded again with repacked weights for fast prompts (%.0f MiB repacked)",
                             self.path, twin.repacked_mib)
                    self._twin = twin
                else:            # nothing in the file has a repacked kernel on this CPU: the same kernels
                    twin.close()
                    self._twin = self
            return self._twin

    @property
    def repacked_mib(self) -> float:
        """MiB of weights this load holds outside the file's mapped pages: the repacked layouts
        (CPU_REPACK, AMX); 0 in exact mode or when nothing in the file has a repacked kernel here."""
        return 0.0 if self.exact else sum(v for k, v in self.buffers_mib.items() if k != "CPU_Mapped")

    def close(self) -> None:
        twin = self.__dict__.get("_twin")
        if twin is not None and twin is not self:
            twin.close()
        self._twin = None
        if getattr(self, "_ptr", None):
            L.llama_model_free(self._ptr)
        self._ptr = None

    __del__ = close

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def meta(self, key: str) -> str | None:
        """A metadata value as llama.cpp renders it (llama_model_meta_val_str), or None when absent."""
        buf = ctypes.create_string_buffer(256)
        n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, 256)
        return None if n < 0 else buf.value.decode("utf-8", errors="replace")

    def target_layer_ids(self) -> tuple[int, ...]:
        """An EAGLE-3 draft's extract layers (eagle3.target_layers): the target layers whose inputs
        it reads, low / mid / high; () for any other model."""
        n = int(_ext("llama_model_target_layer_ids_n")(self.ptr))
        p = _ext("llama_model_target_layer_ids")(self.ptr) if n else None
        return tuple(int(p[i]) for i in range(n)) if p else ()

    # -- tokenizer --
    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> np.ndarray:
        """text -> int32 [n] token ids (with BOS if the model adds one and add_special)."""
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise LlamaError(f"tokenization failed ({n}) for a text of {len(data)} bytes")
        return np.frombuffer(buf, dtype=np.int32, count=n).copy()

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes a token renders to: control tokens as nothing, or spelled out (b'<|im_end|>') with
        special, as llama.cpp's common_token_to_piece(..., special=true) that llama-server's /tokenize
        and /detokenize use."""
        p = None if special else self._pieces.get(token)
        if p is None:
            buf = ctypes.create_string_buffer(64)
            n = L.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = L.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
            p = buf.raw[:n]
            if not special:
                self._pieces[token] = p
        return p

    def token_text(self, token: int) -> str:
        """A token's text with special tokens spelled out (e.g. '<|im_end|>'); '' for -1."""
        return self.piece(token, special=True).decode("utf-8", errors="replace") if token >= 0 else ""

    def detokenize(self, tokens) -> str:
        return b"".join(self.piece(int(t)) for t in tokens).decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return token in self._eog

    def chat_template(self) -> str | None:
        p = L.llama_model_chat_template(self.ptr, None)
        return p.decode("utf-8") if p else None


# ---- context ---------------------------------------------------------------------------------


def default_threads() -> int:
    """The threads of a context given none: LLAMA_ARG_THREADS when set (llama.cpp's variable for
    -t), else the cores idle now (kernels/threads.py, decided once per process)."""
    return threads.default_threads()


@dataclass(frozen=True, slots=True)
class BuildInfo:
    """The llama.cpp this process runs, as llama.cpp's --version and system info say it."""

    bindings: str                 # llama-cpp-python's version
    ggml: str                     # ggml's version and commit: "0.25.3 (0c1e570)"
    backends: tuple[str, ...]     # ggml's registered backends: ("RPC", "CPU")
    features: tuple[str, ...]     # what llama_print_system_info reports on: ("AVX2", "FMA", ...)


def build_info() -> BuildInfo:
    """What `specrun --version` prints: the bindings, ggml's version and commit, its backends and
    the CPU features the build uses."""
    fn = cpu_probe.ggml_fn
    reg_get = fn("ggml_backend_reg_get", ctypes.c_void_p, ctypes.c_size_t)
    reg_name = fn("ggml_backend_reg_name", ctypes.c_char_p, ctypes.c_void_p)
    backends = tuple(reg_name(reg_get(i)).decode() for i in range(fn("ggml_backend_reg_count", ctypes.c_size_t)()))
    system = L.llama_print_system_info().decode(errors="replace")
    features = tuple(k for k, v in re.findall(r"(\w+) = (\w+)", system) if v != "0")
    version, commit = fn("ggml_version", ctypes.c_char_p)().decode(), fn("ggml_commit", ctypes.c_char_p)().decode()
    return BuildInfo(L.__version__, f"{version} ({commit})", backends, features)


@dataclass(frozen=True, slots=True)
class ContextParams:
    n_ctx: int = 4096           # 0: the model's training context
    n_batch: int = 2048         # largest batch one llama_decode takes (prompt chunks)
    n_ubatch: int = 512
    n_threads: int = 0          # 0: default_threads()
    n_threads_batch: int = 0    # 0: n_threads
    n_rs_seq: int = 0           # recurrent-state snapshots per sequence (hybrid models' rollback)
    mtp: bool = False           # an MTP draft context (ctx_type = LLAMA_CONTEXT_TYPE_MTP)
    nextn: str | None = None    # export hidden rows for MTP: "all" (every row) or "outputs"
    kv_f16: bool = False        # flash attention over an F16 KV cache, for any model: the fast prompt context
                                # (kernels/prefill.py); its rows are not batch-invariant, so it never verifies
    n_outputs_max: int = 0      # most output rows in one decode (0: n_batch); its compute buffer holds that many
                                # logits rows (Gemma 3: 1 MiB each), so a context that needs one says 1
    type_k: str = "f16"         # the KV cache and flash attention (on | off | auto) of a context that is neither
    type_v: str = "f16"         # exact (Q8_0 K, F16 V, on) nor kv_f16 (F16, on): llama.cpp's -ctk, -ctv, -fa
    flash_attn: str = "auto"
    n_seq_max: int = 1          # sequences, seq ids 0..n_seq_max-1 (kernels/batch.py: one per slot)
    kv_unified: bool = False    # one KV buffer for every sequence; False (llama.cpp's default): a stream per
                                # sequence, each of n_ctx / n_seq_max cells, laid out as a one-sequence cache


def _ggml_type(name: str) -> int:
    """'q8_0' -> ggml's type id (kernels.params.KV_TYPES)."""
    return GGML_TYPE_BF16 if name == "bf16" else getattr(L, f"GGML_TYPE_{name.upper()}")


def _k_rot_block(n_embd_head_k: int) -> int:
    """llama_kv_cache::build_input_k_rot: the largest power of two >= 64 that divides the head size."""
    n = 64
    while n_embd_head_k % (2 * n) == 0:
        n *= 2
    return n


N_PROMPT_CKPTS = 4     # prompt checkpoints a hybrid model's context keeps (llama-server keeps up to 32)


@dataclass(slots=True)
class _Checkpoint:
    """A recurrent state (llama_state_seq_get_data_ext, PARTIAL_ONLY) of seq 0 at position pos."""

    pos: int                 # its last position; -1: forgotten
    buf: ctypes.Array


class Context:
    """One llama.cpp context over a Model, with a single sequence (seq 0).

    ``decode(tokens, pos0, logits=...)`` evaluates tokens at positions pos0..pos0+n-1 and keeps
    them in the KV cache; ``logits_rows(n)`` then returns the output rows in batch order.
    """

    def __init__(self, model: Model, params: ContextParams = ContextParams(),
                 ctx_other: Context | None = None) -> None:
        self.model = model
        self.params = params
        cp = L.llama_context_default_params()
        n_threads = params.n_threads or default_threads()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        cp.n_ubatch = min(params.n_ubatch, params.n_batch)
        cp.n_seq_max = params.n_seq_max
        cp.kv_unified = params.kv_unified
        cp.n_threads = n_threads
        cp.n_threads_batch = params.n_threads_batch or n_threads
        cp.n_rs_seq = params.n_rs_seq
        cp.n_outputs_max = params.n_outputs_max
        cp.no_perf = False
        custom_kv = not (model.exact or params.kv_f16) and (params.type_k, params.type_v) != ("f16", "f16")
        if model.exact or params.kv_f16:
            cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
            cp.type_k = L.GGML_TYPE_F16 if params.kv_f16 else L.GGML_TYPE_Q8_0
            cp.type_v = L.GGML_TYPE_F16
        else:
            cp.flash_attn_type = {"on": L.LLAMA_FLASH_ATTN_TYPE_ENABLED, "off": L.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                                  "auto": L.LLAMA_FLASH_ATTN_TYPE_AUTO}[params.flash_attn]
            cp.type_k, cp.type_v = _ggml_type(params.type_k), _ggml_type(params.type_v)
        if params.mtp:
            if not model.load_mtp or model.n_layer_nextn <= 0:
                # llama.cpp aborts the whole process in this case; refuse before calling it.
                raise LlamaError(f"{model.path}: no MTP heads loaded (nextn layers: {model.n_layer_nextn}); "
                                 "see `specrun inspect` for what the file holds")
            cp.ctx_type = L.LLAMA_CONTEXT_TYPE_MTP
            cp.n_rs_seq = 0
        if ctx_other is not None:   # MTP heads and EAGLE-3 drafts read the target's context and weights
            cp.ctx_other = ctx_other.ptr
        self.k_type = "f16" if params.kv_f16 else "q8_0" if model.exact else params.type_k
        with _Heard() as heard:
            self._ptr = L.llama_init_from_model(model.ptr, cp)
        if not self._ptr and model.exact and not params.kv_f16 and any(_K_BLOCKS in e for e in heard.errors):
            # a head size that Q8_0's 32-value blocks do not divide (80: phi-2): BF16 K rows, which
            # flash attention also reads row by row, and of another type than V's (no split-KV path)
            cp.type_k, self.k_type = GGML_TYPE_BF16, "bf16"
            with _Heard() as heard:
                self._ptr = L.llama_init_from_model(model.ptr, cp)
        if not self._ptr:
            kv = f", KV cache {params.type_k}/{params.type_v}" if custom_kv else ""
            blocks = any("does not divide n_embd_head" in e for e in heard.errors)
            fix = ("use -ctk and -ctv f16, bf16 or f32 for this model's head size" if blocks
                   else "try a smaller -c, or -ctk f16 -ctv f16" if custom_kv else "try a smaller -c")
            raise LlamaError(f"{model.path}: llama.cpp could not create a context "
                             f"(n_ctx {params.n_ctx}, n_batch {params.n_batch}{kv}){heard.reason()}; {fix}")
        self.n_ctx = int(L.llama_n_ctx(self._ptr))
        self.kv_rot = heard.kv_rot()   # (K, V) Hadamard blocks of its quantized rows; 0 = not rotated
        self.kv_mib = heard.kv_buffers_mib()   # its KV cache, as llama.cpp said (allocated and cleared: resident)
        self.n_batch = int(L.llama_n_batch(self._ptr))   # llama.cpp caps it at n_ctx; decode() checks it, not llama.cpp
        self.n_ubatch = cp.n_ubatch
        self.n_vocab = model.n_vocab
        self.mem = L.llama_get_memory(self._ptr)
        if params.nextn:
            X.llama_set_embeddings_nextn(self._ptr, True, params.nextn == "outputs")
        self._batch = L.llama_batch_init(self.n_batch, 0, 1)
        self._batch_live = True
        b = self._batch
        for i in range(self.n_batch):
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
        self._tok, self._pos, self._out = b.token, b.pos, b.logits   # decode() writes them row by row
        self.n_outputs = 0
        self._seq_outputs = 0   # output rows of the last decode_seqs()
        self.n_rows = 0
        self._bext = None  # extended batch (MTP rows carrying hidden states), made on first use
        # decode_with_hidden's rows: the batch's embd pointer, and the row width llama.cpp reads
        # from a batch of tokens with rows (an MTP context: n_embd_out; else n_embd_inp)
        self._batch_embd = ctypes.c_void_p.from_buffer(self._batch, L.llama_batch.embd.offset)
        self.hidden_width = model.n_embd_out if params.mtp else int(L.llama_model_n_embd_inp(model.ptr))
        self._ckpt: _Checkpoint | None = None          # checkpoint(): the draft checkpoint
        self._prompt_ckpts: list[_Checkpoint] = []     # checkpoint(prompt=True), oldest first
        self.layer_inp: tuple[int, ...] = ()   # layers whose inputs every decode exports (EAGLE-3)

    @property
    def ptr(self):
        if self._ptr is None:
            raise LlamaError("context already closed")
        return self._ptr

    def close(self) -> None:
        if getattr(self, "_bext", None):
            L.llama_batch_ext_free(self._bext)
            self._bext = None
        if getattr(self, "_batch_live", False):
            L.llama_batch_free(self._batch)
            self._batch_live = False
        if getattr(self, "_ptr", None):
            L.llama_free(self._ptr)
        self._ptr = None

    __del__ = close

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def decode(self, tokens, pos0: int, logits: str | int = "last") -> None:
        """Evaluate tokens (int [n], n <= n_batch) at positions pos0.. in seq 0.

        logits: "all" (one output row per token, e.g. a verify pass), "last", "none", or an int
        i: rows i..n-1 (a verify pass behind tokens replayed after a checkpoint restore).
        requires: pos0 + n <= n_ctx.  Raises LlamaError on any non-zero return code; on error
        llama.cpp restores the memory to its state before the call.
        """
        n = len(tokens)
        if n == 0:
            return
        if n > self.n_batch:
            raise LlamaError(f"batch of {n} tokens exceeds n_batch {self.n_batch}")
        if pos0 + n > self.n_ctx:
            raise LlamaError(f"the context is full ({pos0 + n} tokens needed, ctx {self.n_ctx}); "
                             "raise -c or shorten the prompt")
        first = 0 if logits == "all" else n - 1 if logits == "last" else n if logits == "none" else int(logits)
        if not 0 <= first <= n:
            raise LlamaError(f"output rows from {first} of a batch of {n}")
        tok, pos, out = self._tok, self._pos, self._out
        for j in range(n):   # ctypes writes: right after a decode, numpy's calls cost more than a verify pass's rows
            tok[j] = tokens[j]
            pos[j] = pos0 + j
            out[j] = j >= first
        self._batch.n_tokens = n
        rc = L.llama_decode(self.ptr, self._batch)
        if rc != 0:
            raise LlamaError(f"llama_decode returned {rc} for {n} tokens at position {pos0} "
                             f"(ctx {self.n_ctx})" + ("; the KV cache is full, raise -c" if rc == 1 else ""))
        self.n_rows = n
        self.n_outputs = n - first

    def decode_seqs(self, tokens, pos, seqs, outputs) -> None:
        """One llama_decode of rows from several sequences: row j is token tokens[j] at position
        pos[j] of sequence seqs[j], with logits where outputs[j]. outputs_rows() then holds the
        output rows in batch order. requires: n <= n_batch; seqs[j] < n_seq_max."""
        n = len(tokens)
        if n > self.n_batch:
            raise LlamaError(f"batch of {n} tokens exceeds n_batch {self.n_batch}")
        b, n_out = self._batch, 0
        try:
            for j in range(n):
                b.token[j], b.pos[j], b.seq_id[j][0] = tokens[j], pos[j], seqs[j]
                b.logits[j] = bool(outputs[j])
                n_out += bool(outputs[j])
            b.n_tokens = n
            rc = L.llama_decode(self.ptr, b)
        finally:
            for j in range(n):   # decode() leaves seq ids alone: every row is seq 0's
                b.seq_id[j][0] = 0
        if rc != 0:
            raise LlamaError(f"llama_decode returned {rc} for {n} rows of {len(set(seqs))} sequences"
                             + ("; the KV cache is full, raise -c" if rc == 1 else ""))
        self.n_rows, self.n_outputs = n, 0     # logits_rows() reads a decode()'s trailing outputs only
        self._seq_outputs = n_out

    def outputs_rows(self) -> np.ndarray:
        """float32 [n_outputs, n_vocab]: the output rows of the last decode_seqs(), in batch order.
        A view into llama.cpp's buffer: valid until the next decode."""
        p = L.llama_get_logits(self.ptr)
        if not p or not self._seq_outputs:
            raise LlamaError("the last decode produced no logits")
        return _view(ctypes.cast(p, ctypes.c_void_p).value, self._seq_outputs, self.n_vocab)

    def seq_rm_of(self, seq: int, p0: int, p1: int = -1) -> bool:
        """Drop positions [p0, p1) of sequence seq (p1 = -1: to the end; p0 = -1: from the start)."""
        return bool(L.llama_memory_seq_rm(self.mem, seq, p0, p1))

    def seq_cp(self, src: int, dst: int) -> None:
        """Sequence dst becomes a copy of sequence src (all of it: between per-sequence streams
        llama.cpp copies whole streams, at the next decode)."""
        L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)

    def seq_pos_max(self, seq: int) -> int:
        """The last position sequence seq holds; -1: none."""
        return int(L.llama_memory_seq_pos_max(self.mem, seq))

    def logits_rows(self) -> np.ndarray:
        """float32 [n_outputs, n_vocab]: the last decode's output rows in batch order.
        A view into llama.cpp's buffer: valid until the next decode on this context."""
        if self.n_outputs == 0:
            raise LlamaError("the last decode produced no logits")
        first = _logits_ith(self.ptr, self.n_rows - self.n_outputs)
        if not first:
            raise LlamaError("llama_get_logits_ith returned NULL")
        return _view(first, self.n_outputs, self.n_vocab)

    def nextn_rows(self) -> np.ndarray:
        """float32 [n_rows, n_embd_out]: the hidden rows the MTP heads read, one per token of the
        last decode (contexts created with nextn="all"). A view, valid until the next decode."""
        p = _nextn(self.ptr)
        if not p:
            raise LlamaError("llama_get_embeddings_nextn returned NULL (nextn export not enabled)")
        return _view(p, self.n_rows, self.model.n_embd_out)

    def export_layer_inputs(self, layers) -> None:
        """From the next decode on, export the input of each of these layers (the residual stream
        entering it, n_embd wide) for every token, as an EAGLE-3 draft reads its target
        (llama_set_embeddings_layer_inp). requires: the architecture's graph marks layer inputs
        (gguf_spec.compat.EAGLE3_TARGET_ARCHS; llama.cpp aborts otherwise). A layer outside
        0..n_layer-1 is refused here (llama.cpp aborts on it)."""
        layers = tuple(int(x) for x in layers)
        bad = [x for x in layers if not 0 <= x < self.model.n_layer]
        if bad:
            raise LlamaError(f"layer {bad[0]} is not a layer of {self.model.path} (n_layer {self.model.n_layer})")
        for x in layers:
            _ext("llama_set_embeddings_layer_inp")(self.ptr, x, True)
        self.layer_inp = tuple(dict.fromkeys(self.layer_inp + layers))

    def layer_rows(self, layers) -> np.ndarray:
        """float32 [n_rows, len(layers) * n_embd]: the exported inputs of these layers (see
        export_layer_inputs) for every token of the last decode, concatenated per token in the
        given order (EAGLE-3's low | mid | high). A copy."""
        E = self.model.n_embd
        out = np.empty((self.n_rows, len(layers) * E), dtype=np.float32)
        for k, x in enumerate(layers):
            if x not in self.layer_inp:
                raise LlamaError(f"layer {x}'s inputs are not exported by this context")
            p = _ext("llama_get_embeddings_layer_inp")(self.ptr, x)
            if not p:
                raise LlamaError(f"llama_get_embeddings_layer_inp({x}) returned NULL")
            out[:, k * E:(k + 1) * E] = _view(p, self.n_rows, E)
        return out

    def encode_rows(self, rows: np.ndarray) -> np.ndarray:
        """Run the model's encoder graph (an EAGLE-3 draft: fc over the fused target features) on
        float32 [n, n_in] input rows, in chunks of n_ubatch; returns float32 [n, n_embd_out] (its
        t_h_nextn rows; the context needs nextn set). The encoder reads and writes no KV cache."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        n, width = rows.shape
        out = np.empty((n, self.model.n_embd_out), dtype=np.float32)
        be = self._batch_ext()
        base = rows.ctypes.data
        pos0 = self.pos_max() + 1     # placeholders the batch check accepts (the encoder reads none)
        pos, embd = (L.llama_pos * 4)(), L.llama_embd(None, 1, width)   # llama.cpp copies both in
        data = ctypes.c_void_p.from_buffer(embd, L.llama_embd.data.offset)
        for s in range(0, n, self.n_ubatch):
            m = min(self.n_ubatch, n - s)
            L.llama_batch_ext_clear(be)
            for j in range(m):
                data.value = base + 4 * width * (s + j)
                idx = L.llama_batch_ext_add_embd(be, 0, embd)
                if idx < 0:
                    raise LlamaError(f"llama_batch_ext_add_embd failed at row {s + j} ({idx})")
                pos[0] = pos0 + j
                L.llama_batch_ext_set_pos(be, idx, pos)
                L.llama_batch_ext_set_output_logits(be, idx, True)
            with _Heard() as heard:
                rc = L.llama_process(self.ptr, L.LLAMA_PROCESS_TYPE_ENCODE, be)
            if rc != 0:
                raise LlamaError(f"llama_process (encode) returned {rc} for {m} rows of width {width}{heard.reason()}")
            p = _nextn(self.ptr)
            if not p:
                raise LlamaError("the encoder exported no rows (llama_get_embeddings_nextn returned NULL)")
            out[s:s + m] = _view(p, m, self.model.n_embd_out)
        return out

    def _batch_ext(self):
        if self._bext is None:
            self._bext = L.llama_batch_ext_init(self.ptr)
            if not self._bext:
                raise LlamaError("llama_batch_ext_init returned NULL")
        return self._bext

    def decode_chunks(self, tokens, pos0: int, on_chunk=None, *, chunk: int | None = None) -> bool:
        """Evaluate tokens of any length in chunks (of `chunk` tokens, at most n_batch) at positions
        pos0..; logits for the last token only (logits_rows()[-1] afterwards). on_chunk(chunk,
        chunk_pos0) runs after each chunk's decode, while its outputs are readable; when it returns
        False the evaluation stops there and decode_chunks returns False (else True).
        llama.cpp splits every decode into n_ubatch rows, so the chunk size never changes a result."""
        n = len(tokens)
        step = min(chunk or self.n_batch, self.n_batch)
        for s in range(0, n, step):
            part = tokens[s:s + step]
            self.decode(part, pos0 + s, "last" if s + len(part) == n else "none")
            if on_chunk is not None and on_chunk(part, pos0 + s) is False:
                return s + len(part) == n
        return True

    def keep_prefix(self, keep: int, n_held: int) -> int:
        """Shrink seq 0 from n_held positions to at most its first `keep`. Returns how many it
        holds: keep; or, when the memory cannot roll back (a hybrid model past its n_rs_seq
        snapshots), the length of the latest valid checkpoint below keep (restored), else 0 after
        clearing the memory."""
        if keep < n_held and not self.seq_rm(keep, -1):
            below = [c for c in (self._ckpt, *self._prompt_ckpts) if c is not None and 0 <= c.pos < keep]
            if below:
                best = max(below, key=lambda c: c.pos)
                self.restore(best)
                return best.pos + 1
            log.info("cannot roll the memory back to %d tokens; clearing it", keep)
            self.clear()
            return 0
        return keep

    def seq_rm(self, p0: int, p1: int = -1) -> bool:
        """Drop positions [p0, p1) of seq 0 (p1 = -1: to the end). False when the memory cannot
        (a hybrid model asked to drop more than n_rs_seq tokens, or twice per decode)."""
        ok = bool(L.llama_memory_seq_rm(self.mem, 0, p0, p1))
        if ok:
            self._forget_ckpts(p0)
        return ok

    def clear(self) -> None:
        L.llama_memory_clear(self.mem, True)
        self._forget_ckpts(0)

    def _forget_ckpts(self, p0: int) -> None:
        """Checkpoints standing on a position >= p0 (dropped): their history is gone."""
        if self._ckpt is not None and self._ckpt.pos >= p0:
            self._ckpt.pos = -1
        self._prompt_ckpts = [c for c in self._prompt_ckpts if c.pos < p0]

    def checkpoint(self, prompt: bool = False) -> None:
        """Keep seq 0's recurrent state (llama.cpp's LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY: what a hybrid
        model cannot roll back past its n_rs_seq snapshots; the attention cells are not copied), at
        its last position, for restore() and keep_prefix(). The draft checkpoint (prompt False) is
        one per context, overwritten by the next, its buffer reused; prompt checkpoints (a prompt's
        end, for the next request that shares it) are kept, the last N_PROMPT_CKPTS of them. Both
        are forgotten when the positions they stand on are dropped. Cost: a copy of the state each
        (the realistic synthetic qwen35: 2.6 MiB)."""
        flags = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        n = L.llama_state_seq_get_size_ext(self.ptr, 0, flags)
        pos = self.pos_max()
        if prompt:
            self._prompt_ckpts = [c for c in self._prompt_ckpts if c.pos != pos]
            del self._prompt_ckpts[:max(0, len(self._prompt_ckpts) - (N_PROMPT_CKPTS - 1))]
            ck = _Checkpoint(-1, (ctypes.c_uint8 * n)())
        else:
            if self._ckpt is None or len(self._ckpt.buf) != n:
                self._ckpt = _Checkpoint(-1, (ctypes.c_uint8 * n)())
            ck = self._ckpt
        got = L.llama_state_seq_get_data_ext(self.ptr, ck.buf, n, 0, flags)
        if got != n:
            raise LlamaError(f"llama_state_seq_get_data_ext wrote {got} of {n} bytes")
        ck.pos = pos
        if prompt:
            self._prompt_ckpts.append(ck)

    def restore(self, ck: _Checkpoint | None = None) -> None:
        """Back to a checkpoint (default: the draft checkpoint): its recurrent state, and the
        attention cells past its position dropped. Decode the tokens after it again to go on
        (llama-server's replay)."""
        ck = ck or self._ckpt
        if ck is None or ck.pos < 0:
            raise LlamaError("no checkpoint to restore")
        flags, pos = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY, ck.pos
        with _Heard() as heard:
            got = L.llama_state_seq_set_data_ext(self.ptr, ck.buf, len(ck.buf), 0, flags)
            ok = got == len(ck.buf) and self.seq_rm(pos + 1, -1)
        if not ok:
            self.clear()
            raise LlamaError(f"could not restore the checkpoint at position {pos} "
                             f"(read {got} of {len(ck.buf)} bytes){heard.reason()}")

    def pos_max(self) -> int:
        return int(L.llama_memory_seq_pos_max(self.mem, 0))

    def state_get(self) -> bytes:
        """Seq 0's state as llama.cpp writes it (llama_state_seq_get_data): its KV cells, by layer."""
        n = L.llama_state_seq_get_size(self.ptr, 0)
        buf = (ctypes.c_uint8 * n)()
        got = L.llama_state_seq_get_data(self.ptr, buf, n, 0)
        if got != n:
            raise LlamaError(f"llama_state_seq_get_data wrote {got} of {n} bytes")
        return bytes(buf)

    def state_set(self, state: bytes, seq: int = 0) -> None:
        """Replace sequence seq with `state` (state_get() of a one-sequence context of the same
        model and cache types; kvstate.to_streams fits it to a context with a stream per sequence). Its cells are dropped first (the whole memory of a one-sequence context; a sequence
        of a context with a stream per sequence has its stream to itself), so they are laid out from
        the first one in position order, as a fresh evaluation lays them out. On a sliding-window
        model only the window below the state's last position comes back: never seq_rm such a
        sequence below that position."""
        drop = self.clear if self.params.n_seq_max == 1 else (lambda: self.seq_rm_of(seq, -1, -1))
        drop()
        if self.params.n_seq_max > 1 and not self.params.kv_unified:
            state = to_streams(state, self.params.n_seq_max)
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        with _Heard() as heard:
            got = L.llama_state_seq_set_data(self.ptr, buf, len(state), seq)
        if got != len(state):
            drop()
            raise LlamaError(f"llama_state_seq_set_data read {got} of {len(state)} bytes "
                             f"(a state from a context of another model or cache type){heard.reason()}")

    def decode_with_hidden(self, tokens, pos0: int, hidden: np.ndarray, logits: str = "last") -> None:
        """An MTP context's input: row j = (token x_j, position pos0+j, hidden row h_j), where
        h_j is the target's hidden row of the position before (float32 [n, n_embd_out]).
        The MTP graph concatenates norm(embed(x_j)) with norm(h_j). Output (logits and the MTP's
        own hidden row) as decode(): logits = "all", "last" or "none". An EAGLE-3 draft's decoder
        takes the same rows: (x_{p+1}, g_p) at position p, g its fused target features or its own
        pre-norm state."""
        hidden = np.ascontiguousarray(hidden, dtype=np.float32)
        if hidden.shape != (len(tokens), self.hidden_width):
            raise LlamaError(f"hidden rows {hidden.shape} do not match ({len(tokens)}, {self.hidden_width})")
        self._decode_rows(tokens, pos0, hidden.ctypes.data, logits)

    def decode_chained(self, token: int, pos: int) -> None:
        """decode_with_hidden of one row (token, pos) whose hidden row is this context's own row of
        the last token of its last decode: the next step of an MTP or EAGLE-3 draft, which feeds a
        step's state to the next. Logits for the row. It reads the row where llama.cpp keeps it
        (copied into the batch before the decode overwrites it): no numpy call between two steps.
        requires: nextn export on; with nextn="outputs", that token's row was an output and so was
        every row before it (llama.cpp copies the first n_outputs rows its graph computed)."""
        p = _nextn_ith(self.ptr, self.n_rows - 1)   # by batch index ("outputs": mapped to its output row)
        if not p:
            raise LlamaError(f"llama_get_embeddings_nextn_ith({self.n_rows - 1}) returned NULL (nextn export "
                             "not enabled, or that row was not an output)")
        self._decode_rows((token,), pos, p, "last")

    def draft_chain(self, pos0: int, n_max: int, n_vocab: int, *, chained: bool) -> np.ndarray | None:
        """Greedy draft steps from the last decode, in C (kernels/_draftloop.c): step 0 drafts the
        argmax of the first n_vocab logits of the last decode's last row; step i > 0 first decodes
        step i - 1's token at position pos0 + i, by decode_chained() when chained (an MTP or EAGLE-3
        draft) else by decode([token], pos0 + i), then drafts the argmax of that row's logits.
        Returns int32 [n_max]: what the same loop in Python (DraftTokens.add over logits_rows()[-1],
        p_min 0) drafts; None where the C module is not built.
        requires: the last decode had logits for its last row (and its hidden row, when chained).
        Raises LlamaError on a failed step, after which the KV holds the steps decoded before it."""
        if _draftloop is None:
            return None
        out = np.empty(max(n_max, 0), dtype=np.int32)
        n, n_decoded, err = _draftloop.chain(
            self.ptr, ctypes.addressof(self._batch), _fn_addr["decode"], _fn_addr["logits_ith"],
            _fn_addr["nextn_ith"] if chained else 0, self.n_rows - 1, pos0, n_max, n_vocab, out.ctypes.data)
        if n_decoded:
            self.n_rows = self.n_outputs = 1
        if err:
            what = {-1001: "no hidden row (nextn export off, or the row was not an output)",
                    -1002: "no logits for the last row"}.get(err, f"llama_decode returned {err}")
            raise LlamaError(f"draft step {n} (position {pos0 + n}): {what}"
                             + ("; the KV cache is full, raise -c" if err == 1 else ""))
        return out[:n]

    def _decode_rows(self, tokens, pos0: int, rows: int, logits: str) -> None:
        """decode() of tokens with hidden rows float32 [n, hidden_width] at address `rows`:
        llama_decode takes a batch with both tokens and rows (its compat path builds the same
        llama_batch_ext entries the extended API would, row by row) and copies the rows in."""
        self._batch_embd.value = rows
        try:
            self.decode(tokens, pos0, logits)
        finally:
            self._batch_embd.value = None     # llama_batch_free would free it
