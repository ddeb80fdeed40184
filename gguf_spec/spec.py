"""What a GGUF file holds: `load_spec(path) -> ModelSpec` (architecture, hyperparameters,
tokenizer, quantization mix, embedded MTP heads, every tensor), and the one way to open a GGUF,
`open_gguf(path) -> BoundedReader`, for code that needs the metadata values or tensor data
themselves (extract, quantize).

Reading goes through gguf's own `GGUFReader`, with two additions in `BoundedReader`:
- every read is bounds-checked. The stock reader slices its memmap and indexes the result, so a
  count or length that points past the end of the file either raises IndexError somewhere deep
  or, inside an array, yields empty reads that never advance (a hang that grows memory). Here a
  read past the end fails at once, and an array length is bounded by the bytes left before any
  element is read;
- numeric arrays (token scores, token types) are one view instead of one numpy array per
  element, and reads skip np.memmap's per-slice overhead, so a 262k-token vocabulary loads without
  a Python object per token.
The header (magic, version, tensor and metadata counts) is checked with struct against the file
size before the reader starts, and every tensor's shape, type and data range is checked before
the reader maps it. Anything wrong becomes one `GGUFError` line naming the file.

Block layout (llama.cpp's, src/llama-model.cpp and src/models/qwen35.cpp): `{arch}.block_count`
blocks (n_layer_all), the last `{arch}.nextn_predict_layers` of which are MTP (NextN) blocks,
0 <= nextn_predict_layers <= block_count. The trunk is present when there is at least one block
before the MTP blocks and `blk.0.attn_norm.weight` exists; without it llama.cpp's MTP loaders
treat the file as MTP-only. `read_layout`, `mtp_block_range` and `has_trunk` say this once.
"""

from __future__ import annotations

import math
import os
import stat
import struct
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_TENSOR,
    TENSOR_NAMES,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    Keys,
    LlamaFileType,
)

from .errors import GGUFError

GGML_MAX_DIMS = 4                      # ggml.h
LLAMA_MAX_LAYERS = 512                 # llama-hparams.h
LLAMA_MAX_EXPERTS = 1024
_HEADER = 24                           # magic u32, version u32, n_tensors u64, n_kv u64
_MIN_KV = 8 + 4 + 1                    # key length, value type, smallest value (u8 / bool)
_MIN_TENSOR_INFO = 8 + 4 + 8 + 4 + 8   # name length, n_dims, one dim, type, offset
_SUPPORTED_VERSIONS = (2, 3)
_ARRAY = int(GGUFValueType.ARRAY)
_SCALAR_DTYPES = {int(k): np.dtype(v) for k, v in GGUFReader.gguf_scalar_to_np.items()}
_INT_TYPES = frozenset(int(t) for t in (
    GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
    GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64))
_NUMBER_TYPES = _INT_TYPES | {int(GGUFValueType.FLOAT32), int(GGUFValueType.FLOAT64)}
_VALUE_TYPES = frozenset(int(t) for t in GGUFValueType)
_QUANT_TYPES = frozenset(int(t) for t in GGMLQuantizationType)
# "blk.{bid}.nextn.eh_proj", ... : the tensors that exist only in an MTP (NextN) block
_NEXTN_NAMES = tuple(TENSOR_NAMES[t] for t in MODEL_TENSOR if t.name.startswith("NEXTN_"))
# the tensor whose absence makes llama.cpp's MTP loaders treat a file as MTP-only (qwen35.cpp:
# mtp_only = n_layer_nextn > 0 && !get_weight("blk.0.attn_norm.weight"))
TRUNK_PROBE = TENSOR_NAMES[MODEL_TENSOR.ATTN_NORM].format(bid=0) + ".weight"

# EAGLE-3 drafts (architecture "eagle3"), as llama.cpp 0.3.36's gguf-py names them (constants.py:
# Keys.LLM.TARGET_LAYERS ..., MODEL_TENSOR.FC / D2T); the pinned gguf 0.19.0 predates them
EAGLE3_ARCH = "eagle3"
KEY_TARGET_LAYERS = "{arch}.target_layers"
KEY_TARGET_HIDDEN_SIZE = "{arch}.target_hidden_size"
KEY_NORM_BEFORE_RESIDUAL = "{arch}.norm_before_residual"
KEY_NORM_BEFORE_FC = "{arch}.norm_before_fc"
TENSOR_FC = "fc.weight"
TENSOR_D2T = "d2t"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    type: str                   # ggml type name: "Q4_K", "F32", ...
    shape: tuple[int, ...]      # ggml order, ne0 (the contiguous dimension) first, as gguf-dump prints
    n_bytes: int
    offset: int                 # absolute offset of the data in the file


