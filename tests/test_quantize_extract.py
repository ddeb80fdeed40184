"""`specrun quantize` (llama.cpp's quantizer + MTP type policy) and `specrun extract-mtp`
(MTP-only and trunk-only GGUFs), checked by loading the results in llama.cpp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner

from specrun.cli.main import cli
from specrun.gguf_spec.errors import GGUFError
from specrun.gguf_spec.extract import ExtractError, NoMtpHeads, extract_mtp, extract_trunk
from specrun.gguf_spec.spec import load_spec
from specrun.gguf_spec.testmodel import TINY, Head, SynthConfig, write_test_model
from specrun.kernels.check_mtp import check_mtp
from specrun.kernels.quantize import QuantizeError, TensorOverride, parse_override, quantize, tensor_types
from specrun.kernels.testmodel import build_test_model


@pytest.fixture(scope="module")
def f32(tmp_path_factory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("q") / "exact-f32.gguf", TINY, "f32")


@pytest.fixture(scope="module")
def q4(tmp_path_factory) -> Path:
    return build_test_model(tmp_path_factory.mktemp("q") / "exact-q4_k_m.gguf", TINY, "q4_k_m")


def kv(path: Path) -> dict:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


# ---- quantize -------------------------------------------------------------------------------

def test_plain_q4_k_m_gives_the_mtp_block_more_bits_and_loses_exactness(f32, tmp_path):
    """mtp_type 'none' = llama.cpp's own mix: the last block (MTP) gets Q6_K ffn_down/attn_v, the
    trunk's stay Q4_K, token_embd Q4_K, so the copied head is no longer exact (MTP_NOTES §4.2)."""
    r = quantize(f32, tmp_path / "none.gguf", "q4_k_m", mtp_type="none")
    assert r.overrides == () and r.token_embd_type is None
    t = tensor_types(r.path)
    assert (t["blk.1.ffn_down.weight"], t["blk.2.ffn_down.weight"]) == ("q4_k", "q6_k")
    assert (t["blk.2.nextn.eh_proj.weight"], t["token_embd.weight"]) == ("q4_k", "q4_k")
    c = check_mtp(r.path, n_gen=16, vocab=True)
    assert 0.8 < c.vocab.rate < 1.0


def test_same_policy_keeps_the_copied_head_exact(f32, tmp_path):
    r = quantize(f32, tmp_path / "same.gguf", "q4_k_m", mtp_type="same")
    assert r.token_embd_type == "f16"
    assert set(r.overrides) == {TensorOverride(r"^blk\.2\.attn_v\.weight$", "q4_k"),
                                TensorOverride(r"^blk\.2\.ffn_down\.weight$", "q4_k"),
                                TensorOverride(r"\.nextn\.eh_proj\.", "f16")}
    t = tensor_types(r.path)
    assert all(t[f"blk.2.{x}.weight"] == t[f"blk.1.{x}.weight"] for x in ("ffn_down", "ffn_up", "attn_v"))
    assert not list(tmp_path.glob("*.tmp"))
    c = check_mtp(r.path, n_gen=16, vocab=True)
    assert c.vocab.rate == 1.0 and c.vocab.max_abs_dlogit == 0.0


