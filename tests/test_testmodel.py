"""Synthetic qwen35 + MTP models (gguf_spec.testmodel, kernels.testmodel.build_test_model,
`specrun make-test-model`): every head x quant loads in llama.cpp and drafts through a real MTP
context; the exact head agrees with the target at every position; the writer is deterministic."""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import llama_cpp as L
import numpy as np
import pytest
from click.testing import CliRunner

from specrun.cli.main import cli
from specrun.gguf_spec.spec import load_spec
from specrun.gguf_spec.testmodel import (
    REALISTIC,
    TINY,
    Head,
    SynthConfig,
    SynthConfigError,
    build_tensors,
    tokenizer_for,
    write_test_model,
)
from specrun.kernels.check_mtp import check_mtp
from specrun.kernels.quantize import QuantizeError, tensor_types
from specrun.kernels.testmodel import build_test_model

HEADS = ("exact", "noisy:0.1", "random")
QUANTS = ("f32", "f16", "q8_0", "q4_k_m")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Every head x quant of the tiny shape (about 0.1 s each)."""
    d = tmp_path_factory.mktemp("synth")
    return {(h, q): build_test_model(d / f"{h.replace(':', '')}-{q}.gguf", SynthConfig(head=Head.parse(h)), q)
            for h in HEADS for q in QUANTS}


# ---- arguments ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, head", [
    ("exact", Head("exact")), ("random", Head("random")), ("noisy:0.1", Head("noisy", 0.1)),
    (" Noisy:2 ", Head("noisy", 2.0)),
])
def test_head_parse(text, head):
    assert Head.parse(text) == head
    assert Head.parse(str(head)) == head


@pytest.mark.parametrize("text, words", [
    ("noisy", "unknown head"), ("noisy:", "SIGMA must be a number > 0"), ("noisy:0", "> 0"),
    ("noisy:-0.1", "> 0"), ("noisy:nan", "> 0"), ("noisy:inf", "> 0"), ("noisy:abc", "> 0"),
    ("copy", "unknown head 'copy'"),
])
def test_head_parse_rejects(text, words):
    with pytest.raises(SynthConfigError, match=words):
        Head.parse(text)


@pytest.mark.parametrize("kwargs, words", [
    ({"n_embd": 100}, "n_embd 100 is not a positive multiple of the head size 64; try 64"),
    ({"n_embd": 0}, "not a positive multiple"),
    ({"trunk_layers": 0}, r"trunk layers must be >= 1 \(got 0\)"),
    ({"n_vocab": 100}, r"vocab 100 is out of range \[257, 16384\]"),
    ({"n_vocab": 20000}, "out of range"),
    ({"n_ff": 0}, "n_ff must be >= 1"),
    ({"seed": -1}, "seed"),
])
def test_config_rejects(kwargs, words):
    with pytest.raises(SynthConfigError, match=words):
        SynthConfig(**kwargs)


def test_writer_rejects_quantized_dtype(tmp_path):
    with pytest.raises(SynthConfigError, match="llama.cpp's quantizer"):
        write_test_model(tmp_path / "m.gguf", TINY, "q8_0")
    with pytest.raises(QuantizeError, match="unknown test-model quant 'q5_0'"):
        build_test_model(tmp_path / "m.gguf", TINY, "q5_0")
    with pytest.raises(QuantizeError, match="multiples of 256"):
        build_test_model(tmp_path / "m.gguf", SynthConfig(n_embd=320), "q4_k_m")
    assert not list(tmp_path.iterdir())


# ---- the writer -----------------------------------------------------------------------------

def test_writer_is_deterministic(tmp_path):
    a = write_test_model(tmp_path / "a.gguf", TINY, "f16")
    b = write_test_model(tmp_path / "b.gguf", TINY, "f16")
    c = write_test_model(tmp_path / "c.gguf", SynthConfig(seed=1), "f16")
    assert sha256(a) == sha256(b) != sha256(c)
    qa = build_test_model(tmp_path / "qa.gguf", TINY, "q4_k_m")
    qb = build_test_model(tmp_path / "qb.gguf", TINY, "q4_k_m")
    assert sha256(qa) == sha256(qb)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf", "qa.gguf", "qb.gguf"]


def test_heads_share_the_trunk():
    t = {h: build_tensors(SynthConfig(head=Head.parse(h))) for h in HEADS}
    trunk = [n for n in t["exact"] if not n.startswith("blk.2.")]
    for h in HEADS[1:]:
        assert all(np.array_equal(t["exact"][n], t[h][n]) for n in trunk)
    ex = t["exact"]
    assert np.array_equal(ex["blk.2.ffn_down.weight"], ex["blk.1.ffn_down.weight"])
    assert np.array_equal(ex["blk.2.nextn.eh_proj.weight"][:, :256], np.eye(256))
    assert not ex["blk.2.nextn.eh_proj.weight"][:, 256:].any()
    assert not ex["blk.0.ssm_out.weight"].any() and not ex["blk.1.attn_output.weight"].any()
    rms = np.sqrt((ex["token_embd.weight"] ** 2).mean(axis=1))
    assert np.allclose(rms, 1.0, atol=1e-5)


def test_file_layout_and_spec(models):
    path = models[("exact", "f16")]
    r = gguf.GGUFReader(path)
    kv = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert kv["general.architecture"] == "qwen35"
    assert kv["qwen35.block_count"] == 3 and kv["qwen35.nextn_predict_layers"] == 1
    assert kv["qwen35.rope.dimension_sections"] == [11, 11, 10, 0]
    assert kv["qwen35.full_attention_interval"] == 2
    for key in ("conv_kernel", "state_size", "group_count", "time_step_rank", "inner_size"):
        assert f"qwen35.ssm.{key}" in kv
    assert len(kv["tokenizer.ggml.tokens"]) == 512 and len(kv["tokenizer.ggml.merges"]) == 255
    assert kv["tokenizer.ggml.tokens"][511] == "<|endoftext|>" and kv["tokenizer.ggml.eos_token_id"] == 511
    names = {t.name for t in r.tensors}
    assert "blk.0.ssm_out.weight" in names and "blk.1.attn_q.weight" in names      # GDN, then attention
    assert {"blk.2.nextn.eh_proj.weight", "blk.2.nextn.enorm.weight", "blk.2.nextn.hnorm.weight"} <= names
    spec = load_spec(path)
    assert spec.nextn_predict_layers == 1 and spec.has_mtp


def test_realistic_shape_layout(tmp_path):
    """24 trunk layers: full_attention_interval 4 (18 GDN + 6 attention layers), MTP block 24."""
    assert (REALISTIC.trunk_layers, REALISTIC.n_embd, REALISTIC.n_ff) == (24, 512, 2048)
    assert [REALISTIC.is_recurrent(i) for i in range(8)] == [True, True, True, False] * 2
    assert sum(REALISTIC.is_recurrent(i) for i in range(24)) == 18 and not REALISTIC.is_recurrent(24)


@pytest.mark.parametrize("n_vocab", [257, 512, 1000, 16384])
def test_tokenizer_truncation(n_vocab):
    tokens, types, merges = tokenizer_for(n_vocab)
    assert len(tokens) == len(types) == n_vocab and len(merges) == n_vocab - 257
    index = {t: i for i, t in enumerate(tokens)}
    for i, m in enumerate(merges):                     # every merge makes a token that exists
        a, b = m.split(" ")
        assert index[a + b] == 256 + i
    assert types[-1] == gguf.TokenType.CONTROL and tokens[-1] == "<|endoftext|>"


def test_tokenizer_round_trip_in_llama_cpp(models):
    path = models[("exact", "f16")]
    mp = L.llama_model_default_params()
    mp.vocab_only = True
    model = L.llama_model_load_from_file(str(path).encode(), mp)
    assert model
    try:
        vocab = L.llama_model_get_vocab(model)
        text = b"def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)"
        buf = (L.llama_token * 256)()
        n = L.llama_tokenize(vocab, text, len(text), buf, 256, False, False)
        assert 0 < n < len(text)                        # merges do apply
        ids = list(buf[:n])
        assert max(ids) < 512
        out = ctypes_detok(vocab, ids)
        assert out == text
    finally:
        L.llama_model_free(model)


def ctypes_detok(vocab, ids) -> bytes:
    import ctypes
    arr = (L.llama_token * len(ids))(*ids)
    buf = ctypes.create_string_buffer(1024)
    n = L.llama_detokenize(vocab, arr, len(ids), buf, 1024, False, False)
    assert n >= 0
    return buf.raw[:n]


# ---- llama.cpp: every head x quant drafts -----------------------------------------------------

@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("head", HEADS)
def test_every_head_and_quant_drafts_in_llama_cpp(models, head, quant):
    r = check_mtp(models[(head, quant)], n_gen=32, vocab=True)
    assert r.greedy.n == 32 and r.vocab.n == 511
    if head == "exact":
        assert r.greedy.rate == 1.0 and r.vocab.rate == 1.0, r
    elif head == "random":
        assert r.vocab.rate < 0.05, r
    else:
        assert 0.5 < r.vocab.rate < 0.95, r


@pytest.mark.parametrize("quant", ["f16", "q4_k_m"])
def test_exact_head_matches_target_logits(models, quant):
    r = check_mtp(models[("exact", quant)], n_gen=48, vocab=True)
    assert r.greedy.n_agree == r.greedy.n == 48
    assert r.greedy.max_abs_dlogit == 0.0 and r.vocab.max_abs_dlogit == 0.0


def test_q4_k_m_is_llama_cpp_q4_k_m(models):
    """Q4_K_M from llama.cpp's own mix; the MTP block matched to the trunk, eh_proj and token_embd F16."""
    types = tensor_types(models[("exact", "q4_k_m")])
    assert types["blk.1.ffn_gate.weight"] == "q4_k" and types["output.weight"] == "q6_k"
    for t in ("ffn_gate", "ffn_up", "ffn_down", "attn_q", "attn_k", "attn_v", "attn_output"):
        assert types[f"blk.2.{t}.weight"] == types[f"blk.1.{t}.weight"], t
    assert types["blk.2.nextn.eh_proj.weight"] == "f16" and types["token_embd.weight"] == "f16"
    assert set(tensor_types(models[("exact", "q8_0")]).values()) == {"q8_0", "f16", "f32"}


