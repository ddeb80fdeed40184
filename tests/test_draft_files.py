"""Which -md file can draft for which model: run, inspect, bench and export give the same answer, and
a pair llama.cpp would crash on (SIGSEGV drafting with MTP heads as a draft model, GGML_ASSERT on MTP
heads of another width) is one line before any weights load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrun.cli.main import cli
from specrun.gguf_spec.extract import extract_mtp, extract_trunk
from specrun.gguf_spec.testmodel import TINY, SynthConfig, write_test_model

SPECRUN = str(Path(sys.executable).with_name("specrun"))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """A tiny qwen35 + MTP model, its trunk and heads apart, and the heads of a model twice as wide."""
    d = tmp_path_factory.mktemp("drafts")
    full = write_test_model(d / "full.gguf", TINY, "f32")
    extract_trunk(full, d / "trunk.gguf")
    extract_mtp(full, d / "heads.gguf")
    wide = write_test_model(d / "wide.gguf", SynthConfig(n_embd=2 * TINY.n_embd), "f32")
    extract_mtp(wide, d / "wide-heads.gguf")
    return {"full": full, "trunk": d / "trunk.gguf", "heads": d / "heads.gguf", "wide": d / "wide-heads.gguf"}


def run(*args: str) -> subprocess.CompletedProcess:
    """In a process of its own: the old behaviour was a signal."""
    return subprocess.run([SPECRUN, *args, "-p", "hi", "-n", "4", "-t", "1", "--temp", "0"], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(150)
def test_mtp_heads_are_not_a_draft_model(files):
    r = run("-m", str(files["full"]), "-md", str(files["heads"]), "--spec-type", "draft")
    assert (r.returncode, r.stdout) == (1, ""), r.stderr                  # was -11 (SIGSEGV in llama.cpp)
    assert r.stderr == ("Error: -md heads.gguf holds only MTP heads (no trunk), not a draft model; use "
                        "--spec-type draft-mtp\n")
    ok = run("-m", str(files["trunk"]), "-md", str(files["heads"]), "--spec-type", "draft-mtp")
    assert ok.returncode == 0 and ok.stdout, ok.stderr


@pytest.mark.timeout(150)
def test_mtp_heads_of_another_width_are_refused_everywhere(files):
    why = ("MTP heads of width 512 / vocab 512 do not fit the target (256 / 512); extract the heads from this "
           "model's own GGUF")
    r = run("-m", str(files["trunk"]), "-md", str(files["wide"]), "--spec-type", "draft-mtp")
    assert (r.returncode, r.stderr) == (1, f"Error: -md wide-heads.gguf cannot be the MTP heads of trunk.gguf: {why}\n")
    out = CliRunner().invoke(cli, ["inspect", str(files["trunk"]), "-md", str(files["wide"])]).stdout
    assert "draft-mtp" not in out.split("spec types: ")[1].splitlines()[0]       # inspect listed it: "compatible"
    assert f"draft wide-heads.gguf: INCOMPATIBLE with trunk.gguf: {why}" in out
    e = CliRunner().invoke(cli, ["export", "--to", "llama-server", "-m", str(files["trunk"]), "-md", str(files["wide"]),
                                 "--spec-type", "draft-mtp"])
    assert (e.exit_code, e.stdout) == (1, ""), e.output                         # printed a command llama.cpp aborts on
    out = CliRunner().invoke(cli, ["inspect", str(files["trunk"]), "-md", str(files["heads"])]).stdout
    assert "draft-mtp (with -md heads.gguf)" in out and "draft heads.gguf: compatible with trunk.gguf" in out


@pytest.mark.timeout(150)
def test_bench_with_heads_and_no_spec_type_says_nothing_of_an_unused_md(files):
    r = CliRunner().invoke(cli, ["bench", "-m", str(files["trunk"]), "-md", str(files["heads"]), "-n", "4", "--reps",
                                 "1", "--prompts", "free", "-t", "1", "--json"])
    assert r.exit_code == 0, r.output
    assert "not used" not in r.stderr and '"draft-mtp"' in r.stdout
