"""A sequence's KV state as llama.cpp serializes it, its K rows re-encoded from F16 to Q8_0 (or BF16).

The fast prompt context (kernels/prefill.py) keeps an F16 KV cache and the exact decode context
Q8_0 K rows with F16 V rows (kernels/llama.py; BF16 K rows where Q8_0's blocks do not divide the
head size); ``llama_state_seq_set_data`` refuses a state of another cache type, so the hand-over
re-encodes every K row and copies the V rows as they are.
The layout read here is llama.cpp 0.3.36's (src/llama-kv-cache.cpp, ``state_write``; an iSWA
model writes its full cache, then its window cache), for one sequence of a model without per-cell extensions (M-RoPE) and with V not
transposed (flash attention on)::

    u32 magic 0xaf143cd8, i32 seq_id; then per cache:
    u32 n_stream; per stream: u32 n_cells; n_cells x (i32 pos, u32 n_seq=1, i32 seq_id);
        u32 v_trans=0, u32 n_layer; n_layer x (i32 type, u64 row_bytes, n_cells rows) for K,
        then the same for V
Anything else is refused with KVStateError, and the caller keeps the exact path.

The K rotation (a matrix product) runs on one BLAS thread: numpy's OpenBLAS keeps its worker
threads spinning for a while after a multi-threaded call, on the cores that llama.cpp's threads
need for the next decode (docs/design.md, "The fast prompt path").
"""

from __future__ import annotations

import functools

import numpy as np
from threadpoolctl import ThreadpoolController

from specrun.gguf_spec.errors import SpecrunError

GGML_F16, GGML_Q8_0, GGML_BF16 = 1, 8, 30
IO_MAGIC = 0xAF143CD8         # llama-context.cpp's io_magic, first in every sequence state
QK8_0 = 32                    # values per Q8_0 block: f16 scale + 32 x int8 = 34 bytes


