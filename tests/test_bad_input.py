"""Bad files: every one gives GGUFError with one line naming the file (and `specrun inspect`
exits 1 with that line on stderr), never a traceback, a hang or gigabytes of memory."""

from __future__ import annotations

import errno
import os
import stat
import struct
import subprocess
import sys
import tracemalloc
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import rewrite_gguf, write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specrun.cli.main import cli
from specrun.gguf_spec.errors import GGUFError
from specrun.gguf_spec.extract import ExtractError, NoMtpHeads, extract_mtp, extract_trunk
from specrun.gguf_spec.spec import ModelSpec, load_spec
from specrun.gguf_spec.testmodel import TINY, write_test_model

STRING, ARRAY, UINT32, INT32, FLOAT32 = 8, 9, 4, 5, 6


def header(n_tensors: int = 0, n_kv: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def gstr(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def kv_str(key: bytes, val: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", STRING) + gstr(val)


def kv_u32(key: bytes, val: int) -> bytes:
    return gstr(key) + struct.pack("<II", UINT32, val)


def kv_i32(key: bytes, val: int) -> bytes:
    return gstr(key) + struct.pack("<Ii", INT32, val)


def kv_f32(key: bytes, val: float) -> bytes:
    return gstr(key) + struct.pack("<If", FLOAT32, val)


ARCH = kv_str(b"general.architecture", b"llama")
BLOCKS = kv_u32(b"llama.block_count", 2)


def hparams(*kvs: bytes) -> bytes:
    """A llama file's metadata: its architecture, 2 blocks, and kvs."""
    return header(n_kv=2 + len(kvs)) + ARCH + BLOCKS + b"".join(kvs) + b"\0" * 32


def tensor_info(name: bytes, dims: list[int], ggml_type: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return gstr(name) + struct.pack("<I", n) + b"".join(struct.pack("<Q", d) for d in dims) + \
        struct.pack("<IQ", ggml_type, offset)


def tiny_bytes(tmp_path: Path) -> bytes:
    return write_gguf(tmp_path / "src.gguf").read_bytes()


# name -> (file contents from tmp_path, or None for "no file"; words the message must hold)
CASES = {
    "missing": (None, "no such file"),
    "directory": ("dir", "is a directory, not a GGUF file"),
    "empty": (lambda p: b"", "is empty, not a GGUF file"),
    "text": (lambda p: b"hello, this is not a model\n" * 4, "not a GGUF file (it starts with b'hell'"),
    "short header": (lambda p: b"GGUF\x03\x00\x00", "truncated GGUF: 7 bytes, shorter than the 24-byte header"),
    "version 1": (lambda p: header(version=1) + b"\0" * 64, "GGUF version 1 is not supported"),
    "version 99": (lambda p: header(version=99) + b"\0" * 64, "GGUF version 99 is not supported"),
    "big-endian": (lambda p: b"GGUF" + struct.pack(">IQQ", 3, 0, 1) + b"\0" * 64,
                   "is a big-endian GGUF, and llama.cpp on this little-endian machine reads only little-endian"),
    "tensor count 2^40": (lambda p: header(n_tensors=2**40, n_kv=1) + ARCH,
                          "the header claims 1099511627776 tensors and 1 metadata entries, which cannot fit in"),
    "kv count 2^40": (lambda p: header(n_kv=2**40) + ARCH, "claims 1099511627776 metadata entries, which cannot fit in"),
    "string length 2^60": (lambda p: header(n_kv=1) + gstr(b"general.architecture") +
                           struct.pack("<IQ", STRING, 2**60) + b"llama" * 20,
                           "truncated or corrupt GGUF: a read of 1152921504606846976 x 1 bytes at offset"),
    "key length 2^60": (lambda p: header(n_kv=1) + struct.pack("<Q", 2**60) + b"x" * 64,
                        "truncated or corrupt GGUF: a read of 1152921504606846976 x 1 bytes"),
    # the stock GGUFReader loops forever on this one: empty reads past the end never advance
    "u32 array length 2^60": (lambda p: header(n_kv=2) + ARCH + gstr(b"tokenizer.ggml.token_type") +
                              struct.pack("<IIQ", ARRAY, UINT32, 2**60) + b"\0" * 64,
                              "claims 1152921504606846976 elements but only 64 bytes follow"),
    "string array length 2^40": (lambda p: header(n_kv=2) + ARCH + gstr(b"tokenizer.ggml.tokens") +
                                 struct.pack("<IIQ", ARRAY, STRING, 2**40) + gstr(b"a") * 8,
                                 "claims 1099511627776 elements but only 72 bytes follow"),
    "unknown value type": (lambda p: header(n_kv=1) + gstr(b"general.x") + struct.pack("<II", 77, 0) + b"\0" * 32,
                           "unknown metadata value type 77 at offset 45"),
    "unknown array type": (lambda p: header(n_kv=1) + gstr(b"general.x") + struct.pack("<IIQ", ARRAY, 78, 1) +
                           b"\0" * 32, "unknown metadata value type 78 in the array at offset 45"),
    "n_dims 1000": (lambda p: header(n_tensors=1, n_kv=1) + ARCH + tensor_info(b"w", [1] * 1000) + b"\0" * 64,
                    "tensor 'w' has 1000 dimensions (at most 4)"),
    "n_dims 2^32-1": (lambda p: header(n_tensors=1, n_kv=1) + ARCH + tensor_info(b"w", [4], n_dims=2**32 - 1) +
                      b"\0" * 64, "truncated or corrupt GGUF: a read of 4294967295 x 8 bytes"),
    "unknown ggml type": (lambda p: header(n_tensors=1, n_kv=1) + ARCH + tensor_info(b"w", [4], 999) + b"\0" * 64,
                          "tensor 'w' has unknown ggml type 999"),
    "bad row size": (lambda p: header(n_tensors=1, n_kv=1) + ARCH + tensor_info(b"w", [33], 8) + b"\0" * 64,
                     "tensor 'w' of type Q8_0 has a row of 33 elements, not a multiple of its block size 32"),
    "tensor data past EOF": (lambda p: header(n_tensors=1, n_kv=1) + ARCH + tensor_info(b"w", [2**20]) + b"\0" * 64,
                             "tensor 'w' data (4194304 bytes at offset 128) runs past the end of the file "
                             "(166 bytes); the file is truncated, download it again"),
    "tensor offset 2^63": (lambda p: header(n_tensors=1, n_kv=1) + ARCH + tensor_info(b"w", [4], 0, 2**63) +
                           b"\0" * 64, "runs past the end of the file"),
    "tensor dims overflow": (lambda p: header(n_tensors=1, n_kv=1) + ARCH + tensor_info(b"w", [2**40, 2**40, 2**40]) +
                             b"\0" * 64, "runs past the end of the file"),
    "truncated in tensor data": (lambda p: tiny_bytes(p)[:-100], "the file is truncated, download it again"),
    "truncated in the header's reach": (lambda p: tiny_bytes(p)[:300], "truncated or corrupt GGUF: the header claims "
                                        "20 tensors and 19 metadata entries, which cannot fit in 300 bytes"),
    "truncated in metadata": (lambda p: tiny_bytes(p)[:1000], "truncated or corrupt GGUF: an array at offset 986 "
                              "claims 32 elements but only 2 bytes follow"),
    "truncated in tensor infos": (lambda p: tiny_bytes(p)[:2000], "truncated or corrupt GGUF: a read of"),
    "duplicate key": (lambda p: header(n_kv=2) + ARCH + ARCH, "corrupt GGUF (KeyError: 'Duplicate general.architecture"),
    "bad alignment": (lambda p: header(n_kv=2) + ARCH + kv_u32(b"general.alignment", 3) + b"\0" * 32,
                      "Invalid alignment: must be a non-zero power of two"),
    "key not UTF-8": (lambda p: header(n_kv=1) + kv_str(b"\xff\xfe", b"x") + b"\0" * 32,
                      "corrupt GGUF (UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff"),
    "no architecture": (lambda p: header() + b"\0" * 32,
                        "no general.architecture in the metadata; this is not a model file"),
    "block_count of the wrong type": (lambda p: header(n_kv=2) + ARCH + kv_str(b"llama.block_count", b"thirty"),
                                      "metadata llama.block_count has type STRING, expected int"),
    # what llama.cpp checks with GGML_ASSERT (the process aborts) while loading or at the first token
    "block_count 0": (lambda p: header(n_kv=2) + ARCH + kv_u32(b"llama.block_count", 0),
                      "llama.block_count is 0; llama.cpp loads 1 to 512 blocks (it aborts the process"),
    "block_count 2^32-1": (lambda p: header(n_kv=2) + ARCH + kv_u32(b"llama.block_count", 2**32 - 1),
                           "llama.block_count is 4294967295; llama.cpp loads 1 to 512 blocks"),
    "block_count -1": (lambda p: header(n_kv=2) + ARCH + kv_i32(b"llama.block_count", -1),
                       "llama.block_count is -1; llama.cpp loads 1 to 512 blocks"),
    "rms epsilon NaN": (lambda p: hparams(kv_f32(b"llama.attention.layer_norm_rms_epsilon", float("nan"))),
                        "llama.attention.layer_norm_rms_epsilon is nan; llama.cpp needs a finite number >= 0"),
    "norm epsilon -1": (lambda p: hparams(kv_f32(b"llama.attention.layer_norm_epsilon", -1.0)),
                        "llama.attention.layer_norm_epsilon is -1.0; llama.cpp needs a finite number >= 0"),
    "epsilon as text": (lambda p: hparams(kv_str(b"llama.attention.layer_norm_rms_epsilon", b"1e-6")),
                        "metadata llama.attention.layer_norm_rms_epsilon has type STRING, expected a number"),
    "rope base 0": (lambda p: hparams(kv_f32(b"llama.rope.freq_base", 0.0)),
                    "llama.rope.freq_base is 0.0; llama.cpp needs a finite number > 0 (every logit is NaN"),
    "2000 experts": (lambda p: hparams(kv_u32(b"llama.expert_count", 2000), kv_u32(b"llama.expert_used_count", 2)),
                     "llama.expert_count is 2000; llama.cpp needs 0 to 1024 experts"),
    "more experts used than there are": (lambda p: hparams(kv_u32(b"llama.expert_count", 8),
                                                           kv_u32(b"llama.expert_used_count", 9)),
                                         "llama.expert_used_count is 9; llama.cpp needs 1 to llama.expert_count (8)"),
    "experts used without experts": (lambda p: hparams(kv_u32(b"llama.expert_used_count", 2)),
                                     "llama.expert_used_count is 2; llama.cpp needs 0 without experts"),
    "named pipe": ("fifo", "is a named pipe, not a GGUF file; give the path of a .gguf file"),
    "newline in a name": (lambda p: header(n_tensors=1, n_kv=1) + ARCH + tensor_info(b"a\nb", [4], 999) + b"\0" * 64,
                          "tensor 'a b' has unknown ggml type 999"),
}


def make_case(tmp_path: Path, name: str) -> Path:
    content, _ = CASES[name]
    path = tmp_path / "bad.gguf"
    if content == "dir":
        path.mkdir()
    elif content == "fifo":
        os.mkfifo(path)
    elif content is not None:
        path.write_bytes(content(tmp_path))
    return path


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(CASES))
def test_load_spec_raises_one_line(tmp_path, name):
    path = make_case(tmp_path, name)
    with pytest.raises(GGUFError) as e:     # a hang is caught by the timeout above
        load_spec(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: ")
    assert "\n" not in msg
    assert CASES[name][1] in msg


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(CASES))
def test_inspect_exits_1_with_one_line(tmp_path, name):
    path = make_case(tmp_path, name)
    r = CliRunner().invoke(cli, ["inspect", str(path)])
    assert r.exit_code == 1, r.output
    assert isinstance(r.exception, SystemExit)          # not a traceback
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"Error: {path}: ") and CASES[name][1] in lines[0]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(CASES))
def test_extract_gives_the_same_line_as_load_spec(tmp_path, name):
    """extract reads through the same bounded reader and layout check as load_spec."""
    path = make_case(tmp_path, name)
    with pytest.raises(GGUFError) as want:
        load_spec(path)
    for extract in (extract_mtp, extract_trunk):
        with pytest.raises(GGUFError) as got:
            extract(path, tmp_path / "out.gguf")
        assert str(got.value) == str(want.value)
    assert not (tmp_path / "out.gguf").exists()


# ---- nextn_predict_layers: llama.cpp's bound 0 <= nextn <= block_count, checked in one place ----

def test_nextn_past_block_count_is_one_line_from_load_spec_extract_and_inspect(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", arch="qwen35", n_layer=3, nextn=4)
    want = (f"{path}: qwen35.nextn_predict_layers is 4 but qwen35.block_count is 3; llama.cpp needs "
            "0 <= qwen35.nextn_predict_layers <= qwen35.block_count (the MTP blocks are the last ones); "
            "convert the model again with a current llama.cpp")
    for read in (load_spec, lambda p: extract_mtp(p, tmp_path / "h.gguf"),
                 lambda p: extract_trunk(p, tmp_path / "t.gguf")):
        with pytest.raises(GGUFError) as e:
            read(path)
        assert str(e.value) == want
    for args in (["inspect", str(path)], ["extract-mtp", str(path), "-o", str(tmp_path / "h.gguf")]):
        r = CliRunner().invoke(cli, args)
        assert (r.exit_code, r.stdout, r.stderr) == (1, "", f"Error: {want}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_nextn_equal_to_block_count_is_all_mtp_blocks_and_no_trunk(tmp_path):
    """llama.cpp allows it (a model made only of NextN blocks); there is nothing to split."""
    path = write_gguf(tmp_path / "m.gguf", arch="qwen35", n_layer=2, nextn=2)
    s = load_spec(path)
    assert [b.index for b in s.mtp_blocks] == [0, 1] and s.has_mtp and not s.has_trunk
    with pytest.raises(NoMtpHeads, match=r"m.gguf is already an MTP-only file \(it has no trunk tensors\)$"):
        extract_mtp(path, tmp_path / "h.gguf")
    with pytest.raises(ExtractError, match="m.gguf is an MTP-only file .*; there is no trunk to extract$"):
        extract_trunk(path, tmp_path / "t.gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]


def test_unreadable_path(tmp_path):
    path = tmp_path / ("x" * 300 + ".gguf")                # stat fails with ENAMETOOLONG, even for root
    with pytest.raises(GGUFError, match=r"xxx.gguf: cannot read it \(File name too long\)$"):
        load_spec(path)


# ---- outputs that cannot be written: one line naming the path, exit 1, nothing left behind ----

NO_FOLDER = "No such file or directory (create the folder first)"
FOLDER_IS_A_FILE = "Not a directory (a folder on the path is a file; choose another path)"
FULL = "No space left on device (free some space or choose another disk)"
NOT_A_FILE = "not a regular file (give a file name)"      # llama.cpp's quantizer seeks back in its output

# command ({m}: a qwen35 + MTP model, {out}: the bad output, {dir}: the test's folder), what {out} is,
# what follows "Error: cannot write {out}: "
OUTPUT_CASES = [
    ("make-test-model --shape tiny {out}", "in no folder", NO_FOLDER),
    ("make-test-model --shape tiny {out}", "a full disk", FULL),
    ("make-test-model --shape tiny --quant q8_0 -t 2 {out}", "in no folder", NO_FOLDER),
    ("make-test-model --shape tiny --quant q8_0 -t 2 {out}", "a full disk", NOT_A_FILE),
    ("make-test-model --shape tiny --eagle3 {out} {dir}/target.gguf", "in no folder", NO_FOLDER),
    ("make-test-model --shape tiny --eagle3 {out} {dir}/target.gguf", "a full disk", FULL),
    ("make-test-model --shape tiny --eagle3 {dir}/draft.gguf {out}", "in no folder", NO_FOLDER),
    ("extract-mtp {m} -o {out}", "in no folder", NO_FOLDER),
    ("extract-mtp {m} -o {out}", "a full disk", FULL),
    ("extract-mtp {m} -o {out}", "under a file", FOLDER_IS_A_FILE),
    ("extract-mtp {m} -o {out} --trunk-only", "a full disk", FULL),
    ("extract-mtp {m} -o {out} --quant q8_0 -t 2", "in no folder", NO_FOLDER),
    ("extract-mtp {m} -o {out} --quant q8_0 -t 2", "a full disk", NOT_A_FILE),
    ("quantize {m} {out} q8_0 -t 2", "in no folder", NO_FOLDER),
    ("quantize {m} {out} q8_0 -t 2", "a full disk", NOT_A_FILE),
    ("quantize {m} {out} q8_0 -t 2", "under a file", FOLDER_IS_A_FILE),
]


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> Path:
    return write_test_model(tmp_path_factory.mktemp("in") / "m.gguf", TINY, "f32")


def full_disk(tmp_path: Path) -> Path:
    """A /dev/full of the test's own (every write fails with ENOSPC), so a writer that deletes its
    failed output cannot take the system's. Skips where it cannot be made (not root) or does not
    act as one (a folder mounted nodev)."""
    path = tmp_path / "full"
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))
        with open(path, "wb", buffering=0) as f:
            f.write(b"x")
    except OSError as e:
        if e.errno == errno.ENOSPC:
            return path
        path.unlink(missing_ok=True)
        pytest.skip(f"no full device of the test's own here ({e.strerror})")
    pytest.skip("the device node made here accepts writes")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command, kind, why", OUTPUT_CASES)
def test_an_output_that_cannot_be_written_is_one_line(mtp_model, tmp_path, command, kind, why):
    out = {"in no folder": lambda: tmp_path / "no" / "x.gguf", "a full disk": lambda: full_disk(tmp_path),
           "under a file": lambda: mtp_model / "x.gguf"}[kind]()
    before = sorted(tmp_path.iterdir())
    args = [a.format(m=mtp_model, out=out, dir=tmp_path) for a in command.split()]
    r = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert (r.exit_code, r.stdout) == (1, ""), r.output
    assert r.stderr.splitlines() == [f"Error: cannot write {out}: {why}"]      # one line, no blank before it
    assert sorted(tmp_path.iterdir()) == before                 # nothing written, nothing deleted
    assert kind != "a full disk" or out.is_char_device()


# ---- property: any mutation or truncation of a small GGUF ends in a ModelSpec or a GGUFError ----

BIG = [0, 1, 4, 999, 1000, 2**31, 2**32 - 1, 2**40, 2**60, 2**63, 2**64 - 1]


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> tuple[bytes, int, Path]:
    d = tmp_path_factory.mktemp("fuzz")
    path = write_gguf(d / "base.gguf", arch="qwen35", n_layer=1, nextn=1, n_embd=32,
                      tokens=["<unk>", "<s>", "</s>", "x", "y", "z", "ab"], chat_template="{{ x }}")
    base = path.read_bytes()
    meta_end = min(t.offset for t in load_spec(path).tensors)       # header, metadata, tensor infos
    return base, meta_end, d / "mutant.gguf"


@st.composite
def mutants(draw, base: bytes, meta_end: int) -> bytes:
    data = bytearray(base)
    at = st.one_of(st.integers(0, meta_end - 1), st.integers(0, len(base) - 1))     # mostly metadata
    for pos, byte in draw(st.lists(st.tuples(at, st.integers(0, 255)), max_size=6)):
        data[pos] = byte
    for pos, value in draw(st.lists(st.tuples(st.integers(0, meta_end - 8), st.sampled_from(BIG)), max_size=3)):
        data[pos:pos + 8] = struct.pack("<Q", value)                                 # an absurd count/length
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    return bytes(data if cut is None else data[:cut])


def test_mutants_end_in_spec_or_gguf_error(fuzz_dir):
    base, meta_end, path = fuzz_dir
    outcomes = {"spec": 0, "error": 0}

    @settings(max_examples=200, deadline=timedelta(seconds=5), derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(mutants(base, meta_end))
    def check(data: bytes) -> None:
        path.write_bytes(data)
        tracemalloc.start()
        try:
            spec = load_spec(path)
        except GGUFError as e:
            msg = str(e)
            assert msg.startswith(f"{path}: ") and "\n" not in msg
            outcomes["error"] += 1
        else:
            assert isinstance(spec, ModelSpec)
            assert all(t.offset + t.n_bytes <= len(data) for t in spec.tensors)
            outcomes["spec"] += 1
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 64 * 2**20, f"{peak} bytes allocated for a {len(data)}-byte file"

    check()
    print(outcomes)
    assert outcomes["error"] > 20 and sum(outcomes.values()) >= 200      # the mutations do bite


# ---- weights that give NaN logits: one line from the target; a draft's only stops drafting ----

@pytest.fixture(scope="module")
def nan_pair(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("nan")
    good = write_test_model(d / "good.gguf", TINY, "f32")
    return good, rewrite_gguf(good, d / "nan.gguf", nan="output_norm.weight")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_a_model_whose_logits_are_nan_is_one_line(nan_pair, temp):
    """It was a traceback at temp > 0 (an empty candidate set) and text of token 0 at temp 0."""
    _, bad = nan_pair
    r = CliRunner().invoke(cli, ["-m", str(bad), "-p", "hi", "-n", "4", "-t", "1", "--temp", temp, "--seed", "1"])
    assert (r.exit_code, r.stdout) == (1, ""), r.output
    assert "Traceback" not in r.stderr
    assert r.stderr.splitlines()[-1].startswith("Error: the model's logits at position ")
    assert "have no finite maximum (nan): the weights or metadata give NaN or infinite values" in r.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("temp", ["0", "0.8"])
def test_a_draft_whose_logits_are_nan_only_stops_drafting(nan_pair, temp):
    good, bad = nan_pair
    args = [str(Path(sys.executable).with_name("specrun")), "-m", str(good), "-p", "hi", "-n", "12", "-t", "1",
            "--temp", temp, "--seed", "7"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=100)
    r = subprocess.run([*args, "-md", str(bad), "--spec-type", "draft"], capture_output=True, text=True, timeout=100)
    assert (r.returncode, plain.returncode) == (0, 0), r.stderr
    # the target's text, token for token: at temp 0.8 rejection sampling with no draft draws plain's token
    assert r.stdout == plain.stdout
    if temp != "0":     # sampled drafts; greedy ones come from the C loop's argmax, which the verify rejects
        assert "the draft's logits at position" in r.stderr and "drafts stop there" in r.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["named pipe", "block_count 0", "rms epsilon NaN"])
def test_check_exact_checks_the_file_first(tmp_path, name):
    """check-exact loaded the file straight into llama.cpp: a pipe hung it, these metadata aborted it."""
    path = make_case(tmp_path, name)
    r = CliRunner().invoke(cli, ["check-exact", "-m", str(path), "-t", "1"])
    assert (r.exit_code, r.stdout) == (1, ""), r.output
    assert r.stderr.splitlines() == [f"Error: {path}: " + r.stderr.split(f"{path}: ", 1)[1].rstrip("\n")]
    assert CASES[name][1] in r.stderr


@pytest.mark.timeout(60)
def test_a_file_llama_cpp_refuses_says_why(tmp_path):
    """llama.cpp logs the reason, then "failed to load model"; the line shows the reason."""
    path = write_gguf(tmp_path / "m.gguf")         # no llama.attention.layer_norm_rms_epsilon
    r = CliRunner().invoke(cli, ["-m", str(path), "-p", "hi", "-n", "1", "-t", "1"])
    assert (r.exit_code, r.stdout) == (1, ""), r.output
    assert r.stderr == (f"Error: {path}: llama.cpp could not load this model; llama.cpp says: error loading model "
                        "hyperparameters: key not found in model: llama.attention.layer_norm_rms_epsilon (see "
                        f"`specrun inspect {path}`)\n")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n_ctx_train", [0, 2**31, 2**32 - 1])
def test_c_0_with_a_training_context_llama_cpp_cannot_use(nan_pair, tmp_path, n_ctx_train):
    """llama.cpp reads context_length as int32: 2^31 and up became a negative n_ctx, which failed
    after gigabytes of allocation with "n_ctx -2147483648 ... std::bad_alloc"."""
    import gguf
    good, _ = nan_pair
    path = rewrite_gguf(good, tmp_path / "m.gguf", kv={"qwen35.context_length": (n_ctx_train, gguf.GGUFValueType.UINT32)})
    r = CliRunner().invoke(cli, ["-m", str(path), "-c", "0", "-p", "hi", "-n", "1", "-t", "1"])
    assert (r.exit_code, r.stdout) == (1, ""), r.output
    read = n_ctx_train - 2**32 if n_ctx_train >= 2**31 else n_ctx_train
    assert r.stderr == (f"Error: {path}: -c 0 takes the model's training context, and llama.cpp reads {read} from "
                        "the file's context_length; give a size, e.g. -c 4096\n")
