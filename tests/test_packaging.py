"""The wheel `pip install` builds holds the whole tree: every module of gguf_spec/, kernels/ and
cli/ (subpackages included) and the package data, and they import from it. The editable install
that `make install` and CI use reads the source folders directly, so without this check a
package missing from pyproject.toml's list ships a specrun that cannot start (it once left out
kernels/drafters, cli/runtime and cli/server: `specrun --help` failed with ModuleNotFoundError)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"gguf_spec": "specrun/gguf_spec", "kernels": "specrun/kernels", "cli": "specrun/cli"}


def source_files() -> dict[str, Path]:
    """Wheel path -> source file: every .py and data file of the three packages."""
    out = {}
    for folder, dest in PACKAGES.items():
        for f in (ROOT / folder).rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts and (f.suffix == ".py" or "data" in f.parts):
                out[f"{dest}/{f.relative_to(ROOT / folder).as_posix()}"] = f
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the tree (the build writes build/ and egg-info beside it)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in PACKAGES:
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    (whl,) = (tmp / "dist").glob("specrun-*.whl")
    return whl


def test_wheel_holds_every_module_and_data_file(wheel):
    want = source_files()
    assert "specrun/kernels/drafters/base.py" in want and "specrun/gguf_spec/data/qwen2-vocab-16k.json.gz" in want
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        missing = sorted(set(want) - names)
        assert not missing, f"the wheel lacks {missing}: list their packages in pyproject.toml"
        for name, f in want.items():
            assert z.read(name) == f.read_bytes(), name
    assert not [n for n in names if n.endswith(".c")], "the C source belongs in the sdist only"


def test_every_module_imports_from_the_wheel(wheel, tmp_path):
    """Each module, imported from the unpacked wheel ahead of the editable install, comes from it."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    mods = sorted(p[:-3].replace("/", ".").removesuffix(".__init__") for p in source_files() if p.endswith(".py"))
    code = ("import importlib, sys\n"
            f"sys.path.insert(0, {str(site)!r})\n"
            f"for m in {mods!r}:\n"
            "    f = importlib.import_module(m).__file__\n"
            f"    assert f.startswith({str(site)!r}), (m, f)\n"
            "print(len(sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
