"""Synthetic llama targets with an EAGLE-3 draft, for testing and measuring draft-eagle3.

The target (architecture `llama`, one of those whose graph exports layer inputs to an EAGLE-3
draft) is a bigram whose residual after layer R = n_layer - 2 is the embedding of the next token:

    E[t] = [1, sqrt(D - 1) u_t]          u_t random unit vectors: rms 1, one constant feature
    FFN unit j of layer R:               gate_j = ALPHA (u_j . u_t - THETA), up_j = 1 (the constant
                                         feature), down_j = (E[f(j)] - E[j]) / silu(ALPHA (1 - THETA))
                                         so only unit t fires and the residual becomes E[f(t)]
    every attn_output and every other ffn_down is 0; the head is tied (logits = gamma E . norm(r))

so greedy decoding follows the random map f (never to <|endoftext|>). The extract layers are
[1, n_layer // 2, n_layer - 1]: "low" and "mid" read E[x_p], "high" reads E[f(x_p)].

The EAGLE-3 draft (head "exact"):

    fc = [0 | 0 | I]                     g_p = the high feature = E[f(x_p)]
    attn_output = 0                      its attention adds nothing; the residual is g
    ffn_*, output_norm copied            from target layer R and the target
    no token_embd, no output             llama.cpp takes the target's (tied head)

so its pre-norm output is E[f(f(x_p))], which predicts x_{p+2}, and chained (the pre-norm state
is the next step's g) every greedy draft equals the target's greedy choice: 100 % acceptance,
computed by llama.cpp. "noisy:SIGMA" adds N(0, SIGMA^2 / fan_in) to every draft matrix (fc,
attention, FFN); "random" draws them all at random. With draft_vocab = N the draft's own head
covers N tokens through d2t (draft id -> target id), and f maps into those N tokens.

Quantization: "q8_0" is written directly (gguf.quants), as are f32 and f16; in exact mode only
quantized matrices are batch-invariant, so a q8_0 target is the one whose output equals `none` bit
for bit. Its draft is written in f16 (draft_dtype): the draft's residual carries each step's
rounding into the next (g_{k+1} = g_k + FFN(g_k)), and q8_0's rounding (of the weights and of the
activations llama.cpp quantizes for them) adds up until a chain of 16 to 20 steps drafts a wrong
token, so the "exact" head would stop being exact at long n-max (f16 and f32 stay right at 62). The
draft proposes only; the target decides every token, so the output stays bit-exact.
The tokenizer is the truncated Qwen2 BPE of gguf_spec.testmodel. Deterministic: the same config
gives the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .output import same_file, writing
from .spec import (
    EAGLE3_ARCH,
    KEY_NORM_BEFORE_RESIDUAL,
    KEY_TARGET_HIDDEN_SIZE,
    KEY_TARGET_LAYERS,
    TENSOR_D2T,
    TENSOR_FC,
)
from .testmodel import (
    HEAD_DIM,
    RMS_EPS,
    Head,
    SynthConfigError,
    SynthShape,
    _gauss,
    _matrix,
    _ones,
    _rng,
    _tn,
    _zeros,
    tokenizer_for,
)

TARGET_ARCH = "llama"
DRAFT_ARCH = EAGLE3_ARCH
CONTEXT_LENGTH = 8192
ROPE_FREQ_BASE = 10000.0
ALPHA = 40.0         # gate sharpness of the bigram FFN
THETA = 0.6          # gate threshold on the cosine u_j . u_t (random unit vectors: |cos| < 0.3)
LOGIT_TOP = 2.5      # the greedy token's logit (others ~ N(0, (LOGIT_TOP / sqrt(D))^2)): sampling varies
DTYPES = ("f32", "f16", "q8_0")



@dataclass(frozen=True, slots=True)
class Eagle3Config(SynthShape):
    """Shape and head of a synthetic llama target + EAGLE-3 draft. Defaults: the tiny test shape."""

    head: Head = Head()
    n_layer: int = 4
    n_embd: int = 256
    n_ff: int = 512
    n_vocab: int = 512
    draft_vocab: int | None = None   # None: the draft shares the target's head (no d2t)
    seed: int = 0
    head_dim: int = HEAD_DIM         # attention head size (80: phi-2's, which Q8_0's 32-value blocks do not divide)

    def __post_init__(self) -> None:
        if self.n_layer < 4:
            raise SynthConfigError(f"target layers must be >= 4 for three distinct extract layers (got {self.n_layer})")
        self.check_shape()
        if self.n_ff < self.n_vocab:
            raise SynthConfigError(f"n_ff {self.n_ff} is below the vocab {self.n_vocab}: the bigram FFN "
                                   "needs one unit per token")
        if self.head_dim < 2 or self.head_dim % 2 or self.n_embd % self.head_dim:
            raise SynthConfigError(f"head size {self.head_dim} must be even and divide n_embd {self.n_embd}")
        if self.draft_vocab is not None and not 2 <= self.draft_vocab < self.n_vocab:
            raise SynthConfigError(f"draft vocab {self.draft_vocab} is out of range [2, {self.n_vocab - 1}]")

    @property
    def n_head(self) -> int:
        return self.n_embd // self.head_dim

    @property
    def extract_layers(self) -> tuple[int, int, int]:
        return 1, self.n_layer // 2, self.n_layer - 1

    @property
    def bigram_layer(self) -> int:
        return self.n_layer - 2

    def describe(self) -> str:
        dv = f" draft_vocab={self.draft_vocab}" if self.draft_vocab else ""
        hd = f" head_dim={self.head_dim}" if self.head_dim != HEAD_DIM else ""
        return (f"head={self.head} n_layer={self.n_layer} n_embd={self.n_embd} n_ff={self.n_ff} "
                f"vocab={self.n_vocab}{dv}{hd} seed={self.seed}")


TINY = Eagle3Config()
REALISTIC = Eagle3Config(n_layer=24, n_embd=512, n_ff=2048)
SHAPES = {"tiny": TINY, "realistic": REALISTIC}


def bigram_map(cfg: Eagle3Config) -> np.ndarray:
    """int64 [n_vocab]: f, the target's greedy next token of each token. Never <|endoftext|> (the
    last id); with a draft vocabulary, always inside it (draft_tokens)."""
    image = draft_tokens(cfg) if cfg.draft_vocab else np.arange(cfg.n_vocab - 1)
    return image[_rng(cfg.seed, "bigram").integers(0, len(image), cfg.n_vocab)]


def draft_tokens(cfg: Eagle3Config) -> np.ndarray:
    """int64 [draft_vocab]: the target ids of the draft vocabulary (d2t), ascending; no <|endoftext|>."""
    assert cfg.draft_vocab
    return np.sort(_rng(cfg.seed, "draft_vocab").permutation(cfg.n_vocab - 1)[: cfg.draft_vocab])


def _embeddings(cfg: Eagle3Config) -> np.ndarray:
    D = cfg.n_embd
    u = _gauss(cfg.seed, "token_embd", (cfg.n_vocab, D - 1), 1.0)
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    emb = np.empty((cfg.n_vocab, D), dtype=np.float32)
    emb[:, 0] = 1.0                                  # the constant feature (the FFN's bias input)
    emb[:, 1:] = u * np.float32(math.sqrt(D - 1))   # rows of rms 1
    return emb


def _silu(x: float) -> float:
    return x / (1.0 + math.exp(-x))


def _bigram_ffn(cfg: Eagle3Config, emb: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(gate, up, down) of the layer that maps E[t] to E[f(t)] - E[t], numpy (out, in)."""
    D, F, V = cfg.n_embd, cfg.n_ff, cfg.n_vocab
    gate, up, down = _zeros(F, D), _zeros(F, D), _zeros(D, F)
    u = emb[:, 1:] / np.float32(math.sqrt(D - 1))
    gate[:V, 0] = -ALPHA * THETA
    gate[:V, 1:] = ALPHA * u / np.float32(math.sqrt(D - 1))
    up[:V, 0] = 1.0
    down[:, :V] = ((emb[bigram_map(cfg)] - emb) / np.float32(_silu(ALPHA * (1 - THETA)))).T
    return gate, up, down