@dataclass(frozen=True, slots=True)
class QuantShare:
    type: str                   # ggml type name
    n_tensors: int
    n_bytes: int


@dataclass(frozen=True, slots=True)
class Vocab:
    """The tokenizer as llama.cpp sees it. Ids and add_bos/add_eos fall back to llama.cpp's
    defaults for the tokenizer model when the file does not set them (pre-tokenizer-specific
    overrides are not modelled; they are the same for two files with the same `pre`)."""

    model: str                  # tokenizer.ggml.model: "llama" (SPM), "gpt2" (BPE), ...
    pre: str | None             # tokenizer.ggml.pre
    size: int                   # number of tokens
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    add_bos: bool
    add_eos: bool
    tokens: tuple[str, ...] = field(repr=False, compare=False)   # [size] token texts


@dataclass(frozen=True, slots=True)
class MTPBlock:
    """One NextN (multi-token prediction) block, `index` in mtp_block_range(n_layer, nextn).
    `tensors` are all of `blk.{index}.*`: the nextn.* tensors and the block's own attention/FFN."""

    index: int
    tensors: tuple[TensorInfo, ...]

    @property
    def nextn(self) -> tuple[TensorInfo, ...]:
        prefixes = tuple(n.format(bid=self.index) + "." for n in _NEXTN_NAMES)
        return tuple(t for t in self.tensors if t.name.startswith(prefixes))


@dataclass(frozen=True, slots=True)
class Eagle3Info:
    """What an EAGLE-3 draft (architecture eagle3, src/models/eagle3.cpp) reads from its target:
    the inputs of three target layers (low, mid, high), each target_hidden_size wide, fused by fc.
    draft_vocab: the rows of its own head when it maps them to target ids through d2t, else None
    (it drafts over the target's vocabulary)."""

    target_layers: tuple[int, ...]      # llama.cpp needs exactly 3
    target_hidden_size: int | None
    n_embd: int | None                  # the draft's own width (its decoder layer)
    n_layer: int | None                 # decoder layers; llama.cpp runs exactly 1
    draft_vocab: int | None             # d2t entries; None without d2t
    d2t_max: int | None                 # the largest target id d2t maps to
    own_token_embd: bool                # else the target's token_embd (needs n_embd == the target's)
    own_output: bool                    # else the target's output head
    norm_before_fc: bool = False
    norm_before_residual: bool = False


@dataclass(frozen=True, slots=True)
class ModelSpec:
    path: Path
    architecture: str
    name: str | None
    size_label: str | None
    file_type: str | None       # "Q4_K_M", from general.file_type; None if absent
    context_length: int | None
    n_embd: int | None
    n_layer: int | None         # block_count, MTP blocks included
    n_head: int | None
    n_head_kv: int | None       # the largest, where the file gives one per layer
    vocab: Vocab | None         # None for a file without tokenizer.ggml.tokens
    chat_template: str | None = field(repr=False)
    quant_mix: tuple[QuantShare, ...]           # by bytes, largest first
    nextn_predict_layers: int
    mtp_blocks: tuple[MTPBlock, ...]
    tensors: tuple[TensorInfo, ...] = field(repr=False)
    eagle3: Eagle3Info | None = None            # set for an EAGLE-3 draft (architecture eagle3)

    @property
    def is_eagle3(self) -> bool:
        return self.architecture == EAGLE3_ARCH

    @property
    def n_layer_trunk(self) -> int | None:
        """llama.cpp's n_layer(): the blocks before the MTP blocks."""
        return None if self.n_layer is None else self.n_layer - self.nextn_predict_layers

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    @property
    def has_mtp(self) -> bool:
        """True when the file declares NextN layers and every one of them has nextn.* tensors."""
        return bool(self.mtp_blocks) and all(b.nextn for b in self.mtp_blocks)

    @property
    def has_trunk(self) -> bool:
        """True when the file holds the trunk (see has_trunk); False for an MTP-only file."""
        return has_trunk((t.name for t in self.tensors), self.n_layer, self.nextn_predict_layers)

    @property
    def n_tensors(self) -> int:
        return len(self.tensors)

    @property
    def n_bytes(self) -> int:
        return sum(t.n_bytes for t in self.tensors)


