"""Writing an output file: check its path before anything is written, compare it with the inputs
as files (not as names), and write it through a temporary file next to it, so that a failure
leaves nothing behind and an existing file untouched."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import SpecrunError


class OutputError(SpecrunError):
    """An output path that cannot be written: no such folder, not a file, a full disk, ..."""


_FIX = {
    errno.ENOENT: "create the folder first",
    errno.ENOTDIR: "a folder on the path is a file; choose another path",
    errno.EACCES: "choose a folder you can write to",
    errno.EPERM: "choose a folder you can write to",
    errno.EROFS: "choose a folder you can write to",
    errno.ENOSPC: "free some space or choose another disk",
    errno.EDQUOT: "free some space or choose another disk",
    errno.EISDIR: "give a file name",
}


def cannot_write(path: str | Path, code: int) -> OutputError:
    """'cannot write PATH: <strerror> (<the fix>)'."""
    return OutputError(f"cannot write {path}: {os.strerror(code)} ({_FIX.get(code, 'choose another path')})")


def same_file(a: str | Path, b: str | Path) -> bool:
    """True when `a` and `b` name one file: the same path, a symbolic link or a hard link to it."""
    try:
        return os.path.samefile(a, b)
    except OSError:                       # one of them does not exist (yet)
        return Path(a).resolve() == Path(b).resolve()


def check_output(path: str | Path, *, file_only: bool = False) -> Path:
    """Raise OutputError unless `path` can be written: not a folder, its folder exists and is
    writable. file_only: an existing `path` must be a regular file (llama.cpp's quantizer seeks
    back to write the header, so it cannot write a device or a pipe)."""
    path = Path(path)
    if path.is_dir():
        raise cannot_write(path, errno.EISDIR)
    if path.exists() and not path.is_file() and file_only:
        raise OutputError(f"cannot write {path}: not a regular file (give a file name)")
    folder = path.resolve().parent
    if not folder.is_dir():
        raise cannot_write(path, errno.ENOENT if not folder.exists() else errno.ENOTDIR)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise cannot_write(path, errno.EACCES)
    return path


@contextlib.contextmanager
def writing(path: str | Path, *, file_only: bool = False) -> Iterator[Path]:
    """check_output(path), then yield the path to write to: a temporary file in path's folder,
    renamed to `path` when the block ends without an error and removed when it raises, so a failure
    (a full disk, a bad input, Ctrl-C) leaves no partial file and an existing `path` as it was.
    An existing `path` that is not a regular file (/dev/null) is written in place, never removed.
    An OSError while writing becomes OutputError 'cannot write PATH: ...'."""
    path = check_output(path, file_only=file_only)
    if path.exists() and not path.is_file():
        tmp = None
    else:
        real = path.resolve()                       # a symbolic link is written through
        tmp = real.with_name(f"{real.name}.{os.getpid()}.tmp")
    try:
        yield path if tmp is None else tmp
        if tmp is not None:
            os.replace(tmp, real)
    except OSError as e:
        if e.filename not in (None, str(path), str(tmp)):
            raise                                   # not about the output
        raise cannot_write(path, e.errno or errno.EIO) from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