def target_tensors(cfg: Eagle3Config) -> dict[str, np.ndarray]:
    """Every tensor of the target as float32 numpy arrays, shape (out, in), in file order."""
    T = gguf.MODEL_TENSOR
    s, D, F = cfg.seed, cfg.n_embd, cfg.n_ff
    hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
    out: dict[str, np.ndarray] = {}
    emb = _embeddings(cfg)
    out[_tn(T.TOKEN_EMBD)] = emb
    out[_tn(T.OUTPUT_NORM)] = np.full(D, LOGIT_TOP / D, dtype=np.float32)   # tied head: top logit LOGIT_TOP
    for il in range(cfg.n_layer):
        k = f"blk.{il}"
        out[_tn(T.ATTN_NORM, il)] = _ones(D)
        out[_tn(T.ATTN_Q, il)] = _matrix(s, f"{k}.attn_q", nh * hd, D)
        out[_tn(T.ATTN_K, il)] = _matrix(s, f"{k}.attn_k", nkv * hd, D)
        out[_tn(T.ATTN_V, il)] = _matrix(s, f"{k}.attn_v", nkv * hd, D)
        out[_tn(T.ATTN_OUT, il)] = _zeros(D, nh * hd)
        out[_tn(T.FFN_NORM, il)] = _ones(D)
        if il == cfg.bigram_layer:
            g, u, d = _bigram_ffn(cfg, emb)
        else:
            g, u, d = _matrix(s, f"{k}.ffn_gate", F, D), _matrix(s, f"{k}.ffn_up", F, D), _zeros(D, F)
        out[_tn(T.FFN_GATE, il)], out[_tn(T.FFN_UP, il)], out[_tn(T.FFN_DOWN, il)] = g, u, d
    return out