@pytest.mark.slow
def test_realistic_shape_exact_in_llama_cpp(tmp_path):
    path = build_test_model(tmp_path / "r.gguf", REALISTIC, "f16")
    assert 200e6 < path.stat().st_size < 240e6
    r = check_mtp(path, n_gen=8)
    assert r.greedy.rate == 1.0 and r.greedy.max_abs_dlogit == 0.0


# ---- CLI ------------------------------------------------------------------------------------

def invoke(*args: str):
    return CliRunner().invoke(cli, ["make-test-model", *args], catch_exceptions=False)


def test_cli_writes_tiny_model_and_checks(tmp_path):
    out = tmp_path / "m.gguf"
    r = invoke(str(out), "--shape", "tiny", "--head", "exact", "--quant", "q4_k_m", "--check")
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith(f"wrote {out} (") and "qwen35 q4_k_m, 2 trunk + 1 MTP block" in lines[0]
    assert lines[1].startswith("greedy MTP acceptance: 100.0% on the greedy sequence (64/64), "
                               "100.0% over the vocabulary (511/511)")
    assert sha256(out) == sha256(build_test_model(tmp_path / "ref.gguf", TINY, "q4_k_m"))


def test_cli_flags_override_the_shape(tmp_path):
    out = tmp_path / "m.gguf"
    r = invoke(str(out), "--shape", "tiny", "--trunk-layers", "4", "--n-embd", "128", "--n-ff", "256",
               "--vocab", "300", "--seed", "7", "--head", "noisy:0.2", "--quant", "f32")
    assert r.exit_code == 0, r.output
    kv = {k: f.contents() for k, f in gguf.GGUFReader(out).fields.items() if k.startswith("qwen35.")}
    assert (kv["qwen35.block_count"], kv["qwen35.embedding_length"], kv["qwen35.feed_forward_length"]) == (5, 128, 256)
    assert sha256(out) == sha256(write_test_model(
        tmp_path / "ref.gguf", SynthConfig(Head("noisy", 0.2), 4, 128, 256, 300, 7), "f32"))


