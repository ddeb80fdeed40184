"""The README's "Use" section, kept honest: every command in its code block runs as written, in a
directory that holds the files it names (prompt.txt, and tiny synthetic models as target.gguf,
small-draft.gguf, model-with-mtp.gguf, trunk.gguf and heads.gguf), with only a short length
appended (-n 8; check-exact: one context and one n-max) and, for the interactive ones, a line of
input (chat) or a Ctrl-C once it serves (serve)."""

from __future__ import annotations

import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specrun.gguf_spec.extract import extract_mtp, extract_trunk
from specrun.gguf_spec.testmodel import write_test_model

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SPECRUN = str(Path(sys.executable).with_name("specrun"))
SHORT = {"check-exact": ["--n-max", "3", "--context", "100"], "inspect": [], "serve": ["-n", "8"], "export": []}


def use_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Use\n"):]
    section = section[:section.index("\n## ", 1)]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the Use section has no bash block"
    return [ln for ln in block.group(1).splitlines() if ln.strip()]


COMMANDS = use_commands()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("readme")
    full = write_test_model(d / "model-with-mtp.gguf")
    write_test_model(d / "target.gguf")
    write_test_model(d / "small-draft.gguf")
    extract_trunk(full, d / "trunk.gguf")
    extract_mtp(full, d / "heads.gguf")
    (d / "prompt.txt").write_text("def fib(n):\n    if n < 2:\n        return n\n", encoding="utf-8")
    return d


def test_the_section_is_found():
    assert len(COMMANDS) >= 8 and all(c.startswith("specrun ") for c in COMMANDS), COMMANDS


@pytest.mark.parametrize("line", COMMANDS)
def test_readme_use_command_runs_as_written(line, workdir):
    argv = shlex.split(line, comments=True)
    assert argv[0] == "specrun"
    sub = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else "run"
    argv = [SPECRUN, *argv[1:], *SHORT.get(sub, ["-n", "8"])]
    env = dict(os.environ, SPECRUN_HISTORY=str(workdir / "history"), SPECRUN_PORT="0")
    if sub == "serve":
        rc, err = serve_then_interrupt(argv, workdir, env)
    else:
        r = subprocess.run(argv, cwd=workdir, env=env, input="Hi\n" if sub == "chat" else "",
                           capture_output=True, text=True, timeout=600)
        rc, err = r.returncode, r.stderr
        if sub == "run" and "--json" not in argv:
            assert r.stdout.strip(), f"{line}: no text\n{err}"
    assert rc == 0, f"{line}\nexit {rc}\n{err[-3000:]}"
    assert "Traceback" not in err and "Error" not in err, err


def serve_then_interrupt(argv: list[str], cwd: Path, env: dict) -> tuple[int, str]:
    p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE)
    err, deadline = b"", time.monotonic() + 300
    try:
        while not re.search(rb"on http://\S+ \(\d+ slot", err):
            assert time.monotonic() < deadline and p.poll() is None, err.decode(errors="replace")
            if select.select([p.stderr], [], [], 0.5)[0]:
                err += os.read(p.stderr.fileno(), 65536)
        p.send_signal(signal.SIGINT)
        err += p.communicate(timeout=120)[1]
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err.decode(errors="replace")