@dataclass(frozen=True, slots=True)
class MtpLayout:
    """The block layout of a model GGUF (module doc): the trunk, then the MTP blocks."""

    arch: str
    block_count: int         # trunk + MTP blocks (llama.cpp's n_layer_all)
    nextn_layers: int        # MTP blocks, the last ones; 0 <= nextn_layers <= block_count
    has_trunk: bool          # see has_trunk(); False for an MTP-only file

    @property
    def mtp_blocks(self) -> range:
        return mtp_block_range(self.block_count, self.nextn_layers)

    @property
    def n_layer(self) -> int:
        """The trunk depth, llama.cpp's hparams.n_layer(): blocks 0 .. n_layer-1."""
        return self.mtp_blocks.start


def mtp_block_range(block_count: int, nextn: int) -> range:
    """The indices of the MTP (NextN) blocks: the last `nextn` of `block_count` blocks.
    requires: 0 <= nextn <= block_count (read_layout and load_spec check it)."""
    return range(block_count - nextn, block_count)


def has_trunk(tensor_names: Iterable[str], block_count: int | None, nextn: int) -> bool:
    """True when a file with these tensors and this layout holds the trunk: at least one block
    comes before the MTP blocks and its TRUNK_PROBE tensor (blk.0.attn_norm.weight) is present.
    llama.cpp's MTP loaders call a file without that tensor MTP-only; a file whose blocks are all
    MTP blocks (nextn == block_count) has none either."""
    return (block_count or 0) > nextn and TRUNK_PROBE in tensor_names


class _Corrupt(Exception):
    """Raised inside BoundedReader and the metadata readers; open_gguf, read_layout and
    load_spec turn it into GGUFError with the file name."""


class BoundedReader(GGUFReader):
    """GGUFReader with bounds-checked reads and one-view numeric arrays (see the module doc).
    Open one with open_gguf, never directly. `path` is the path it was opened with.
    Numeric array fields hold a single data part: read them with contents(), not contents(i)."""

    def __init__(self, path: Path):
        self.path = path
        super().__init__(path)

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        raw = self.__dict__.get("_raw")
        if raw is None:
            raw = self._raw = self.data.view(np.ndarray)
        dt, count = np.dtype(dtype), int(count)
        end = offset + dt.itemsize * count
        if count < 0 or end > raw.size:
            raise _Corrupt(f"truncated or corrupt GGUF: a read of {count} x {dt.itemsize} bytes at offset {offset} "
                           f"runs past the end of the file ({raw.size} bytes)")
        arr = raw[offset:end].view(dt)
        order = self.byte_order if override_order is None else override_order
        return arr if order == "I" else arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list, list, list]:
        if int(raw_type) not in _VALUE_TYPES:
            raise _Corrupt(f"unknown metadata value type {int(raw_type)} at offset {orig_offs}")
        if raw_type != _ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = int(raw_itype[0]), int(alen[0])
        if itype not in _VALUE_TYPES:
            raise _Corrupt(f"unknown metadata value type {itype} in the array at offset {orig_offs}")
        dt = _SCALAR_DTYPES.get(itype)
        min_size = dt.itemsize if dt is not None else 12 if itype == _ARRAY else 8
        left = self._raw.size - (orig_offs + 12)
        if n > left // min_size:
            raise _Corrupt(f"truncated or corrupt GGUF: an array at offset {orig_offs} claims {n} elements but only {left} bytes follow")
        if dt is None:
            return super()._get_field_parts(orig_offs, raw_type)
        vals = self._get(orig_offs + 12, dt, n)
        return 12 + vals.nbytes, [raw_itype, alen, vals], [2], [GGUFValueType.ARRAY, GGUFValueType(itype)]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = self._raw.size
        for f in fields:
            _, _, n_dims, dims, raw_dtype, offset = f.parts
            name = f.name
            if int(n_dims[0]) > GGML_MAX_DIMS:
                raise _Corrupt(f"tensor '{name}' has {int(n_dims[0])} dimensions (at most {GGML_MAX_DIMS})")
            if int(raw_dtype[0]) not in _QUANT_TYPES:
                raise _Corrupt(f"tensor '{name}' has unknown ggml type {int(raw_dtype[0])}")
            qtype = GGMLQuantizationType(int(raw_dtype[0]))
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = [int(d) for d in dims]
            if shape and shape[0] % block:
                raise _Corrupt(f"tensor '{name}' of type {qtype.name} has a row of {shape[0]} elements, "
                               f"not a multiple of its block size {block}")
            n_bytes = math.prod(shape) * type_size // block
            begin = start_offs + int(offset[0])
            if begin + n_bytes > size:
                raise _Corrupt(f"tensor '{name}' data ({n_bytes} bytes at offset {begin}) runs past the end "
                               f"of the file ({size} bytes); the file is truncated, download it again")
        super()._build_tensors(start_offs, fields)


