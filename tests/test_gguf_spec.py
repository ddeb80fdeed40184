"""load_spec on the two registry models and on tiny GGUFs written here; draft compatibility."""

from __future__ import annotations

import dataclasses

import gguf
import pytest

from specrun.gguf_spec.compat import check_draft_compatible
from specrun.gguf_spec.extract import extract_mtp, extract_trunk
from specrun.gguf_spec.spec import (
    TRUNK_PROBE,
    BoundedReader,
    ModelSpec,
    MTPBlock,
    MtpLayout,
    TensorInfo,
    Vocab,
    has_trunk,
    load_spec,
    mtp_block_range,
    open_gguf,
    read_layout,
)

slow = pytest.mark.slow     # gemma: assembled into the cache (253 MB) the first time


@pytest.fixture(scope="module")
def gemma(gemma_path) -> ModelSpec:
    return load_spec(gemma_path)


@pytest.fixture(scope="module")
def smollm(smollm_path) -> ModelSpec:
    return load_spec(smollm_path)


@slow
def test_gemma_3_270m(gemma: ModelSpec, gemma_path):
    s = gemma
    assert (s.path, s.architecture, s.name, s.size_label, s.file_type) == \
        (gemma_path, "gemma3", "Gemma 3 270m", "270M", "Q4_K_M")
    assert (s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.context_length) == (18, 640, 4, 1, 32768)
    v = s.vocab
    assert (v.model, v.pre, v.size, v.bos_id, v.eos_id, v.eot_id, v.add_bos, v.add_eos) == \
        ("llama", "default", 262144, 2, 1, None, True, False)
    assert len(v.tokens) == 262144 and v.tokens[:3] == ("<pad>", "<eos>", "<bos>")
    assert not s.has_chat_template and s.chat_template is None
    assert (s.nextn_predict_layers, s.mtp_blocks, s.has_mtp) == (0, (), False)
    assert s.n_tensors == 236
    assert s.n_bytes == sum(t.n_bytes for t in s.tensors) == 246587904
    # quant mix: sorted by bytes, and it accounts for every tensor
    assert [q.type for q in s.quant_mix] == ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "F32"]
    assert sum(q.n_tensors for q in s.quant_mix) == s.n_tensors
    assert sum(q.n_bytes for q in s.quant_mix) == s.n_bytes
    embd = next(t for t in s.tensors if t.name == "token_embd.weight")
    assert (embd.type, embd.shape) == ("Q8_0", (640, 262144))
    # every tensor lies inside the file, in order, without overlap
    size = gemma_path.stat().st_size
    spans = sorted((t.offset, t.offset + t.n_bytes) for t in s.tensors)
    assert all(a_end <= b_begin for (_, a_end), (b_begin, _) in zip(spans, spans[1:], strict=False))
    assert spans[-1][1] <= size


def test_smollm2_135m(smollm: ModelSpec):
    s = smollm
    assert (s.architecture, s.n_layer, s.n_embd, s.n_head, s.n_head_kv, s.file_type) == \
        ("llama", 30, 576, 9, 3, "Q4_1")
    v = s.vocab
    assert (v.model, v.pre, v.size, v.bos_id, v.eos_id, v.add_bos) == ("gpt2", "smollm", 49152, 1, 2, False)
    assert v.tokens[:3] == ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
    assert s.has_chat_template and "<|im_start|>" in s.chat_template
    assert s.n_tensors == 272 and not s.has_mtp


@slow
def test_spec_is_frozen_and_repr_is_small(gemma: ModelSpec):
    with pytest.raises(dataclasses.FrozenInstanceError):
        gemma.n_layer = 1
    assert len(repr(gemma)) < 2000      # no 262k tokens, no tensor list, no template in the repr


