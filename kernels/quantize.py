"""llama.cpp's own quantizer (`llama_model_quantize`, the engine of `llama-quantize`) with an
MTP-aware type policy. The synthetic test-model builder is kernels.testmodel; the greedy
MTP-vs-target check is kernels.check_mtp.

MTP policy (`mtp_type`), applied only when the file has nextn blocks and the target mix is a
quantized one (for f32/f16/bf16 every tensor simply gets that type):

    a ggml type ("q8_0", "f16", ...)  every tensor of the MTP blocks gets that type, nextn.eh_proj
                                      F16 (or the type, if it is f32/bf16), and token_embd (which
                                      the MTP block reads) that type too.
    "same"                            the MTP block is quantized like a trunk layer: each
                                      blk.M.X gets the type llama.cpp gave blk.R.X, R the last
                                      trunk layer that has X (found by a first pass); eh_proj
                                      and token_embd F16. This keeps a head that copies the trunk
                                      exact (MTP_NOTES §4.2).
    "none"                            no MTP overrides: llama.cpp's plain mix (its layer-position
                                      rule gives the last block's ffn_down/attn_v more bits).

Per-tensor types go through `llama_model_quantize_params.tt_overrides` (regex, ggml type; the
first matching pattern wins; llama.cpp applies them only when the mix's default type is a
quantized one) and `token_embedding_type`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import llama_cpp as L

from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.output import same_file, writing
from specrun.gguf_spec.spec import open_gguf, read_layout

log = logging.getLogger(__name__)

# llama_ftype of each mix name (llama-quantize's names, lower case)
FTYPES: dict[str, int] = {
    "f32": L.LLAMA_FTYPE_ALL_F32, "f16": L.LLAMA_FTYPE_MOSTLY_F16, "bf16": L.LLAMA_FTYPE_MOSTLY_BF16,
    "q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0, "q6_k": L.LLAMA_FTYPE_MOSTLY_Q6_K,
    "q5_0": L.LLAMA_FTYPE_MOSTLY_Q5_0, "q5_1": L.LLAMA_FTYPE_MOSTLY_Q5_1,
    "q5_k_s": L.LLAMA_FTYPE_MOSTLY_Q5_K_S, "q5_k_m": L.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0, "q4_1": L.LLAMA_FTYPE_MOSTLY_Q4_1,
    "q4_k_s": L.LLAMA_FTYPE_MOSTLY_Q4_K_S, "q4_k_m": L.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "q3_k_s": L.LLAMA_FTYPE_MOSTLY_Q3_K_S, "q3_k_m": L.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "q3_k_l": L.LLAMA_FTYPE_MOSTLY_Q3_K_L, "q2_k": L.LLAMA_FTYPE_MOSTLY_Q2_K,
}
UNQUANTIZED_MIXES = ("f32", "f16", "bf16")
# single tensor types usable in overrides and as --mtp-type (ggml_type values = gguf's enum)
TENSOR_TYPES: dict[str, int] = {
    n: int(gguf.GGMLQuantizationType[n.upper()])
    for n in ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_0", "q5_1", "q5_k", "q4_0", "q4_1", "q4_k",
              "q3_k", "q2_k")
}
MTP_POLICIES = ("same", "none")
DEFAULT_MTP_TYPE = "q8_0"

# on_progress(stage, done, total, tensor_name)
ProgressFn = Callable[[str, int, int, str], None]


class QuantizeError(SpecrunError):
    """llama.cpp refused to quantize (bad type name, unreadable input, requantizing, ...)."""


@dataclass(frozen=True, slots=True)
class TensorOverride:
    pattern: str             # regex searched in the tensor name (std::regex_search)
    type: str                # a TENSOR_TYPES name


@dataclass(frozen=True, slots=True)
class QuantizeResult:
    path: Path
    ftype: str
    mtp_type: str
    overrides: tuple[TensorOverride, ...]   # what was passed to llama.cpp (MTP policy + user's)
    token_embd_type: str | None
    bytes_in: int
    bytes_out: int
    seconds: float


def _norm_name(name: str, table: dict[str, int], what: str) -> str:
    key = name.strip().lower()
    if key not in table:
        raise QuantizeError(f"unknown {what} '{name}'; choose one of {', '.join(table)}")
    return key


def parse_override(text: str) -> TensorOverride:
    """'PATTERN=TYPE' (llama-quantize's --tensor-type syntax) -> TensorOverride."""
    pattern, sep, type_name = text.rpartition("=")
    if not sep or not pattern:
        raise QuantizeError(f"bad tensor override '{text}'; use PATTERN=TYPE, e.g. 'ffn_down=q6_k'")
    try:
        re.compile(pattern)
    except re.error as e:
        raise QuantizeError(f"bad regex in tensor override '{text}': {e}") from None
    return TensorOverride(pattern, _norm_name(type_name, TENSOR_TYPES, "tensor type"))


# ---- llama.cpp log capture ------------------------------------------------------------------

_PROGRESS_LINE = re.compile(r"\[\s*(\d+)/\s*(\d+)\]\s+(\S+)")
_GGML_ERROR = 4


class _LogCapture:
    """Route llama.cpp's log to progress callbacks and an error list for the duration of a call,
    then restore whatever callback was installed before."""

    def __init__(self, stage: str, on_progress: ProgressFn | None):
        self.stage, self.on_progress = stage, on_progress
        self.errors: list[str] = []

        def callback(level: int, text: bytes, user_data) -> None:  # pragma: no cover - from C
            msg = text.decode("utf-8", errors="replace")
            if level == _GGML_ERROR and msg.strip():
                self.errors.append(msg.strip())
            m = _PROGRESS_LINE.match(msg)
            if m and self.on_progress is not None:
                self.on_progress(self.stage, int(m.group(1)), int(m.group(2)), m.group(3))
            log.debug("llama.cpp: %s", msg.rstrip())

        self._cb = L.llama_log_callback(callback)

    def __enter__(self) -> _LogCapture:
        self._old_cb, self._old_ud = L.llama_log_callback(), ctypes.c_void_p()
        L.llama_log_get(ctypes.byref(self._old_cb), ctypes.byref(self._old_ud))
        L.llama_log_set(self._cb, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc) -> None:
        L.llama_log_set(self._old_cb, self._old_ud)


# ---- the quantizer --------------------------------------------------------------------------


def _run_quantize(src: Path, dst: Path, ftype: str, overrides: Sequence[TensorOverride],
                  token_embd_type: str | None, nthread: int, allow_requantize: bool,
                  stage: str, on_progress: ProgressFn | None) -> None:
    params = L.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = nthread
    params.allow_requantize = allow_requantize
    if token_embd_type is not None:
        params.token_embedding_type = TENSOR_TYPES[token_embd_type]
    keep: list = []                       # the C strings must outlive the call
    if overrides:
        arr = (L.llama_model_tensor_override * (len(overrides) + 1))()
        for i, o in enumerate(overrides):
            pattern = o.pattern.encode()
            keep.append(pattern)
            arr[i].pattern, arr[i].type = pattern, TENSOR_TYPES[o.type]
        arr[len(overrides)].pattern = None
        params.tt_overrides = ctypes.cast(arr, ctypes.POINTER(L.llama_model_tensor_override))
        keep.append(arr)
    with _LogCapture(stage, on_progress) as cap:
        rc = L.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        dst.unlink(missing_ok=True)                      # llama.cpp may have begun writing it
        why = cap.errors[-1] if cap.errors else "no message"
        why = why.split("failed to quantize: ", 1)[-1]
        if "requantizing" in why and not allow_requantize:
            why += ("; its tensors are already quantized, and quantizing them again loses more quality than "
                    "quantizing the F16/BF16/F32 original: start from that, or pass --allow-requantize")
        raise QuantizeError(f"llama_model_quantize returned {rc} for {src} -> {ftype}: {why}")


def _mtp_tensor_names(src: Path) -> tuple[int, list[str], dict[str, int]]:
    """(n_layer, names of the MTP-block tensors, {tensor name: ggml type}) of a GGUF."""
    reader = open_gguf(src)
    layout = read_layout(reader)
    types = {t.name: int(t.tensor_type) for t in reader.tensors}
    mtp = [n for n in types if (m := re.match(r"blk\.(\d+)\.", n)) and int(m.group(1)) >= layout.n_layer]
    return (layout.n_layer if layout.nextn_layers else -1), mtp, types


def mtp_overrides(src: str | Path, ftype: str, mtp_type: str) -> tuple[list[TensorOverride], str | None]:
    """The overrides and token_embd type of the MTP policy for a fixed mtp_type (not 'same')."""
    n_layer, mtp_names, types = _mtp_tensor_names(Path(src))
    if n_layer < 0 or ftype in UNQUANTIZED_MIXES or mtp_type == "none":
        return [], None
    blocks = "|".join(sorted({n.split(".")[1] for n in mtp_names}, key=int))
    eh_type = mtp_type if mtp_type in UNQUANTIZED_MIXES else "f16"
    out = [TensorOverride(r"\.nextn\.eh_proj\.", eh_type), TensorOverride(rf"^blk\.({blocks})\.", mtp_type)]
    reads_token_embd = not any(".nextn.embed_tokens." in n for n in mtp_names)
    return out, (mtp_type if reads_token_embd and "token_embd.weight" in types else None)


def quantize(src: str | Path, dst: str | Path, ftype: str = "q4_k_m", *,
             mtp_type: str = DEFAULT_MTP_TYPE, overrides: Sequence[TensorOverride] = (),
             nthread: int = 0, allow_requantize: bool = False,
             on_progress: ProgressFn | None = None) -> QuantizeResult:
    """Quantize GGUF `src` to `dst` with llama.cpp's mix `ftype` (a FTYPES name) and the MTP
    policy `mtp_type` (module docstring). `overrides` (yours) take precedence over the policy.
    nthread <= 0: all hardware threads. on_progress(stage, done, total, tensor) per tensor."""
    src, dst = Path(src), Path(dst)
    ftype = _norm_name(ftype, FTYPES, "quantization type")
    mtp_type = mtp_type.strip().lower()
    if mtp_type not in MTP_POLICIES:
        mtp_type = _norm_name(mtp_type, TENSOR_TYPES, "MTP type (or 'same', 'none')")
    if not src.exists():
        raise QuantizeError(f"{src}: no such file")
    if not src.is_file():
        raise QuantizeError(f"{src}: not a regular file (a folder, pipe or device); give a .gguf file")
    if same_file(src, dst):                               # a hard or symbolic link to it too
        raise QuantizeError(f"input and output are the same file ({src}, {dst}); choose another output name")
    t0 = time.perf_counter()
    user = list(overrides)

    with writing(dst, file_only=True) as out:             # checked before llama.cpp writes anything
        if mtp_type != "same":
            policy, tok = mtp_overrides(src, ftype, mtp_type)
            _run_quantize(src, out, ftype, user + policy, tok, nthread, allow_requantize, "quantize", on_progress)
        else:
            policy, tok = _same_policy(src, out, ftype, user, nthread, allow_requantize, on_progress)
    return QuantizeResult(dst, ftype, mtp_type, tuple(user + policy), tok, src.stat().st_size,
                          dst.stat().st_size, time.perf_counter() - t0)


def _same_policy(src: Path, dst: Path, ftype: str, user: list[TensorOverride], nthread: int,
                 allow_requantize: bool, on_progress: ProgressFn | None
                 ) -> tuple[list[TensorOverride], str | None]:
    """Pass 1 quantizes with eh_proj/token_embd pinned to F16; pass 2 (only if needed) pins
    every MTP tensor to the type pass 1 gave the same tensor of the last trunk layer having it."""
    n_layer, mtp_names, _ = _mtp_tensor_names(src)
    if n_layer < 0 or ftype in UNQUANTIZED_MIXES:
        _run_quantize(src, dst, ftype, user, None, nthread, allow_requantize, "quantize", on_progress)
        return [], None
    base = [TensorOverride(r"\.nextn\.eh_proj\.", "f16")]
    tmp = dst.with_name(dst.name + ".pass1.tmp")
    try:
        _run_quantize(src, tmp, ftype, user + base, "f16", nthread, allow_requantize, "pass 1", on_progress)
        _, _, got = _mtp_tensor_names(tmp)
        by_type = {v: k for k, v in TENSOR_TYPES.items()}
        pins: list[TensorOverride] = []
        for name in mtp_names:
            suffix = name.split(".", 2)[2]                         # e.g. "ffn_down.weight"
            ref = next((f"blk.{il}.{suffix}" for il in range(n_layer - 1, -1, -1)
                        if f"blk.{il}.{suffix}" in got), None)
            if ref is None or got[ref] not in by_type:
                continue
            if got[ref] != got[name]:
                pins.append(TensorOverride(rf"^{re.escape(name)}$", by_type[got[ref]]))
        if not pins:
            os.replace(tmp, dst)
            return base, "f16"
        _run_quantize(src, dst, ftype, user + pins + base, "f16", nthread, allow_requantize,
                      "pass 2", on_progress)
        return pins + base, "f16"
    finally:
        tmp.unlink(missing_ok=True)


def tensor_types(path: str | Path) -> dict[str, str]:
    """{tensor name: ggml type name} of a GGUF (for reports and tests)."""
    return {t.name: t.tensor_type.name.lower() for t in open_gguf(path).tensors}