def _fail(path: Path, what: str) -> GGUFError:
    return GGUFError(" ".join(f"{path}: {what}".split("\n")))


def _check_header(path: Path, size: int) -> None:
    """Magic, version and counts, read with struct and bounded by the file size."""
    with path.open("rb") as f:
        head = f.read(_HEADER)
    if head[:4] != b"GGUF":
        raise _fail(path, f"not a GGUF file (it starts with {head[:4]!r}, not b'GGUF')")
    if len(head) < _HEADER:
        raise _fail(path, f"truncated GGUF: {size} bytes, shorter than the {_HEADER}-byte header")
    order = "<"
    version, = struct.unpack_from("<I", head, 4)
    if version & 0xFFFF == 0:          # written on a host of the other byte order
        order = ">"
        version, = struct.unpack_from(">I", head, 4)
    if version not in _SUPPORTED_VERSIONS:
        raise _fail(path, f"GGUF version {version} is not supported (versions {_SUPPORTED_VERSIONS}); "
                          "convert the model again with a current llama.cpp")
    if order == ">" and sys.byteorder == "little":     # llama.cpp reads the file in the host's byte order
        raise _fail(path, "is a big-endian GGUF, and llama.cpp on this little-endian machine reads only "
                          "little-endian files; convert the model again without --bigendian")
    n_tensors, n_kv = struct.unpack_from(order + "QQ", head, 8)
    room = size - _HEADER
    if n_kv > room // _MIN_KV:
        raise _fail(path, f"truncated or corrupt GGUF: the header claims {n_kv} metadata entries, "
                          f"which cannot fit in {size} bytes")
    if n_tensors > (room - n_kv * _MIN_KV) // _MIN_TENSOR_INFO:
        raise _fail(path, f"truncated or corrupt GGUF: the header claims {n_tensors} tensors and {n_kv} "
                          f"metadata entries, which cannot fit in {size} bytes")


