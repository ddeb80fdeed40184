"""Exits as llama.cpp's, on a real `specrun` process: Ctrl-C (SIGINT) during the model load and
during generation exits 130 with "interrupted" and no traceback (after the statistics once
generation has begun); a reader that closes stdout early (`| head -c 20`) ends the run at once,
quietly, with exit 141 and the statistics on stderr."""

from __future__ import annotations

import os
import select
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SPECRUN = str(Path(sys.executable).with_name("specrun"))
STORY = ["-p", "Once upon a time, in a land far away,", "--temp", "0", "-n", "2000", "-c", "4096", "-no-cnv"]


def interrupt_when(args: list[str], marker: bytes, stream: str, timeout: float = 240) -> tuple[int, str, str]:
    """Start specrun, send SIGINT once `marker` appears on `stream` ('stdout' or 'stderr'); the
    exit code and the whole stdout and stderr."""
    p = subprocess.Popen([SPECRUN, *args], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = {"stdout": b"", "stderr": b""}
    pipes = {p.stdout.fileno(): "stdout", p.stderr.fileno(): "stderr"}
    deadline = time.monotonic() + timeout
    try:
        while marker not in seen[stream]:
            assert time.monotonic() < deadline, f"{marker!r} never came on {stream}: {seen}"
            ready, _, _ = select.select(list(pipes), [], [], 0.5)
            for fd in ready:
                chunk = os.read(fd, 65536)
                seen[pipes[fd]] += chunk
                if not chunk:
                    del pipes[fd]
            assert pipes, f"specrun ended before {marker!r}: {seen}"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, (seen["stdout"] + out).decode(errors="replace"), (seen["stderr"] + err).decode(errors="replace")


def no_traceback(err: str) -> None:
    assert "Traceback" not in err and "Exception ignored" not in err and "KeyboardInterrupt" not in err, err


def test_ctrl_c_during_the_model_load(smollm_path):
    # -v shows llama.cpp's loader log: the signal comes while llama.cpp is reading the file
    rc, out, err = interrupt_when(["-m", str(smollm_path), *STORY, "-v"], b"llama_model_loader: loaded meta", "stderr")
    assert rc == 130, err[-2000:]
    assert err.rstrip().endswith("interrupted")
    no_traceback(err)
    assert out == "" and "prompt eval:" not in err          # it ended there: nothing was generated


def test_ctrl_c_during_generation(smollm_path):
    rc, out, err = interrupt_when(["-m", str(smollm_path), *STORY], b" ", "stdout")
    assert rc == 130, err
    no_traceback(err)
    lines = err.splitlines()
    assert lines[-1] == "interrupted"
    assert any(ln.startswith("generation: ") for ln in lines), err      # the statistics of what was generated
    n_gen = int(next(ln for ln in lines if ln.startswith("generation: ")).split()[1])
    assert 1 <= n_gen < 2000 and out.endswith("\n")


def test_ctrl_c_during_chat_load(smollm_path):
    rc, _, err = interrupt_when(["chat", "-m", str(smollm_path), "-v"], b"llama_model_loader: loaded meta", "stderr")
    assert rc == 130 and err.rstrip().endswith("interrupted")
    no_traceback(err)


def test_closed_stdout_ends_the_run_quietly_with_statistics(smollm_path):
    cmd = shlex.join([SPECRUN, "-m", str(smollm_path), *STORY])
    sh = f'{cmd} | head -c 20; echo "rc=${{PIPESTATUS[0]}}"'
    r = subprocess.run(["bash", "-c", sh], capture_output=True, text=True, timeout=300)
    assert r.stdout.endswith("rc=141\n"), (r.stdout, r.stderr)
    assert len(r.stdout) == 20 + len("rc=141\n")
    no_traceback(r.stderr)
    assert "BrokenPipe" not in r.stderr
    gen = [ln for ln in r.stderr.splitlines() if ln.startswith("generation: ")]
    assert len(gen) == 1, r.stderr
    assert int(gen[0].split()[1]) < 100                    # it stopped at once, not after -n 2000
