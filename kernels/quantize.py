"""llama.cpp's own quantizer (`llama_model_quantize`, the engine of `llama-quantize`) with an
MTP-aware type policy, the synthetic test-model builder, and a greedy MTP-vs-target check.

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
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import gguf
import llama_cpp as L
import numpy as np

from specrun.gguf_spec.errors import SpecrunError
from specrun.gguf_spec.extract import open_gguf, read_layout
from specrun.gguf_spec.testmodel import SynthConfig, write_test_model

from .llama import Context, ContextParams, Model

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
        raise QuantizeError(f"llama_model_quantize returned {rc} for {src} -> {ftype}: {why}")


def _mtp_tensor_names(src: Path) -> tuple[int, list[str], dict[str, int]]:
    """(n_layer, names of the MTP-block tensors, {tensor name: ggml type}) of a GGUF."""
    reader = open_gguf(src)
    layout = read_layout(reader, src)
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
    if not src.is_file():
        raise QuantizeError(f"{src}: no such file")
    if src.resolve() == dst.resolve():
        raise QuantizeError(f"input and output are the same file ({src})")
    t0 = time.perf_counter()
    user = list(overrides)

    if mtp_type != "same":
        policy, tok = mtp_overrides(src, ftype, mtp_type)
        _run_quantize(src, dst, ftype, user + policy, tok, nthread, allow_requantize, "quantize", on_progress)
    else:
        policy, tok = _same_policy(src, dst, ftype, user, nthread, allow_requantize, on_progress)
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
    return {t.name: t.tensor_type.name.lower() for t in gguf.GGUFReader(path).tensors}


# ---- synthetic test models ------------------------------------------------------------------

TEST_MODEL_QUANTS = ("f32", "f16", "q8_0", "q4_k_m")


def build_test_model(path: str | Path, cfg: SynthConfig, quant: str = "f16", *, nthread: int = 0,
                     on_progress: ProgressFn | None = None) -> Path:
    """Write a synthetic qwen35 + MTP model (gguf_spec.testmodel) in `quant`. f32/f16 come from
    the writer; q8_0/q4_k_m from an F32 file through llama.cpp's quantizer with the "same" MTP
    policy, so an exact head stays exact."""
    quant = quant.strip().lower()
    if quant not in TEST_MODEL_QUANTS:
        raise QuantizeError(f"unknown test-model quant '{quant}'; choose one of {', '.join(TEST_MODEL_QUANTS)}")
    path = Path(path)
    if quant in ("f32", "f16"):
        return write_test_model(path, cfg, quant)
    if "_k" in quant and (cfg.n_embd % 256 or cfg.n_ff % 256):
        raise QuantizeError(f"{quant} needs n_embd and n_ff to be multiples of 256 (K-quant super-blocks); "
                            f"got n_embd {cfg.n_embd}, n_ff {cfg.n_ff}")
    tmp = path.with_name(path.name + ".f32.tmp")
    try:
        write_test_model(tmp, cfg, "f32")
        quantize(tmp, path, quant, mtp_type="same", nthread=nthread, on_progress=on_progress)
    finally:
        tmp.unlink(missing_ok=True)
    return path


# ---- greedy MTP check -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Agreement:
    """Greedy single-step acceptance: at n positions p, does argmax of the MTP row
    (x_p, p, h_{p-1}) equal argmax of the target's logits at p?"""

    n: int
    n_agree: int
    max_abs_dlogit: float

    @property
    def rate(self) -> float:
        return self.n_agree / self.n if self.n else 0.0


@dataclass(frozen=True, slots=True)
class MtpCheck:
    tokens: tuple[int, ...]            # the greedy sequence (prompt + generated)
    n_prompt: int
    greedy: Agreement                  # over the generated positions
    vocab: Agreement | None            # every token once, in a seeded random order
    t_target_ms: float | None          # median one-token target decode (with logits)
    t_mtp_ms: float | None             # median one-row MTP decode (with logits and h)

    @property
    def cost_ratio(self) -> float | None:
        """trunk:MTP cost, t_target / t_mtp."""
        if self.t_target_ms is None or not self.t_mtp_ms:
            return None
        return self.t_target_ms / self.t_mtp_ms