def open_gguf(path: str | os.PathLike) -> BoundedReader:
    """Open a GGUF for reading (metadata fields and memory-mapped tensor data).
    raises: GGUFError, one line naming the file, for a missing, unreadable or corrupt file."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise _fail(path, "no such file; give a path to a .gguf file or a registry name "
                          "(`specrun --help` lists them)") from None
    except OSError as e:
        raise _fail(path, f"cannot read it ({e.strerror})") from None
    if path.is_dir():
        raise _fail(path, "is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):     # a pipe would block the read; llama.cpp maps the file
        kind = ("a named pipe" if stat.S_ISFIFO(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a device")
        raise _fail(path, f"is {kind}, not a GGUF file; give the path of a .gguf file")
    if st.st_size == 0:
        raise _fail(path, "is empty, not a GGUF file")
    try:
        _check_header(path, st.st_size)
        return BoundedReader(path)
    except _Corrupt as e:
        raise _fail(path, str(e)) from None
    except OSError as e:
        raise _fail(path, f"cannot read it ({e.strerror or e})") from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, RecursionError, MemoryError) as e:
        # UnicodeDecodeError is a ValueError; KeyError: a duplicated key; ValueError: an unknown
        # value type, a bad alignment, a shape numpy cannot take
        raise _fail(path, f"corrupt GGUF ({type(e).__name__}: {e})") from None


def _field(r: BoundedReader, key: str, kind: str) -> Any:
    """The field of `key` if its type is `kind` ('int', 'number' (an int or float scalar), 'bool',
    'str', 'ints', 'strs'); None when absent."""
    f = r.fields.get(key)
    if f is None:
        return None
    types = [int(t) for t in f.types]
    ok = {
        "int": types[:1] and types[0] in _INT_TYPES,
        "number": len(types) == 1 and types[0] in _NUMBER_TYPES,
        "bool": types == [int(GGUFValueType.BOOL)],
        "str": types == [int(GGUFValueType.STRING)],
        "ints": types[:1] == [_ARRAY] and (len(types) == 1 or types[1] in _INT_TYPES),
        "strs": types[:1] == [_ARRAY] and (len(types) == 1 or types[1] == int(GGUFValueType.STRING)),
    }[kind]
    if not ok:
        names = "/".join(GGUFValueType(t).name for t in types)
        raise _Corrupt(f"metadata {key} has type {names}, expected {'a number' if kind == 'number' else kind}")
    return f


def _value(r: BoundedReader, key: str, kind: str) -> Any:
    """A metadata value of `kind` (see _field), None when absent."""
    f = _field(r, key, kind)
    if f is None:
        return None
    v = f.contents()
    return int(v) if kind == "int" else float(v) if kind == "number" else bool(v) if kind == "bool" else v


def _int_or_max(r: BoundedReader, key: str) -> int | None:
    """head_count and head_count_kv are per-layer arrays in some hybrid models."""
    f = r.fields.get(key)
    if f is not None and f.types and f.types[0] == GGUFValueType.ARRAY:
        vals = _value(r, key, "ints")
        return max(vals) if vals else None
    return _value(r, key, "int")


def _file_type(v: int | None) -> str | None:
    if v is None:
        return None
    try:
        name = LlamaFileType(v).name
    except ValueError:
        return f"unknown ({v})"
    return {"ALL_F32": "F32"}.get(name, name.removeprefix("MOSTLY_"))


# llama.cpp's defaults by tokenizer model (llama-vocab.cpp): bos, eos, add_bos, add_eos
_VOCAB_DEFAULTS: dict[str, tuple[int | None, int | None, bool, bool]] = {
    "llama": (1, 2, True, False),
    "bert": (101, None, True, False),
    "gpt2": (11, 11, False, False),
    "t5": (None, 1, False, True),
    "rwkv": (None, None, False, False),
    "plamo2": (1, 2, False, False),
}


def _vocab(r: BoundedReader) -> Vocab | None:
    f = _field(r, Keys.Tokenizer.LIST, "strs")
    if f is None:
        return None
    # surrogateescape: a token that is not valid UTF-8 stays distinct from every other token
    tokens = tuple(bytes(f.parts[i]).decode("utf-8", "surrogateescape") for i in f.data)
    model = _value(r, Keys.Tokenizer.MODEL, "str") or "llama"
    bos, eos, add_bos, add_eos = _VOCAB_DEFAULTS.get(model, (None, None, False, False))

    def opt(key: str, kind: str, default: Any) -> Any:
        v = _value(r, key, kind)
        return default if v is None else v

    return Vocab(
        model=model,
        pre=_value(r, Keys.Tokenizer.PRE, "str"),
        size=len(tokens),
        bos_id=opt(Keys.Tokenizer.BOS_ID, "int", bos),
        eos_id=opt(Keys.Tokenizer.EOS_ID, "int", eos),
        eot_id=_value(r, Keys.Tokenizer.EOT_ID, "int"),
        add_bos=opt(Keys.Tokenizer.ADD_BOS, "bool", add_bos),
        add_eos=opt(Keys.Tokenizer.ADD_EOS, "bool", add_eos),
        tokens=tokens,
    )


@contextmanager
def _metadata_errors(path: Path) -> Iterator[None]:
    """Whatever goes wrong reading the metadata of an open file becomes one GGUFError line."""
    try:
        yield
    except _Corrupt as e:
        raise _fail(path, str(e)) from None
    except (ValueError, KeyError, IndexError, TypeError, OverflowError) as e:
        raise _fail(path, f"corrupt GGUF metadata ({type(e).__name__}: {e})") from None


def _layout(r: BoundedReader) -> tuple[str, int | None, int]:
    """(architecture, block_count or None when absent, nextn_predict_layers), with llama.cpp's
    bound on nextn_predict_layers (llama-model.cpp: GGML_ASSERT(n_layer_nextn <= n_layer_all))."""
    arch = _value(r, Keys.General.ARCHITECTURE, "str")
    if not arch:
        raise _Corrupt(f"no {Keys.General.ARCHITECTURE} in the metadata; this is not a model file")
    count_key = Keys.LLM.BLOCK_COUNT.format(arch=arch)
    nextn_key = Keys.LLM.NEXTN_PREDICT_LAYERS.format(arch=arch)
    block_count = _value(r, count_key, "int")
    if block_count is not None and not 1 <= block_count <= LLAMA_MAX_LAYERS:
        raise _Corrupt(f"{count_key} is {block_count}; llama.cpp loads 1 to {LLAMA_MAX_LAYERS} blocks (it aborts "
                       "the process on any other count); the file is corrupt: convert the model again")
    nextn = _value(r, nextn_key, "int") or 0
    if not 0 <= nextn <= (block_count or 0):
        raise _Corrupt(f"{nextn_key} is {nextn} but {count_key} is "
                       f"{'absent' if block_count is None else block_count}; llama.cpp needs "
                       f"0 <= {nextn_key} <= {count_key} (the MTP blocks are the last ones); "
                       "convert the model again with a current llama.cpp")
    _hparams(r, arch)
    return arch, block_count, nextn


def _hparams(r: BoundedReader, arch: str) -> None:
    """The hyperparameters llama.cpp checks with GGML_ASSERT, which aborts the whole process, while
    it loads the file (llama-model.cpp load_hparams: the expert counts) or at the first decode (a
    norm's epsilon: ggml's rms_norm / norm want eps >= 0); a rope base of 0 or less makes every
    logit NaN. Raises _Corrupt with the key and its value."""
    def bad(key: str, v: Any, want: str) -> _Corrupt:
        return _Corrupt(f"{key} is {v}; llama.cpp needs {want}; the file is corrupt: convert the model again")

    for key in r.fields:
        if key.startswith(f"{arch}.") and key.endswith("epsilon"):
            eps = _value(r, key, "number")
            if not 0.0 <= eps < math.inf:
                raise bad(key, eps, "a finite number >= 0 (it aborts the process at the first token otherwise)")
    base_key = Keys.Rope.FREQ_BASE.format(arch=arch)
    base = _value(r, base_key, "number")
    if base is not None and not 0.0 < base < math.inf:
        raise bad(base_key, base, "a finite number > 0 (every logit is NaN otherwise)")
    k_expert = Keys.LLM.EXPERT_COUNT.format(arch=arch)
    k_used = Keys.LLM.EXPERT_USED_COUNT.format(arch=arch)
    k_groups = Keys.LLM.EXPERT_GROUP_COUNT.format(arch=arch)
    k_group_used = Keys.LLM.EXPERT_GROUP_USED_COUNT.format(arch=arch)
    n_expert = _value(r, k_expert, "int") or 0
    used = _int_or_max(r, k_used) or 0
    groups = _value(r, k_groups, "int") or 0
    group_used = _value(r, k_group_used, "int") or 0
    if not 0 <= n_expert <= LLAMA_MAX_EXPERTS:
        raise bad(k_expert, n_expert, f"0 to {LLAMA_MAX_EXPERTS} experts")
    if n_expert > 0:
        if not 0 < used <= n_expert:
            raise bad(k_used, used, f"1 to {k_expert} ({n_expert})")
        if not 0 <= groups < n_expert:
            raise bad(k_groups, groups, f"0 to {k_expert} - 1 ({n_expert - 1})")
        if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
            raise bad(f"{k_groups} / {k_group_used}", f"{groups} / {group_used}",
                      f"groups dividing {k_expert} ({n_expert}) and 1 to groups - 1 of them used")
    elif used or groups:
        raise bad(k_used if used else k_groups, used or groups, f"0 without experts ({k_expert} is 0)")


def read_layout(reader: BoundedReader) -> MtpLayout:
    """The block layout of an open GGUF (module doc).
    raises: GGUFError naming the file when the architecture or block count is missing or
    nextn_predict_layers is out of llama.cpp's bound (the same line load_spec gives)."""
    with _metadata_errors(reader.path):
        arch, block_count, nextn = _layout(reader)
        if block_count is None:
            raise _Corrupt(f"no {Keys.LLM.BLOCK_COUNT.format(arch=arch)} in the metadata; this is not a model file")
    return MtpLayout(arch, block_count, nextn, has_trunk({t.name for t in reader.tensors}, block_count, nextn))