def test_tiny_model_with_one_mtp_block(make_gguf):
    path = make_gguf(arch="qwen35", n_layer=3, nextn=1, chat_template="{{ messages }}")
    s = load_spec(path)
    assert (s.architecture, s.n_layer, s.n_embd, s.name, s.file_type) == ("qwen35", 3, 32, "tiny", "Q8_0")
    assert s.vocab.eot_id == 3 and s.chat_template == "{{ messages }}"
    assert s.nextn_predict_layers == 1 and s.has_mtp
    (block,) = s.mtp_blocks
    assert block.index == 2
    names = [t.name for t in block.tensors]
    assert all(n.startswith("blk.2.") for n in names)
    assert "blk.2.attn_q.weight" in names and "blk.2.ffn_down.weight" in names
    nextn = {t.name: t for t in block.nextn}
    assert set(nextn) == {
        gguf.TENSOR_NAMES[t].format(bid=2) + ".weight"
        for t in (gguf.MODEL_TENSOR.NEXTN_EH_PROJ, gguf.MODEL_TENSOR.NEXTN_ENORM,
                  gguf.MODEL_TENSOR.NEXTN_HNORM, gguf.MODEL_TENSOR.NEXTN_SHARED_HEAD_NORM)
    }
    eh = nextn["blk.2.nextn.eh_proj.weight"]
    assert (eh.type, eh.shape, eh.n_bytes) == ("Q8_0", (64, 32), 32 * 2 * 34)   # 2 Q8_0 blocks per row


def test_tiny_model_mtp_blocks_are_the_last_ones(make_gguf):
    s = load_spec(make_gguf(arch="qwen35", n_layer=4, nextn=2))
    assert [b.index for b in s.mtp_blocks] == [2, 3]
    assert all(len(b.nextn) == 4 for b in s.mtp_blocks)


def test_layout_and_trunk_follow_llama_cpp(make_gguf, tmp_path):
    """The MTP blocks are the last nextn of block_count; a file has the trunk when a block comes
    before them and blk.0.attn_norm.weight is there (llama.cpp's MTP-only test)."""
    assert TRUNK_PROBE == "blk.0.attn_norm.weight"
    assert list(mtp_block_range(4, 2)) == [2, 3] and list(mtp_block_range(4, 0)) == []
    assert list(mtp_block_range(2, 2)) == [0, 1]
    assert has_trunk([TRUNK_PROBE], 3, 1) and not has_trunk([TRUNK_PROBE], 2, 2)
    assert not has_trunk(["blk.2.attn_norm.weight"], 3, 1) and not has_trunk([TRUNK_PROBE], None, 0)

    full = make_gguf(arch="qwen35", n_layer=3, nextn=1)
    r = open_gguf(full)
    assert isinstance(r, BoundedReader) and r.path == full
    layout = read_layout(r)
    assert layout == MtpLayout("qwen35", block_count=3, nextn_layers=1, has_trunk=True)
    assert (layout.n_layer, layout.mtp_blocks) == (2, range(2, 3))
    heads = extract_mtp(full, tmp_path / "heads.gguf").path
    trunk = extract_trunk(full, tmp_path / "trunk.gguf").path
    assert read_layout(open_gguf(heads)) == MtpLayout("qwen35", 3, 1, has_trunk=False)
    assert read_layout(open_gguf(trunk)) == MtpLayout("qwen35", 2, 0, has_trunk=True)
    got = {p.name: (s.has_trunk, s.has_mtp, [b.index for b in s.mtp_blocks])
           for p in (full, heads, trunk, make_gguf("plain.gguf")) for s in [load_spec(p)]}
    assert got == {"tiny.gguf": (True, True, [2]), "heads.gguf": (False, True, [2]),
                   "trunk.gguf": (True, False, []), "plain.gguf": (True, False, [])}


def test_bounded_reader_keeps_numeric_arrays_whole(make_gguf):
    """One data part per numeric array (contents() reads it), the same values as gguf's reader."""
    path = make_gguf()
    r, stock = open_gguf(path), gguf.GGUFReader(path)
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        assert len(r.fields[key].data) == 1
        assert r.fields[key].contents() == stock.fields[key].contents()
    assert r.fields["tokenizer.ggml.tokens"].contents() == stock.fields["tokenizer.ggml.tokens"].contents()


def test_declared_nextn_without_nextn_tensors_is_not_mtp(make_gguf, tmp_path):
    # a file that declares nextn_predict_layers but whose last block has no nextn.* tensors
    path = make_gguf(arch="qwen35", n_layer=2, nextn=0)
    w = gguf.GGUFWriter(tmp_path / "declared.gguf", "qwen35")
    r = gguf.GGUFReader(path)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub)
    w.add_nextn_predict_layers(1)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    s = load_spec(tmp_path / "declared.gguf")
    assert s.nextn_predict_layers == 1 and len(s.mtp_blocks) == 1
    assert s.mtp_blocks[0].nextn == () and not s.has_mtp