def test_default_policy_keeps_mtp_block_at_q8_0(f32, tmp_path):
    r = quantize(f32, tmp_path / "d.gguf", "Q4_K_M")
    assert (r.ftype, r.mtp_type, r.token_embd_type) == ("q4_k_m", "q8_0", "q8_0")
    t = tensor_types(r.path)
    mtp = {n: ty for n, ty in t.items() if n.startswith("blk.2.") and not n.endswith("norm.weight")}
    assert mtp.pop("blk.2.nextn.eh_proj.weight") == "f16"
    assert set(mtp.values()) == {"q8_0"}
    assert t["blk.1.ffn_gate.weight"] == "q4_k" and t["token_embd.weight"] == "q8_0"
    assert kv(r.path)["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M


def test_user_override_wins_over_the_policy(f32, tmp_path):
    r = quantize(f32, tmp_path / "o.gguf", "q4_k_m", overrides=[parse_override(r"blk\.2\.ffn_up=q5_k")])
    t = tensor_types(r.path)
    assert t["blk.2.ffn_up.weight"] == "q5_k" and t["blk.2.ffn_gate.weight"] == "q8_0"


def test_unquantized_mix_ignores_the_policy(f32, tmp_path):
    r = quantize(f32, tmp_path / "h.gguf", "f16", mtp_type="q8_0")
    assert r.overrides == () and set(tensor_types(r.path).values()) == {"f16", "f32"}


def test_progress_reports_every_tensor(f32, tmp_path):
    seen = []
    quantize(f32, tmp_path / "p.gguf", "q8_0", on_progress=lambda *a: seen.append(a))
    n = len(gguf.GGUFReader(f32).tensors)
    assert [s[1] for s in seen] == list(range(1, n + 1)) and {s[2] for s in seen} == {n}
    assert {s[0] for s in seen} == {"quantize"} and seen[0][3] == "output.weight"   # llama.cpp sorts by block, name


@pytest.mark.parametrize("call, words", [
    (lambda src, dst: quantize(src, dst, "q4_k_x"), "unknown quantization type 'q4_k_x'; choose one of f32, f16"),
    (lambda src, dst: quantize(src, dst, "q4_k_m", mtp_type="q7"), "unknown MTP type"),
    (lambda src, dst: quantize(src, src, "q8_0"), "input and output are the same file"),
    (lambda src, dst: quantize(dst.with_name("missing.gguf"), dst, "q8_0"), "missing.gguf: no such file"),
    (lambda src, dst: parse_override("ffn_down"), "use PATTERN=TYPE"),
    (lambda src, dst: parse_override("ffn_(=q8_0"), "bad regex"),
    (lambda src, dst: parse_override("ffn_down=q9"), "unknown tensor type 'q9'"),
])
def test_quantize_rejects(f32, tmp_path, call, words):
    with pytest.raises(QuantizeError, match=words.replace("(", r"\(")):
        call(f32, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_requantizing_needs_the_flag(q4, tmp_path):
    with pytest.raises(QuantizeError, match=r"llama_model_quantize returned 1 .*requantizing from type q6_K is disabled"):
        quantize(q4, tmp_path / "r.gguf", "q8_0")
    assert not list(tmp_path.iterdir())                 # no partial output left behind
    r = quantize(q4, tmp_path / "r.gguf", "q8_0", allow_requantize=True)
    assert tensor_types(r.path)["blk.1.ffn_gate.weight"] == "q8_0"


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all" * 10)
    words = r"bad.gguf: not a GGUF file \(it starts with b'not ', not b'GGUF'\)$"
    with pytest.raises(GGUFError, match=words):
        quantize(bad, tmp_path / "o.gguf", "q8_0")
    with pytest.raises(GGUFError, match=words):
        extract_mtp(bad, tmp_path / "o.gguf")
    with pytest.raises(GGUFError, match=words):
        tensor_types(bad)


# ---- extract --------------------------------------------------------------------------------

def test_extract_mtp_only_file(q4, tmp_path):
    heads = extract_mtp(q4, tmp_path / "heads.gguf")
    names = {t.name for t in gguf.GGUFReader(heads.path).tensors}
    assert {n for n in names if not n.startswith("blk.")} == {"token_embd.weight", "output_norm.weight", "output.weight"}
    assert {n.split(".")[1] for n in names if n.startswith("blk.")} == {"2"}
    assert kv(heads.path) == kv(q4)                                  # metadata unchanged
    assert tensor_types(heads.path).items() <= tensor_types(q4).items()  # bytes copied, same types
    spec = load_spec(heads.path)
    assert spec.nextn_predict_layers == 1 and spec.has_mtp


def test_extract_trunk_only_file(q4, tmp_path):
    trunk = extract_trunk(q4, tmp_path / "trunk.gguf")
    meta = kv(trunk.path)
    assert meta["qwen35.block_count"] == 2 and "qwen35.nextn_predict_layers" not in meta
    assert not any(t.name.startswith("blk.2.") for t in gguf.GGUFReader(trunk.path).tensors)
    assert not load_spec(trunk.path).has_mtp
    with pytest.raises(NoMtpHeads, match="already trunk-only"):
        extract_trunk(trunk.path, tmp_path / "again.gguf")
    with pytest.raises(NoMtpHeads, match="has no MTP heads"):
        extract_mtp(trunk.path, tmp_path / "none.gguf")


def test_per_layer_arrays_are_cut_for_the_trunk(tmp_path):
    src = write_test_model(tmp_path / "m.gguf", TINY, "f16")
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(tmp_path / "arr.gguf", "qwen35")      # same model + recurrent_layers array
    for f in r.fields.values():
        if f.name != "general.architecture" and not f.name.startswith("GGUF."):
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    w.add_array("qwen35.attention.recurrent_layers", [True, False, False])
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = extract_trunk(tmp_path / "arr.gguf", tmp_path / "trunk.gguf")
    assert kv(out.path)["qwen35.attention.recurrent_layers"] == [True, False]
    assert kv(out.path)["qwen35.rope.dimension_sections"] == [11, 11, 10, 0]


@pytest.mark.parametrize("head", ["exact", "noisy:0.3"])
def test_trunk_plus_heads_equals_the_full_model_in_llama_cpp(tmp_path, head):
    """llama.cpp loads the MTP-only file (trunk tensors absent) with load_mtp, and an MTP context
    on it, fed by a target context on the trunk-only file, drafts exactly as the full model."""
    full = build_test_model(tmp_path / "full.gguf", SynthConfig(head=Head.parse(head)), "q4_k_m")
    heads = extract_mtp(full, tmp_path / "heads.gguf").path
    trunk = extract_trunk(full, tmp_path / "trunk.gguf").path
    a = check_mtp(full, n_gen=24, vocab=True)
    b = check_mtp(trunk, heads, n_gen=24, vocab=True)
    c = check_mtp(full, heads, n_gen=24, vocab=True)        # full model as target, separate heads
    assert a.tokens == b.tokens == c.tokens
    assert a.greedy == b.greedy == c.greedy and a.vocab == b.vocab == c.vocab
    if head == "exact":
        assert a.vocab.rate == 1.0


def test_extract_never_overwrites_its_input(q4, tmp_path):
    copy = tmp_path / "m.gguf"
    copy.write_bytes(q4.read_bytes())
    for extract in (extract_mtp, extract_trunk):
        with pytest.raises(ExtractError, match="is the input file"):
            extract(copy, tmp_path / "." / "m.gguf")
    assert copy.read_bytes() == q4.read_bytes()


SPECRUN = str(Path(sys.executable).with_name("specrun"))

# another name of the input: the writers compare files, not names (a hard link as the output
# truncated the input; quantize, which maps the input, died of SIGBUS)
ALIASES = {"hard link": os.link, "symbolic link": lambda src, dst: os.symlink(src.resolve(), dst)}
SAME_FILE = {
    "quantize {m} {out} q8_0 -t 2": "Error: input and output are the same file ({m}, {out}); choose another output name",
    "extract-mtp {m} -o {out}": "Error: output {out} is the input file; choose another name",
    "extract-mtp {m} -o {out} --trunk-only": "Error: output {out} is the input file; choose another name",
    "extract-mtp {m} -o {out} --quant q8_0 -t 2": "Error: output {out} is the input file; choose another name",
}


@pytest.mark.parametrize("alias", list(ALIASES))
@pytest.mark.parametrize("command", list(SAME_FILE))
def test_an_alias_of_the_input_is_refused_as_the_output(f32, tmp_path, command, alias):
    m, out = tmp_path / "m.gguf", tmp_path / "alias.gguf"
    m.write_bytes(f32.read_bytes())
    ALIASES[alias](m, out)
    args = [a.format(m=m, out=out) for a in command.split()]
    r = subprocess.run([SPECRUN, *args], capture_output=True, text=True, timeout=120)   # a crash is a failure here
    assert (r.returncode, r.stdout) == (1, ""), r.stderr
    assert r.stderr.strip().splitlines() == [SAME_FILE[command].format(m=m, out=out)]
    assert m.read_bytes() == f32.read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias.gguf", "m.gguf"]


def test_check_refuses_a_file_without_heads(q4, tmp_path):
    trunk = extract_trunk(q4, tmp_path / "trunk.gguf").path
    with pytest.raises(QuantizeError, match="has no MTP"):
        check_mtp(trunk, n_gen=4)
    heads = extract_mtp(q4, tmp_path / "heads.gguf").path
    with pytest.raises(QuantizeError, match="has no trunk"):          # would crash llama_decode
        check_mtp(heads, n_gen=4)


# ---- CLI ------------------------------------------------------------------------------------

def run(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_cli_quantize(f32, tmp_path):
    out = tmp_path / "q.gguf"
    r = run("quantize", str(f32), str(out), "Q4_K_M", "--mtp-type", "same", "--tensor-type", "output=q8_0")
    assert r.exit_code == 0, r.output
    assert r.stdout == ""
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"wrote {out} (9.0 MiB -> ") and ", q4_k_m, " in line
    assert r"overrides: output=q8_0, ^blk\.2\.attn_v\.weight$=q4_k" in line and line.endswith("; token_embd f16")
    assert tensor_types(out)["output.weight"] == "q8_0"


@pytest.mark.parametrize("args, code, last", [
    (["Q9_K"], 2, "Error: Invalid value for 'FTYPE': 'Q9_K' is not one of"),
    (["q8_0", "--mtp-type", "q7"], 2, "Error: Invalid value for '--mtp-type': 'q7' is not one of same, none, f32"),
    (["q8_0", "--tensor-type", "x"], 2, "Error: Invalid value for '--tensor-type': bad tensor override 'x'"),
])
def test_cli_quantize_bad_arguments(f32, tmp_path, args, code, last):
    r = run("quantize", str(f32), str(tmp_path / "q.gguf"), *args)
    assert r.exit_code == code
    assert r.stderr.strip().splitlines()[-1].startswith(last)
    assert not list(tmp_path.iterdir())


def test_cli_quantize_requantize_error_is_one_line(q4, tmp_path):
    r = run("quantize", str(q4), str(tmp_path / "q.gguf"), "q8_0")
    assert r.exit_code == 1
    assert r.stderr.strip().splitlines() == [
        f"Error: llama_model_quantize returned 1 for {q4} -> q8_0: requantizing from type q6_K is disabled; its "
        "tensors are already quantized, and quantizing them again loses more quality than quantizing the "
        "F16/BF16/F32 original: start from that, or pass --allow-requantize"]


def test_cli_extract(q4, tmp_path):
    heads, trunk = tmp_path / "heads.gguf", tmp_path / "trunk.gguf"
    r = run("extract-mtp", str(q4), "-o", str(heads))
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith(f"wrote {heads} (MTP heads: blocks 2..2 + globals, 17 tensors, ")
    r = run("extract-mtp", str(q4), "-o", str(trunk), "--trunk-only")
    assert r.exit_code == 0, r.output
    assert r.stderr.startswith(f"wrote {trunk} (trunk: blocks 0..1, 28 tensors, ")
    r = run("extract-mtp", str(trunk), "-o", str(tmp_path / "x.gguf"))
    assert r.exit_code == 1
    assert r.stderr.strip() == (f"Error: {trunk} has no MTP heads (qwen35.nextn_predict_layers is 0 or absent)")
    r = run("extract-mtp", str(heads), "-o", str(tmp_path / "x.gguf"))
    assert r.exit_code == 1 and "already an MTP-only file" in r.stderr


def test_cli_extract_requantized_heads(q4, tmp_path):
    heads = tmp_path / "heads-q8.gguf"
    r = run("extract-mtp", str(q4), "-o", str(heads), "--quant", "q8_0")
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads-q8.gguf"]         # no temp file left
    t = tensor_types(heads)
    assert t["blk.2.ffn_down.weight"] == "q8_0" and t["blk.2.nextn.eh_proj.weight"] == "q8_0"
    trunk = extract_trunk(q4, tmp_path / "trunk.gguf").path
    c = check_mtp(trunk, heads, n_gen=16, vocab=True)
    assert c.vocab.rate > 0.8