def _spec(path: Path, r: BoundedReader) -> ModelSpec:
    arch, n_layer, nextn = _layout(r)

    tensors = tuple(
        TensorInfo(t.name, t.tensor_type.name, tuple(int(d) for d in t.shape), int(t.n_bytes),
                   int(t.data_offset))
        for t in r.tensors
    )
    mix: dict[str, list[int]] = {}
    for t in tensors:
        share = mix.setdefault(t.type, [0, 0])
        share[0] += 1
        share[1] += t.n_bytes
    quant_mix = tuple(sorted((QuantShare(k, n, b) for k, (n, b) in mix.items()),
                             key=lambda q: (-q.n_bytes, q.type)))

    blocks = [MTPBlock(i, tuple(t for t in tensors if t.name.startswith(f"blk.{i}.")))
              for i in mtp_block_range(n_layer or 0, nextn)]
    n_embd = _value(r, Keys.LLM.EMBEDDING_LENGTH.format(arch=arch), "int")

    return ModelSpec(
        path=path,
        architecture=arch,
        name=_value(r, Keys.General.NAME, "str"),
        size_label=_value(r, Keys.General.SIZE_LABEL, "str"),
        file_type=_file_type(_value(r, Keys.General.FILE_TYPE, "int")),
        context_length=_value(r, Keys.LLM.CONTEXT_LENGTH.format(arch=arch), "int"),
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=_int_or_max(r, Keys.Attention.HEAD_COUNT.format(arch=arch)),
        n_head_kv=_int_or_max(r, Keys.Attention.HEAD_COUNT_KV.format(arch=arch)),
        vocab=_vocab(r),
        chat_template=_value(r, Keys.Tokenizer.CHAT_TEMPLATE, "str"),
        quant_mix=quant_mix,
        nextn_predict_layers=nextn,
        mtp_blocks=tuple(blocks),
        tensors=tensors,
        eagle3=_eagle3(r, n_embd, n_layer) if arch == EAGLE3_ARCH else None,
    )