class _Pair:
    """A target context and an MTP draft context (MTP_NOTES §1) over kernels.llama's handles."""

    def __init__(self, model: Path, heads: Path | None, n_ctx: int, n_batch: int, n_threads: int):
        self._stack = ExitStack()
        self.n_batch = n_batch
        try:
            self.tm = self._stack.enter_context(Model(model, load_mtp=heads is None))
            self.hm = self._stack.enter_context(Model(heads, load_mtp=True)) if heads is not None else self.tm
            if self.hm.n_layer_nextn < 1:
                raise QuantizeError(f"{heads or model} has no MTP (nextn) layers")
            self.E = self.tm.n_embd_out
            if self.hm.n_embd_out != self.E:
                raise QuantizeError(f"MTP width {self.hm.n_embd_out} != target width {self.E}")
            cp = ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=n_threads,
                               n_threads_batch=n_threads)
            self.ct = self._stack.enter_context(Context(self.tm, replace(cp, nextn="all")))
            self.cm = self._stack.enter_context(Context(self.hm, replace(cp, mtp=True, nextn="outputs"),
                                                        ctx_other=self.ct))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> _Pair:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # [n, n_vocab] logits of every row (and [n, E] hidden rows)
    def target(self, tokens: Sequence[int], pos0: int, hidden: bool = False):
        self.ct.decode(tokens, pos0, "all")
        lg = self.ct.logits_rows().copy()
        return (lg, self.ct.nextn_rows().copy()) if hidden else lg

    # MTP rows (tokens[i], pos0 + i, hidden[i]) -> [n, n_vocab] logits
    def mtp(self, tokens: Sequence[int], pos0: int, hidden: np.ndarray) -> np.ndarray:
        self.cm.decode_with_hidden(tokens, pos0, hidden, logits="all")
        return self.cm.logits_rows().copy()

    def clear(self) -> None:
        self.ct.clear()
        self.cm.clear()

    def agreement(self, seq: Sequence[int], first: int) -> Agreement:
        """Decode seq from scratch in chunks; compare positions first .. len(seq)-1."""
        self.clear()
        lgs, hs = [], []
        for s in range(0, len(seq), self.n_batch):
            lg, h = self.target(seq[s:s + self.n_batch], s, hidden=True)
            lgs.append(lg)
            hs.append(h)
        lg_t, H = np.concatenate(lgs), np.concatenate(hs)
        h_prev = np.vstack([np.zeros((1, self.E), np.float32), H[:-1]])   # h_{p-1}, zeros at p=0
        lg_m = np.concatenate([self.mtp(seq[s:s + self.n_batch], s, h_prev[s:s + self.n_batch])
                               for s in range(0, len(seq), self.n_batch)])
        a, b = lg_t[first:], lg_m[first:]
        return Agreement(len(a), int((a.argmax(1) == b.argmax(1)).sum()), float(np.abs(a - b).max()))


def check_mtp(model: str | Path, heads: str | Path | None = None, *, prompt: Sequence[int] = (1, 2, 3, 4),
              n_gen: int = 64, vocab: bool = False, time_reps: int = 0, n_threads: int = 1,
              seed: int = 0) -> MtpCheck:
    """Greedy MTP-vs-target check on a real llama.cpp model.

    model: a GGUF with nextn layers (heads=None), or the target (trunk-only or full) with
    heads = an MTP-only GGUF. Generates n_gen greedy tokens one at a time after `prompt`, then
    compares MTP and target argmax at every generated position (`greedy`); `vocab` also runs
    every token id once in a seeded random order; time_reps > 0 times one-token decodes.
    n_threads defaults to 1: on a busy machine ggml's 2-thread barrier can cost 10-100x."""
    model = Path(model)
    heads = Path(heads) if heads is not None else None
    reader = open_gguf(model)
    if not any(t.name == "blk.0.attn_norm.weight" for t in reader.tensors):
        raise QuantizeError(f"{model} has no trunk (an MTP-only file?); pass the full or trunk-only "
                            "model, and the heads file as `heads`")
    n_vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    del reader
    n_ctx = (max(len(prompt) + n_gen + time_reps + 3, n_vocab if vocab else 0) + 256) // 256 * 256
    with _Pair(model, heads, n_ctx, 64, n_threads) as pair:
        seq = list(prompt)
        lg = pair.target(seq, 0)[-1]
        for _ in range(n_gen):
            seq.append(int(lg.argmax()))
            lg = pair.target(seq[-1:], len(seq) - 1)[-1]
        greedy = pair.agreement(seq, len(prompt))   # leaves both caches filled to len(seq) - 1
        t_t = t_m = None
        if time_reps > 0:
            pos, tt, tm = len(seq), [], []
            h = np.zeros((1, pair.E), np.float32)
            for r in range(time_reps + 3):             # 3 warm-up decodes
                tok = [seq[r % len(seq)]]
                t0 = time.perf_counter()
                pair.target(tok, pos + r)
                t1 = time.perf_counter()
                pair.mtp(tok, pos + r, h)
                t2 = time.perf_counter()
                if r >= 3:
                    tt.append(t1 - t0)
                    tm.append(t2 - t1)
            t_t, t_m = statistics.median(tt) * 1e3, statistics.median(tm) * 1e3
        vocab_agree = None
        if vocab:
            perm = np.random.default_rng(seed).permutation(n_vocab).tolist()
            vocab_agree = pair.agreement(perm, 1)
    return MtpCheck(tuple(seq), len(prompt), greedy, vocab_agree, t_t, t_m)
