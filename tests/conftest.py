"""Shared fixtures: the two registry models (real GGUFs, resolved offline) and `make_gguf`, which
writes a tiny but well-formed model GGUF with gguf's own writer."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest

from specrun.gguf_spec.registry import resolve_model

# One llama.cpp thread per engine, in this process and in the specrun processes tests start: a
# thread never spins at a barrier for a descheduled sibling, so other work on the machine slows a
# test in proportion only, and `pytest -n 2` keeps each core busy. A test that needs more says -t.
os.environ.setdefault("LLAMA_ARG_THREADS", "1")

TINY_TOKENS = ["<unk>", "<s>", "</s>", "<|eot|>", "<pad>"] + [f"tok{i}" for i in range(27)]   # 32 tokens


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """Gemma 3 270M Q4_K_M (assembled once into the cache: ~10 s the first time)."""
    return resolve_model("gemma-3-270m")


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (BPE vocab of 49152, chat template)."""
    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def servers():
    """In-process `specrun serve` servers over engines kept for the session (tests/serving.py)."""
    from serving import Servers

    s = Servers()
    yield s
    s.close()


def write_gguf(path: Path, *, arch: str = "llama", n_layer: int = 2, n_embd: int = 32, nextn: int = 0,
               tokens: list[str] | None = None, chat_template: str | None = None) -> Path:
    """A tiny model GGUF: F32/F16/Q8_0 tensors, `n_layer` blocks, the last `nextn` of which are
    NextN (MTP) blocks with blk.N.nextn.* tensors. A few KB; deterministic."""
    tokens = TINY_TOKENS if tokens is None else tokens
    n_vocab, n_ff = len(tokens), 2 * n_embd
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny")
    w.add_size_label("1K")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_context_length(256)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    if nextn:
        w.add_nextn_predict_layers(nextn)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types([1] * n_vocab)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    w.add_add_bos_token(True)
    if chat_template is not None:
        w.add_chat_template(chat_template)

    rng = np.random.default_rng(0)

    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    def q8(*shape: int) -> np.ndarray:       # quantized with gguf.quants; shape is numpy order
        return gguf.quants.quantize(f32(*shape), gguf.GGMLQuantizationType.Q8_0)

    name = gguf.TENSOR_NAMES
    T = gguf.MODEL_TENSOR
    w.add_tensor(name[T.TOKEN_EMBD] + ".weight", f32(n_vocab, n_embd).astype(np.float16))
    w.add_tensor(name[T.OUTPUT_NORM] + ".weight", f32(n_embd))
    for bid in range(n_layer):
        def add(t: gguf.MODEL_TENSOR, data: np.ndarray, qtype=None, bid=bid) -> None:
            w.add_tensor(name[t].format(bid=bid) + ".weight", data, raw_dtype=qtype)

        Q8 = gguf.GGMLQuantizationType.Q8_0
        add(T.ATTN_NORM, f32(n_embd))
        add(T.ATTN_Q, q8(n_embd, n_embd), Q8)
        add(T.ATTN_K, q8(n_embd // 2, n_embd), Q8)
        add(T.ATTN_V, q8(n_embd // 2, n_embd), Q8)
        add(T.ATTN_OUT, q8(n_embd, n_embd), Q8)
        add(T.FFN_NORM, f32(n_embd))
        add(T.FFN_GATE, q8(n_ff, n_embd), Q8)
        add(T.FFN_UP, q8(n_ff, n_embd), Q8)
        add(T.FFN_DOWN, q8(n_embd, n_ff), Q8)
        if bid >= n_layer - nextn:
            add(T.NEXTN_EH_PROJ, q8(n_embd, 2 * n_embd), Q8)
            add(T.NEXTN_ENORM, f32(n_embd))
            add(T.NEXTN_HNORM, f32(n_embd))
            add(T.NEXTN_SHARED_HEAD_NORM, f32(n_embd))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def make_gguf(tmp_path: Path):
    """make_gguf(name="tiny.gguf", **write_gguf options) -> path of a tiny GGUF under tmp_path."""

    def make(name: str = "tiny.gguf", **kw) -> Path:
        return write_gguf(tmp_path / name, **kw)

    return make


def rewrite_gguf(src: Path, dst: Path, *, kv: dict | None = None, strings: dict[str, str] | None = None,
                 nan: str | None = None, tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of the GGUF src: metadata in kv ({key: (value, GGUFValueType)}) set, string keys in
    strings added (as convert_hf_to_gguf.py writes general.source.*), every value of tensor `nan`
    (F32) made NaN (what a corrupt or overflowed file gives), the data of the tensors named in
    `tensors` replaced (raw: the same type and byte shape as the tensor's, e.g. gguf.quants.quantize)."""
    tensors = tensors or {}
    kv = kv or {}
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, str(r.fields["general.architecture"].contents()))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        value, vtype = kv.get(name, (f.contents(), f.types[0]))
        w.add_key_value(name, value, vtype, sub_type=sub)
    for k, v in (strings or {}).items():
        w.add_string(k, v)
    for t in r.tensors:
        data = np.full_like(t.data, np.nan) if t.name == nan else tensors.get(t.name, t.data)
        w.add_tensor(t.name, data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