def draft_tensors(cfg: Eagle3Config) -> dict[str, np.ndarray]:
    """Every tensor of the EAGLE-3 draft (float32 numpy, shape (out, in); d2t int64), in file order."""
    T = gguf.MODEL_TENSOR
    s, D = cfg.seed, cfg.n_embd
    hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
    tgt = target_tensors(cfg)
    R = cfg.bigram_layer
    out: dict[str, np.ndarray] = {}
    fc = _zeros(D, 3 * D)
    fc[:, 2 * D:] = np.eye(D, dtype=np.float32)          # select the high feature
    out[TENSOR_FC] = fc
    out[_tn(T.OUTPUT_NORM)] = tgt[_tn(T.OUTPUT_NORM)].copy()
    if cfg.draft_vocab:
        ids = draft_tokens(cfg)
        out[_tn(T.OUTPUT)] = tgt[_tn(T.TOKEN_EMBD)][ids].copy()   # the tied head's rows of the draft vocab
        out[TENSOR_D2T] = ids.astype(np.int64)
    out[_tn(T.ATTN_NORM, 0)] = _ones(D)
    out[_tn(T.ATTN_NORM_2, 0)] = _ones(D)
    out[_tn(T.ATTN_Q, 0)] = _matrix(s, "eagle3.attn_q", nh * hd, 2 * D)
    out[_tn(T.ATTN_K, 0)] = _matrix(s, "eagle3.attn_k", nkv * hd, 2 * D)
    out[_tn(T.ATTN_V, 0)] = _matrix(s, "eagle3.attn_v", nkv * hd, 2 * D)
    out[_tn(T.ATTN_OUT, 0)] = _zeros(D, nh * hd)
    out[_tn(T.FFN_NORM, 0)] = _ones(D)
    for t in (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN):
        out[_tn(t, 0)] = tgt[_tn(t, R)].copy()
    matrices = [TENSOR_FC] + [_tn(t, 0) for t in (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT,
                                                   T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)]
    if cfg.head.kind == "noisy":
        for name in matrices:
            a = out[name]
            a += _gauss(s, f"noise.{name}", a.shape, cfg.head.sigma / math.sqrt(a.shape[1]))
    elif cfg.head.kind == "random":
        for name in matrices:
            n_out, n_in = out[name].shape
            out[name] = _matrix(s, f"random.{name}", n_out, n_in)
    return out