class KVStateError(SpecrunError):
    """A serialized state this module cannot re-encode (another layout or cache type)."""


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float [n, k] (k % 32 == 0) -> uint8 [n, k / 32 * 34]: ggml's Q8_0 rows (scale = amax / 127,
    values rounded half to even). Deterministic, so every path that hands over gets the same rows."""
    n, k = x.shape
    b = x.astype(np.float32).reshape(n, k // QK8_0, QK8_0)
    d = np.abs(b).max(axis=2) / 127.0                                   # [n, k/32]
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    out = np.empty((n, k // QK8_0, 2 + QK8_0), dtype=np.uint8)              # block_q8_0: f16 d, int8 qs[32]
    out[..., :2] = d.astype("<f2")[..., None].view(np.uint8)
    out[..., 2:] = np.rint(b * inv[..., None]).astype(np.int8).view(np.uint8)
    return out.reshape(n, -1)


class _Reader:
    def __init__(self, blob: bytes) -> None:
        self.b, self.i = memoryview(blob), 0

    def take(self, n: int) -> memoryview:
        if self.i + n > len(self.b):
            raise KVStateError(f"state ends at byte {len(self.b)}, {n} more expected at {self.i}")
        v = self.b[self.i:self.i + n]
        self.i += n
        return v

    def u32(self) -> int:
        return int(np.frombuffer(self.take(4), "<u4")[0])

    def i32(self) -> int:
        return int(np.frombuffer(self.take(4), "<i4")[0])

    def u64(self) -> int:
        return int(np.frombuffer(self.take(8), "<u8")[0])


@functools.cache
def _blas() -> ThreadpoolController:
    return ThreadpoolController()     # the BLAS libraries loaded (numpy's), found once


def hadamard(n: int) -> np.ndarray:
    """float32 [n, n]: the orthonormal Walsh-Hadamard matrix of llama-kv-cache.cpp's
    ggml_gen_hadamard (Sylvester's construction / sqrt(n); symmetric, H @ H = I)."""
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float16 or float32 [...] -> uint16 [...]: ggml's BF16 (ggml_compute_fp32_to_bf16: rounded to
    nearest even, a NaN kept quiet)."""
    u = x.astype(np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, ((u >> 16) | 64).astype(np.uint16), rounded)


def _rows(r: _Reader, out: list, n_cells: int, n_layer: int, rot: int | None, k_type: str = "q8_0") -> None:
    """One cache's K (or V) section: n_layer x (type, row size, n_cells rows) of F16 rows, copied
    (rot None) or re-encoded to k_type: Q8_0, each row rotated in blocks of `rot` values first (0:
    not rotated), or BF16 (llama.cpp rotates no BF16 rows: rot must be 0)."""
    h = hadamard(rot) if rot else None
    for _ in range(n_layer):
        t, row = r.i32(), r.u64()
        if t != GGML_F16 or (rot is not None and k_type == "q8_0" and row % (2 * QK8_0)):
            raise KVStateError(f"KV rows of type {t} and {row} bytes; expected F16 rows"
                               + (f" of a multiple of {QK8_0} values" if t == GGML_F16 else ""))
        data = r.take(n_cells * row)
        if rot is None:
            out += [np.int32(t).tobytes(), np.uint64(row).tobytes(), data]     # joined, not copied, here
            continue
        x = np.frombuffer(data, "<f2").reshape(n_cells, row // 2)
        if k_type == "bf16":
            out += [np.int32(GGML_BF16).tobytes(), np.uint64(row).tobytes(), to_bf16(x).tobytes()]
            continue
        if h is not None:
            if x.shape[1] % rot:
                raise KVStateError(f"KV rows of {x.shape[1]} values do not split into rotation blocks of {rot}")
            x = (x.astype(np.float32).reshape(-1, rot) @ h).reshape(x.shape)
        q = quantize_q8_0(x)
        out += [np.int32(GGML_Q8_0).tobytes(), np.uint64(q.shape[1]).tobytes(), q.tobytes()]


def quantize_k(blob: bytes, rot: tuple[int, int] = (0, 0), k_type: str = "q8_0") -> bytes:
    """A one-sequence state with F16 K/V rows (llama_state_seq_get_data) -> the same state with
    K rows in k_type ('q8_0' or 'bf16': Context.k_type) and the same F16 V rows, ready for
    llama_state_seq_set_data on an exact-mode context. rot: the (K, V) Hadamard block sizes that
    context applies before it stores rows (Context.kv_rot; llama.cpp rotates quantized rows, so V's
    must be 0). Raises KVStateError for any layout but the one in the module docstring."""
    if rot[1]:
        raise KVStateError(f"the exact context rotates its V rows in blocks of {rot[1]} (a quantized V "
                           "cache); only F16 V rows are handed over")
    if k_type not in ("q8_0", "bf16") or (k_type == "bf16" and rot[0]):
        raise KVStateError(f"K rows of type {k_type} rotated in blocks of {rot[0]}: only Q8_0 and unrotated "
                           "BF16 K rows are handed over")
    with _blas().limit(limits=1, user_api="blas"):   # see the module docstring
        return _quantize_k(_Reader(blob), rot, k_type)


def _quantize_k(r: _Reader, rot: tuple[int, int], k_type: str) -> bytes:
    if r.u32() != IO_MAGIC:
        raise KVStateError("not a llama.cpp sequence state (wrong magic)")
    out = [bytes(r.b[:8])]                              # magic, seq_id
    r.i32()
    while r.i < len(r.b):                               # one section per KV cache (iSWA: two)
        n_stream = r.u32()
        out.append(np.uint32(n_stream).tobytes())
        for _ in range(n_stream):
            n_cells = r.u32()
            out.append(np.uint32(n_cells).tobytes())
            if n_cells == 0:
                continue
            meta = np.frombuffer(r.take(12 * n_cells), "<i4").reshape(n_cells, 3)
            if not (meta[:, 1] == 1).all() or not (meta[:, 2] == 0).all():
                raise KVStateError("KV cells of several sequences or with extensions (M-RoPE); "
                                   "only one plain sequence can be handed over")
            out.append(meta.tobytes())
            v_trans, n_layer = r.u32(), r.u32()
            if v_trans:
                raise KVStateError("a transposed V cache (flash attention off) cannot be handed over")
            out.append(np.array([v_trans, n_layer], "<u4").tobytes())
            _rows(r, out, n_cells, n_layer, rot[0], k_type)     # K: to Q8_0 (or BF16)
            _rows(r, out, n_cells, n_layer, None)       # V: F16 as it is
    return b"".join(out)


def to_streams(blob: bytes, n_stream: int) -> bytes:
    """A one-sequence state of a one-stream context -> the same state for a context with n_stream
    streams (kv_unified off, a stream per sequence): llama_state_seq_set_data reads a record per
    stream and loads the one that is not empty into the destination sequence's stream. Each cache
    section keeps its one record and gets n_stream - 1 empty ones. Raises KVStateError for any
    layout but the module docstring's."""
    if n_stream == 1:
        return blob
    r = _Reader(blob)
    if r.u32() != IO_MAGIC:
        raise KVStateError("not a llama.cpp sequence state (wrong magic)")
    r.i32()
    out: list = [r.b[:8]]
    empty = np.zeros(n_stream - 1, "<u4").tobytes()
    while r.i < len(r.b):                               # one section per KV cache (iSWA: two)
        if (got := r.u32()) != 1:
            raise KVStateError(f"a state of {got} streams; a one-stream state was expected")
        start = r.i
        n_cells = r.u32()
        if n_cells:
            r.take(12 * n_cells)                        # cells: pos, n_seq (1), seq_id
            v_trans, n_layer = r.u32(), r.u32()
            if v_trans:
                raise KVStateError("a transposed V cache (flash attention off) cannot be handed over")
            for _ in range(2 * n_layer):                # K, then V: type, row bytes, rows
                r.i32()
                r.take(n_cells * r.u64())
        out += [np.uint32(n_stream).tobytes(), r.b[start:r.i], empty]
    return b"".join(out)