@slow
def test_compat_smollm_draft_for_gemma_gives_the_numbers(gemma, smollm):
    c = check_draft_compatible(gemma, smollm)
    assert not c.ok
    assert "draft vocab (49152 tokens) differs from target (262144) by more than 128" in c.reason
    assert "draft vocab type BPE (gpt2) differs from target's SPM (llama)" in c.reason
    assert "draft BOS (add false, id 1) differs from target's (add true, id 2)" in c.reason
    assert c.reason.endswith("; use a draft from the same model family")
    assert c.reason.startswith("draft vocab")


@slow
def test_compat_model_with_itself(gemma, smollm):
    assert check_draft_compatible(gemma, gemma).ok
    assert check_draft_compatible(smollm, smollm).ok
    assert check_draft_compatible(smollm, smollm).reason is None


def _with_vocab(spec: ModelSpec, **kw) -> ModelSpec:
    return dataclasses.replace(spec, vocab=dataclasses.replace(spec.vocab, **kw))


@pytest.mark.parametrize(("change", "ok", "words"), [
    ({"size": 49152 + 128, "tokens": None}, True, None),              # 128 more: still compatible
    ({"size": 49152 + 129, "tokens": None}, False, "(49281 tokens) differs from target (49152) by more than 128"),
    ({"eos_id": 0}, True, None),                                      # add_eos false: the id is not compared
    ({"add_eos": True}, False, "draft EOS (add true, id 2) differs from target's (add false, id 2)"),
    ({"bos_id": 7}, True, None),                                      # add_bos false: the id is not compared
    ({"add_bos": True}, False, "draft BOS (add true, id 1)"),
    ({"model": "llama"}, False, "draft vocab type SPM (llama) differs from target's BPE (gpt2)"),
    ({"model": "gemma4"}, True, None),                                # gemma4 is BPE too, as in llama.cpp
    ({"tokens": "text@5"}, False, "draft token 5 is 'X' but target token 5 is '<file_sep>'"),
    ({"tokens": "text@4"}, True, None),                               # ids below 5 are not compared
])
def test_compat_rules(smollm, change, ok, words):
    v, change = smollm.vocab, dict(change)
    tokens = change.pop("tokens", v.tokens)
    if tokens is None:          # grow the vocabulary with new tokens at the end
        tokens = v.tokens + tuple(f"new{i}" for i in range(change["size"] - v.size))
    elif isinstance(tokens, str):
        i = int(tokens.split("@")[1])
        tokens = v.tokens[:i] + ("X",) + v.tokens[i + 1:]
    draft = _with_vocab(smollm, tokens=tokens, **change)
    c = check_draft_compatible(smollm, draft)
    assert c.ok is ok, c.reason
    if words:
        assert words in c.reason


def test_compat_without_vocab(smollm):
    c = check_draft_compatible(smollm, dataclasses.replace(smollm, vocab=None))
    assert not c.ok and "the draft has no vocabulary" in c.reason


def test_vocab_defaults_follow_llama_cpp(make_gguf, tmp_path):
    """Without bos/eos/add_bos keys, an SPM ('llama') vocab gets llama.cpp's defaults 1, 2, true."""
    src = gguf.GGUFReader(make_gguf())
    w = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    dropped = {gguf.Keys.Tokenizer.BOS_ID, gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.ADD_BOS}
    for f in src.fields.values():
        if f.name.startswith("GGUF.") or f.name in dropped or f.name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    v = load_spec(tmp_path / "bare.gguf").vocab
    assert isinstance(v, Vocab)
    assert (v.bos_id, v.eos_id, v.add_bos, v.add_eos) == (1, 2, True, False)


def test_mtp_block_nextn_uses_gguf_names():
    t = TensorInfo
    b = MTPBlock(7, (t("blk.7.nextn.eh_proj.weight", "F16", (2, 2), 8, 0),
                     t("blk.7.attn_q.weight", "F16", (2, 2), 8, 8),
                     t("blk.17.nextn.eh_proj.weight", "F16", (2, 2), 8, 16)))
    assert [x.name for x in b.nextn] == ["blk.7.nextn.eh_proj.weight"]