# ---------------------------------------------------------------------------------------------
# the writers


def _common(w: gguf.GGUFWriter, cfg: Eagle3Config, dtype: str, n_layer: int) -> None:
    tokens, types, merges = tokenizer_for(cfg.n_vocab)
    eot = cfg.n_vocab - 1
    w.add_file_type(int({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                         "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]))
    w.add_context_length(CONTEXT_LENGTH)
    w.add_embedding_length(cfg.n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(cfg.n_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(ROPE_FREQ_BASE)
    w.add_vocab_size(cfg.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(eot)
    w.add_eos_token_id(eot)
    w.add_pad_token_id(eot)
    w.add_add_bos_token(False)


def _add(w: gguf.GGUFWriter, name: str, a: np.ndarray, dtype: str) -> None:
    if a.dtype == np.int64:
        w.add_tensor(name, a, raw_dtype=gguf.GGMLQuantizationType.I64)
    elif a.ndim == 2 and dtype == "f16":
        w.add_tensor(name, a.astype(np.float16))
    elif a.ndim == 2 and dtype == "q8_0":
        Q8 = gguf.GGMLQuantizationType.Q8_0
        w.add_tensor(name, gguf.quants.quantize(a, Q8), raw_dtype=Q8)
    else:
        w.add_tensor(name, a)


def _finish(w: gguf.GGUFWriter, path: Path, tensors: dict[str, np.ndarray], dtype: str) -> None:
    for name, a in tensors.items():
        _add(w, name, a, dtype)
    w.write_header_to_file(path)
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def draft_dtype_for(dtype: str) -> str:
    """The draft's dtype by default: f16 beside a q8_0 target (see the module docstring), else the same."""
    return "f16" if dtype == "q8_0" else dtype


def write_eagle3_pair(target: str | Path, draft: str | Path, cfg: Eagle3Config = TINY,
                      dtype: str = "q8_0", draft_dtype: str | None = None) -> tuple[Path, Path]:
    """Write the synthetic target with 2-D matrices in `dtype` ('f32' | 'f16' | 'q8_0'; norms stay
    F32, d2t I64) and its EAGLE-3 draft in `draft_dtype` (default draft_dtype_for(dtype)).
    Deterministic: same arguments -> same bytes."""
    draft_dtype = draft_dtype_for(dtype) if draft_dtype is None else draft_dtype
    for d in (dtype, draft_dtype):
        if d not in DTYPES:
            raise SynthConfigError(f"the EAGLE-3 test models are written as {', '.join(DTYPES)}, not '{d}'")
    target, draft = Path(target), Path(draft)
    if same_file(target, draft):
        raise SynthConfigError(f"the target and the draft are the same file ({target}); give two names")
    with writing(target) as target_out, writing(draft) as draft_out:     # both checked before either is written
        _write_pair(target_out, draft_out, cfg, dtype, draft_dtype)
    return target, draft


def _write_pair(target: Path, draft: Path, cfg: Eagle3Config, dtype: str, draft_dtype: str) -> None:
    w = gguf.GGUFWriter(None, TARGET_ARCH)
    w.add_name(f"specrun synthetic {TARGET_ARCH} (EAGLE-3 target)")
    w.add_description(f"specrun make-test-model --eagle3: {cfg.describe()}")
    _common(w, cfg, dtype, cfg.n_layer)
    _finish(w, target, target_tensors(cfg), dtype)

    w = gguf.GGUFWriter(None, DRAFT_ARCH)
    w.add_name(f"specrun synthetic {DRAFT_ARCH} draft")
    w.add_description(f"specrun make-test-model --eagle3: {cfg.describe()}")
    _common(w, cfg, draft_dtype, 1)
    w.add_array(KEY_TARGET_LAYERS.format(arch=DRAFT_ARCH), list(cfg.extract_layers))
    w.add_uint32(KEY_TARGET_HIDDEN_SIZE.format(arch=DRAFT_ARCH), cfg.n_embd)
    w.add_bool(KEY_NORM_BEFORE_RESIDUAL.format(arch=DRAFT_ARCH), False)
    _finish(w, draft, draft_tensors(cfg), draft_dtype)