@pytest.mark.parametrize("args, code, message", [
    (["--n-embd", "100"], 1, "Error: n_embd 100 is not a positive multiple of the head size 64; try 64"),
    (["--trunk-layers", "0"], 1, "Error: trunk layers must be >= 1 (got 0)"),
    (["--vocab", "99999"], 1, "Error: vocab 99999 is out of range [257, 16384]"),
    (["--shape", "tiny", "--n-embd", "320", "--quant", "q4_k_m"], 1,
     "Error: q4_k_m needs n_embd and n_ff to be multiples of 256 (K-quant super-blocks); got n_embd 320, n_ff 512"),
    (["--quant", "q3"], 2, "Error: Invalid value for '--quant': 'q3' is not one of 'f32', 'f16', 'q8_0', 'q4_k_m'."),
    (["--head", "noisy:-1"], 2,
     "Error: Invalid value for '--head': bad noise in head 'noisy:-1': SIGMA must be a number > 0, e.g. noisy:0.1"),
    (["--head", "noisy"], 2, "Error: Invalid value for '--head': unknown head 'noisy'; use exact, random or "
                             "noisy:SIGMA (e.g. noisy:0.1)"),
])
def test_cli_bad_arguments(tmp_path, args, code, message):
    out = tmp_path / "m.gguf"
    r = invoke(str(out), *args)
    assert r.exit_code == code, r.output
    assert r.stderr.strip().splitlines()[-1] == message
    assert not out.exists() and not list(tmp_path.iterdir())


def test_cli_eagle3_target_and_draft_must_differ(tmp_path):
    out = tmp_path / "m.gguf"
    r = invoke(str(out), "--shape", "tiny", "--eagle3", str(tmp_path / "." / "m.gguf"))
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().splitlines() == [f"Error: the target and the draft are the same file ({out}); give two names"]
    assert not list(tmp_path.iterdir())
