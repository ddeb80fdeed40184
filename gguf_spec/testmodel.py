"""Synthetic qwen35 GGUFs with one MTP block, for testing and measuring draft-mtp.

The trunk is a hybrid of gated-delta-net (GDN) and gated full-attention layers, as in Qwen3.5.
Every token-mixing output (`ssm_out`, `attn_output`) is zero and only the last trunk layer has a
non-zero FFN, so the model is a bigram: next = f(current). The other layers still cost their
full compute, which is what makes speed measurable.

The MTP block (blk.N, after the N trunk blocks) is built from the trunk (head "exact"):

    token_embd rows have rms 1            so rmsnorm(E[x]) == E[x]
    nextn.eh_proj = [I | 0]               keeps the embedding half, drops h
    attn_output = 0                       the MTP attention adds nothing
    post_attention_norm, ffn_* copied     from the last trunk layer

so MTP(x_p, h_{p-1}) equals the trunk's logits at p and greedy drafts are always accepted
(exactly in F16). "noisy:SIGMA" adds N(0, SIGMA^2 / fan_in) to every MTP matrix; "random" draws
the whole MTP block at random, so its drafts are mostly rejected.

Layer types: layer il is recurrent (GDN) iff (il + 1) % full_attention_interval != 0, with the
interval 4 (as in Qwen3.5) from 4 trunk layers up, else 2. There is always at least one GDN
layer: a qwen35 without one aborts in llama.cpp's hybrid-memory input.

The tokenizer is Qwen2's byte-level BPE cut to n_vocab tokens: the first n_vocab - 1 tokens,
the n_vocab - 257 merges whose results they contain (merge i makes token 256 + i), and
<|endoftext|> as the last id. It ships as package data (data/qwen2-vocab-16k.json.gz), made by
`_build_vocab_data` from llama.cpp's models/ggml-vocab-qwen2.gguf.

The writer is deterministic: the same config gives the same bytes. Every tensor draws from its
own stream, keyed by (seed, tensor name), so heads built with one seed share one trunk.
"""

from __future__ import annotations

import gzip
import json
import math
import zlib
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Literal

import gguf
import numpy as np

from .errors import SpecrunError
from .output import writing
from .spec import open_gguf

ARCH = "qwen35"
HEAD_DIM = 64                  # attention and GDN head size; n_embd must be a multiple
ROPE_SECTIONS = [11, 11, 10, 0]  # IMROPE sections, sum = HEAD_DIM / 2
SSM_CONV_KERNEL = 4
CONTEXT_LENGTH = 8192
RMS_EPS = 1e-6
ROPE_FREQ_BASE = 1e7
LOGIT_STD = 5.0                # target std of the logits (output matrix scale)
VOCAB_DATA = "qwen2-vocab-16k.json.gz"
MIN_VOCAB, MAX_VOCAB = 257, 16384   # 256 byte tokens + <|endoftext|> .. what the data holds
EOT_TEXT = "<|endoftext|>"

DTYPES = ("f32", "f16")        # what the writer itself emits; quantized types go through llama.cpp


class SynthConfigError(SpecrunError):
    """A synthetic-model setting that cannot be built."""


@dataclass(frozen=True, slots=True)
class Head:
    """How the MTP block relates to the trunk: exact copy, copy plus noise, or random."""

    kind: Literal["exact", "noisy", "random"] = "exact"
    sigma: float = 0.0         # noise std times sqrt(fan_in); only for "noisy"

    @staticmethod
    def parse(text: str) -> Head:
        """'exact' | 'random' | 'noisy:SIGMA' (SIGMA a finite number > 0)."""
        t = text.strip().lower()
        if t in ("exact", "random"):
            return Head(t)  # type: ignore[arg-type]
        if t.startswith("noisy:"):
            raw = t.partition(":")[2]
            try:
                sigma = float(raw)
            except ValueError:
                sigma = math.nan
            if not math.isfinite(sigma) or sigma <= 0:
                raise SynthConfigError(f"bad noise in head '{text}': SIGMA must be a number > 0, e.g. noisy:0.1")
            return Head("noisy", sigma)
        raise SynthConfigError(f"unknown head '{text}'; use exact, random or noisy:SIGMA (e.g. noisy:0.1)")

    def __str__(self) -> str:
        return f"noisy:{self.sigma:g}" if self.kind == "noisy" else self.kind