def _eagle3(r: BoundedReader, n_embd: int | None, n_layer: int | None) -> Eagle3Info:
    a = EAGLE3_ARCH
    layers = _value(r, KEY_TARGET_LAYERS.format(arch=a), "ints")
    names = {t.name: t for t in r.tensors}
    d2t = names.get(TENSOR_D2T)
    d2t_max = None
    if d2t is not None and d2t.tensor_type == GGMLQuantizationType.I64 and d2t.n_elements:
        d2t_max = int(np.asarray(d2t.data).max())
    return Eagle3Info(
        target_layers=tuple(int(x) for x in layers) if layers is not None else (),
        target_hidden_size=_value(r, KEY_TARGET_HIDDEN_SIZE.format(arch=a), "int"),
        n_embd=n_embd,
        n_layer=n_layer,
        draft_vocab=None if d2t is None else int(d2t.n_elements),
        d2t_max=d2t_max,
        own_token_embd=TENSOR_NAMES[MODEL_TENSOR.TOKEN_EMBD] + ".weight" in names,
        own_output=TENSOR_NAMES[MODEL_TENSOR.OUTPUT] + ".weight" in names,
        norm_before_fc=bool(_value(r, KEY_NORM_BEFORE_FC.format(arch=a), "bool")),
        norm_before_residual=bool(_value(r, KEY_NORM_BEFORE_RESIDUAL.format(arch=a), "bool")),
    )


def load_spec(path: str | os.PathLike) -> ModelSpec:
    """Read a GGUF file's metadata and tensor index (no tensor data is read).
    raises: GGUFError, one line naming the file, for anything missing, unreadable or corrupt."""
    path = Path(path)
    r = open_gguf(path)
    with _metadata_errors(path):
        return _spec(path, r)