class SynthShape:
    """What the synthetic shapes share (SynthConfig; testmodel_eagle3.Eagle3Config): the checks of
    n_embd, the vocabulary and the seed (one-line SynthConfigErrors), and the attention heads."""

    __slots__ = ()
    n_embd: int
    n_vocab: int
    seed: int

    def check_shape(self) -> None:
        if self.n_embd < HEAD_DIM or self.n_embd % HEAD_DIM:
            raise SynthConfigError(
                f"n_embd {self.n_embd} is not a positive multiple of the head size {HEAD_DIM}; "
                f"try {max(HEAD_DIM, self.n_embd // HEAD_DIM * HEAD_DIM)}")
        if not MIN_VOCAB <= self.n_vocab <= MAX_VOCAB:
            raise SynthConfigError(f"vocab {self.n_vocab} is out of range [{MIN_VOCAB}, {MAX_VOCAB}]")
        if not 0 <= self.seed < 2**63:
            raise SynthConfigError(f"seed must be in [0, 2^63) (got {self.seed})")

    @property
    def n_head(self) -> int:
        return self.n_embd // HEAD_DIM

    @property
    def n_head_kv(self) -> int:
        return max(1, self.n_head // 4)


@dataclass(frozen=True, slots=True)
class SynthConfig(SynthShape):
    """Shape and head of a synthetic qwen35 + MTP model. Defaults are the tiny test shape."""

    head: Head = Head()
    trunk_layers: int = 2
    n_embd: int = 256
    n_ff: int = 512
    n_vocab: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        if self.trunk_layers < 1:
            raise SynthConfigError(f"trunk layers must be >= 1 (got {self.trunk_layers})")
        self.check_shape()
        if self.n_ff < 1:
            raise SynthConfigError(f"n_ff must be >= 1 (got {self.n_ff})")

    # derived hyperparameters ------------------------------------------------------------------
    @property
    def full_attention_interval(self) -> int:
        return 4 if self.trunk_layers >= 4 else 2

    @property
    def block_count(self) -> int:
        return self.trunk_layers + 1       # trunk + the MTP block

    @property
    def mtp_layer(self) -> int:
        return self.trunk_layers

    def is_recurrent(self, il: int) -> bool:
        return il < self.trunk_layers and (il + 1) % self.full_attention_interval != 0

    def describe(self) -> str:
        return (f"head={self.head} trunk_layers={self.trunk_layers} n_embd={self.n_embd} "
                f"n_ff={self.n_ff} vocab={self.n_vocab} seed={self.seed}")


TINY = SynthConfig()
REALISTIC = SynthConfig(trunk_layers=24, n_embd=512, n_ff=2048)
SHAPES = {"tiny": TINY, "realistic": REALISTIC}


# ---------------------------------------------------------------------------------------------
# tokenizer


@lru_cache(maxsize=1)
def _vocab_data() -> dict:
    raw = resources.files(__package__).joinpath("data", VOCAB_DATA).read_bytes()
    return json.loads(gzip.decompress(raw))


def tokenizer_for(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) of the truncated Qwen2 tokenizer with n_vocab ids."""
    data = _vocab_data()
    tokens = data["tokens"][: n_vocab - 1] + [EOT_TEXT]
    types = [int(gguf.TokenType.NORMAL)] * (n_vocab - 1) + [int(gguf.TokenType.CONTROL)]
    merges = data["merges"][: n_vocab - 257]
    return tokens, types, merges


def _build_vocab_data(vocab_gguf: str | Path, out: str | Path, n_max: int = MAX_VOCAB) -> None:
    """Regenerate the package data from llama.cpp's models/ggml-vocab-qwen2.gguf (dev tool)."""
    r = open_gguf(vocab_gguf)
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    index = {t: i for i, t in enumerate(tokens)}
    for i, m in enumerate(merges[: n_max - 257]):
        a, b = m.split(" ")
        assert index[a + b] == 256 + i, f"merge {i} ({m}) does not make token {256 + i}"
    doc = {"source": "llama.cpp models/ggml-vocab-qwen2.gguf (llama-cpp-python 0.3.36 sdist)",
           "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
           "tokens": tokens[: n_max - 1], "merges": merges[: n_max - 257]}
    blob = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    Path(out).write_bytes(gzip.compress(blob, 9, mtime=0))


# ---------------------------------------------------------------------------------------------
# weights


def _tn(t: gguf.MODEL_TENSOR, bid: int | None = None, suffix: str | None = "weight") -> str:
    name = gguf.TENSOR_NAMES[t].format(bid=bid)
    return f"{name}.{suffix}" if suffix else name


def _rng(seed: int, key: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def _gauss(seed: int, key: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    a = _rng(seed, key).standard_normal(shape, dtype=np.float32)
    a *= np.float32(std)
    return a


def _matrix(seed: int, name: str, n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
    """Gaussian (n_out, n_in) with std gain / sqrt(n_in): unit-scale outputs for unit inputs."""
    return _gauss(seed, name, (n_out, n_in), gain / math.sqrt(n_in))


def _ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def _zeros(n_out: int, n_in: int) -> np.ndarray:
    return np.zeros((n_out, n_in), dtype=np.float32)


def build_tensors(cfg: SynthConfig) -> dict[str, np.ndarray]:
    """Every tensor of the model as float32 numpy arrays, numpy shape (out, in), in file order."""
    T = gguf.MODEL_TENSOR
    s, D, F, V = cfg.seed, cfg.n_embd, cfg.n_ff, cfg.n_vocab
    hd, nh, nkv = HEAD_DIM, cfg.n_head, cfg.n_head_kv
    n_v_heads = n_k_heads = cfg.n_head          # GDN: head size HEAD_DIM, as many heads as attention
    key_dim, value_dim = n_k_heads * hd, n_v_heads * hd
    R = cfg.trunk_layers - 1                     # the trunk layer with the bigram FFN

    out: dict[str, np.ndarray] = {}
    emb = _gauss(s, "token_embd", (V, D), 1.0)
    emb /= np.sqrt(np.mean(emb * emb, axis=1, keepdims=True))           # rows of rms 1
    out[_tn(T.TOKEN_EMBD)] = emb
    out[_tn(T.OUTPUT_NORM)] = _ones(D)
    out[_tn(T.OUTPUT)] = _matrix(s, "output", V, D, LOGIT_STD)

    def attention(il: int, key: str) -> None:
        out[_tn(T.ATTN_Q, il)] = _matrix(s, f"{key}.attn_q", 2 * nh * hd, D)   # [q_h | gate_h] per head
        out[_tn(T.ATTN_K, il)] = _matrix(s, f"{key}.attn_k", nkv * hd, D)
        out[_tn(T.ATTN_V, il)] = _matrix(s, f"{key}.attn_v", nkv * hd, D)
        out[_tn(T.ATTN_OUT, il)] = _zeros(D, nh * hd)
        out[_tn(T.ATTN_Q_NORM, il)] = _ones(hd)
        out[_tn(T.ATTN_K_NORM, il)] = _ones(hd)

    def ffn(il: int, key: str, live: bool) -> None:
        out[_tn(T.FFN_GATE, il)] = _matrix(s, f"{key}.ffn_gate", F, D)
        out[_tn(T.FFN_UP, il)] = _matrix(s, f"{key}.ffn_up", F, D)
        out[_tn(T.FFN_DOWN, il)] = _matrix(s, f"{key}.ffn_down", D, F) if live else _zeros(D, F)

    for il in range(cfg.trunk_layers):
        key = f"blk.{il}"
        out[_tn(T.ATTN_NORM, il)] = _ones(D)
        out[_tn(T.ATTN_POST_NORM, il)] = _ones(D)
        if cfg.is_recurrent(il):
            out[_tn(T.ATTN_QKV, il)] = _matrix(s, f"{key}.attn_qkv", 2 * key_dim + value_dim, D)
            out[_tn(T.ATTN_GATE, il)] = _matrix(s, f"{key}.attn_gate", value_dim, D)
            out[_tn(T.SSM_CONV1D, il)] = _matrix(s, f"{key}.ssm_conv1d", 2 * key_dim + value_dim,
                                                 SSM_CONV_KERNEL)
            out[_tn(T.SSM_DT, il, "bias")] = _ones(n_v_heads)
            out[_tn(T.SSM_A, il, None)] = -_ones(n_v_heads)          # -exp(A_log), A_log = 0
            out[_tn(T.SSM_BETA, il)] = _matrix(s, f"{key}.ssm_beta", n_v_heads, D)
            out[_tn(T.SSM_ALPHA, il)] = _matrix(s, f"{key}.ssm_alpha", n_v_heads, D)
            out[_tn(T.SSM_NORM, il)] = _ones(hd)
            out[_tn(T.SSM_OUT, il)] = _zeros(D, value_dim)
        else:
            attention(il, key)
        ffn(il, key, live=il == R)

    m = cfg.mtp_layer
    out[_tn(T.ATTN_NORM, m)] = _ones(D)
    attention(m, "mtp")
    eh = _zeros(D, 2 * D)
    eh[:, :D] = np.eye(D, dtype=np.float32)                         # concat(e_norm, h_norm): keep e
    out[_tn(T.NEXTN_EH_PROJ, m)] = eh
    out[_tn(T.NEXTN_ENORM, m)] = _ones(D)
    out[_tn(T.NEXTN_HNORM, m)] = _ones(D)
    for t in (T.ATTN_POST_NORM, T.FFN_GATE, T.FFN_UP, T.FFN_DOWN):
        out[_tn(t, m)] = out[_tn(t, R)].copy()

    mtp_matrices = [_tn(t, m) for t in (T.NEXTN_EH_PROJ, T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT,
                                        T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)]
    if cfg.head.kind == "noisy":
        for name in mtp_matrices:
            a = out[name]
            a += _gauss(s, f"noise.{name}", a.shape, cfg.head.sigma / math.sqrt(a.shape[1]))
    elif cfg.head.kind == "random":
        for name in mtp_matrices:
            n_out, n_in = out[name].shape
            out[name] = _matrix(s, f"random.{name}", n_out, n_in)
        out[_tn(T.ATTN_POST_NORM, m)] = _ones(D)
    return out


# ---------------------------------------------------------------------------------------------
# the writer


def write_test_model(path: str | Path, cfg: SynthConfig = TINY, dtype: str = "f16") -> Path:
    """Write the synthetic model as a GGUF with 2-D matrices in `dtype` ('f32' | 'f16'; 1-D
    tensors and ssm_conv1d stay F32). Deterministic: same (cfg, dtype) -> same bytes."""
    if dtype not in DTYPES:
        raise SynthConfigError(f"the writer emits {' or '.join(DTYPES)}, not '{dtype}' "
                               "(quantized types go through llama.cpp's quantizer)")
    path = Path(path)
    A = ARCH
    tokens, types, merges = tokenizer_for(cfg.n_vocab)
    eot = cfg.n_vocab - 1

    w = gguf.GGUFWriter(None, A)                  # the file is opened by write_header_to_file
    w.add_name(f"specrun synthetic {A} + MTP")
    w.add_description(f"specrun make-test-model: {cfg.describe()}")
    w.add_file_type(int(gguf.LlamaFileType.ALL_F32 if dtype == "f32" else gguf.LlamaFileType.MOSTLY_F16))
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(cfg.block_count)
    w.add_nextn_predict_layers(1)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_dimension_sections(ROPE_SECTIONS)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_ssm_conv_kernel(SSM_CONV_KERNEL)
    w.add_ssm_state_size(HEAD_DIM)
    w.add_ssm_group_count(cfg.n_head)
    w.add_ssm_time_step_rank(cfg.n_head)
    w.add_ssm_inner_size(cfg.n_head * HEAD_DIM)
    w.add_full_attention_interval(cfg.full_attention_interval)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_pad_token_id(eot)
    w.add_add_bos_token(False)

    for name, a in build_tensors(cfg).items():
        if dtype == "f16" and a.ndim == 2 and ".ssm_conv1d." not in name:
            a = a.astype(np.float16)
        w.add_tensor(name, a)

    with writing(path) as out:
        w.write_header_to_file(out)
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return path
