"""The AMX fallback (kernels/cpu_probe.py): the decision with the probe's result injected, the
cache, a real child-process probe on this machine, llama.cpp's list of extra buffer types really
shrinking, Model(exact=False) following the plan; and `specrun`'s entry point turning a native
crash into a readable "Fatal Python error" line.

The AMX crash itself (llama.cpp issue 20824) needs a Xeon whose VM breaks AMX; where these tests
were written the CPU has no AMX, so a crash is injected as a probe result, or as a real SIGSEGV of
a child process in place of the probe's."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys

import pytest

from specrun.kernels import cpu_probe as cp
from specrun.kernels.cpu_probe import CpuInfo, Plan, ProbeResult

AMX_CPU = CpuInfo("Intel(R) Xeon(R) Platinum 8488C", frozenset({"avx512f", "amx_tile", "amx_int8", "amx_bf16"}))
PLAIN_CPU = CpuInfo("AMD EPYC", frozenset({"avx2", "avx512f"}))

OK = {"default": ProbeResult("default", True, "ok"), "no-amx": ProbeResult("no-amx", True, "ok")}
SEGV = ProbeResult("default", False, "killed by SIGSEGV")
ILL_BOTH = {"default": ProbeResult("default", False, "killed by SIGILL"),
            "no-amx": ProbeResult("no-amx", False, "killed by SIGSEGV")}


class FakeProbe:
    """probe(mode) -> the given result for that mode, recording every call."""

    def __init__(self, results: dict[str, ProbeResult]) -> None:
        self.results = results
        self.calls: list[str] = []

    def __call__(self, mode: str) -> ProbeResult:
        self.calls.append(mode)
        return self.results[mode]


# ---- the decision ----------------------------------------------------------------------------


@pytest.mark.parametrize("cpu, listed", [(PLAIN_CPU, True), (PLAIN_CPU, None), (AMX_CPU, False)])
def test_no_amx_advertised_or_listed_runs_no_probe(cpu, listed):
    probe = FakeProbe({})
    assert cp.decide(cpu, listed, probe) == cp.DEFAULT
    assert probe.calls == []


@pytest.mark.parametrize("listed", [True, None])   # None: the list could not be read, so probe
def test_amx_that_works_keeps_llama_cpps_choice(listed):
    probe = FakeProbe(OK)
    assert cp.decide(AMX_CPU, listed, probe) == Plan(extra_bufts=True, drop_amx=False, notice=None)
    assert probe.calls == ["default"]


def test_amx_that_crashes_is_dropped_and_repacking_stays():
    probe = FakeProbe({"default": SEGV, "no-amx": OK["no-amx"]})
    plan = cp.decide(AMX_CPU, True, probe)
    assert (plan.extra_bufts, plan.drop_amx) == (True, True)
    assert probe.calls == ["default", "no-amx"]
    assert plan.notice == ("llama.cpp's AMX kernels fail on this CPU (Intel(R) Xeon(R) Platinum 8488C; "
                           "probe: killed by SIGSEGV): weights are repacked without AMX")


def test_when_repacking_without_amx_crashes_too_nothing_is_repacked():
    plan = cp.decide(AMX_CPU, True, FakeProbe(ILL_BOTH))
    assert (plan.extra_bufts, plan.drop_amx) == (False, False)
    assert "probe: killed by SIGILL" in plan.notice and "without AMX too (killed by SIGSEGV)" in plan.notice
    assert "\n" not in plan.notice


def test_a_probe_that_could_not_run_is_not_called_a_crash():
    broken = ProbeResult("default", False, "exit 1: No space left on device", conclusive=False)
    plan = cp.decide(AMX_CPU, True, FakeProbe({"default": broken, "no-amx": OK["no-amx"]}))
    assert plan.drop_amx and plan.notice.startswith("llama.cpp's AMX kernels could not be checked on this CPU")


def test_read_cpuinfo(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nmodel name\t: Intel Xeon\nflags\t\t: fpu avx2 amx_tile amx_int8\n\n"
                 "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n")
    assert cp.read_cpuinfo(f) == CpuInfo("Intel Xeon", frozenset({"fpu", "avx2", "amx_tile", "amx_int8"}))
    assert cp.read_cpuinfo(f).amx
    assert not cp.read_cpuinfo(tmp_path / "missing").amx


# ---- the process-wide plan: one probe, one notice ----------------------------------------------


@pytest.fixture
def fresh_plan(monkeypatch, tmp_path):
    """extra_bufts_plan() decided anew, with its cache in tmp_path and llama.cpp's list untouched
    (drop_extra_buft recorded instead); the real plan comes back afterwards."""
    monkeypatch.setenv("SPECRUN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cp, "_plan", None)
    dropped: list[str] = []
    monkeypatch.setattr(cp, "drop_extra_buft", dropped.append)
    monkeypatch.setattr(cp, "extra_buft_names", lambda: ["AMX", "CPU_REPACK"])
    return dropped


def fake_child_probe(results: dict[str, ProbeResult], calls: list[str]):
    class Fake(FakeProbe):
        def __init__(self) -> None:
            super().__init__(results)
            self.calls = calls

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    return Fake


def test_a_crashing_amx_gives_one_notice_per_process_and_one_probe_per_machine(fresh_plan, monkeypatch, caplog):
    calls: list[str] = []
    monkeypatch.setattr(cp, "read_cpuinfo", lambda: AMX_CPU)
    monkeypatch.setattr(cp, "ChildProbe", fake_child_probe({"default": SEGV, "no-amx": OK["no-amx"]}, calls))
    caplog.set_level(logging.INFO, logger=cp.__name__)
    plan = cp.extra_bufts_plan()
    assert cp.extra_bufts_plan() is plan and (plan.extra_bufts, plan.drop_amx) == (True, True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "killed by SIGSEGV): weights are repacked without AMX" in warnings[0]
    assert fresh_plan == ["AMX"]
    assert calls == ["default", "no-amx"]
    monkeypatch.setattr(cp, "_plan", None)       # a new process on the same machine: the cache answers
    assert cp.extra_bufts_plan().drop_amx
    assert calls == ["default", "no-amx"] and fresh_plan == ["AMX", "AMX"]


def test_no_amx_means_no_probe_and_no_notice(fresh_plan, monkeypatch, caplog):
    calls: list[str] = []
    monkeypatch.setattr(cp, "read_cpuinfo", lambda: PLAIN_CPU)
    monkeypatch.setattr(cp, "ChildProbe", fake_child_probe({}, calls))
    caplog.set_level(logging.INFO, logger=cp.__name__)
    assert cp.extra_bufts_plan() == cp.DEFAULT
    assert calls == [] and fresh_plan == [] and caplog.records == []


# ---- the cache -------------------------------------------------------------------------------


KEY = {"cpu": AMX_CPU.model_name, "flags": "0123", "kernel": "6.8", "llama_cpp": "0.3.36", "libs": "libllama.so:1:2"}


def test_the_cache_answers_a_second_time_and_a_new_build_probes_again(tmp_path):
    probe = FakeProbe({"default": SEGV, "no-amx": OK["no-amx"]})
    first = cp.decide(AMX_CPU, True, cp.cached(probe, tmp_path, KEY))
    assert probe.calls == ["default", "no-amx"] and len(list(tmp_path.glob("*.json"))) == 2
    again = cp.decide(AMX_CPU, True, cp.cached(probe, tmp_path, dict(KEY)))
    assert again == first and probe.calls == ["default", "no-amx"]
    cp.decide(AMX_CPU, True, cp.cached(probe, tmp_path, {**KEY, "llama_cpp": "0.3.37"}))
    assert probe.calls == ["default", "no-amx"] * 2


def test_the_cache_keeps_no_inconclusive_result_and_survives_a_broken_file(tmp_path):
    probe = FakeProbe({"default": ProbeResult("default", False, "exit 1: no space left", conclusive=False)})
    run = cp.cached(probe, tmp_path, KEY)
    run("default")
    run("default")
    assert probe.calls == ["default", "default"] and list(tmp_path.iterdir()) == []
    probe.results["default"] = OK["default"]
    run("default")
    (f,) = tmp_path.glob("*.json")
    assert json.loads(f.read_text())["result"]["works"] is True
    f.write_text("{not json")
    assert run("default").works and probe.calls == ["default"] * 4


def test_the_cache_key_names_the_cpu_and_the_build():
    key = cp.cache_key(AMX_CPU)
    assert key["cpu"] == AMX_CPU.model_name and key["llama_cpp"] == cp.L.__version__
    assert key["flags"] != cp.cache_key(PLAIN_CPU)["flags"]
    assert "libllama" in key["libs"] and "libggml-cpu" in key["libs"]


# ---- real child processes on this machine ------------------------------------------------------


@pytest.fixture(scope="module")
def child_probe():
    with cp.ChildProbe() as probe:
        yield probe


@pytest.mark.slow
def test_the_real_probe_works_here(child_probe):
    r = child_probe("default")
    assert (r.works, r.detail, r.conclusive) == (True, "ok", True), r
    if "CPU_REPACK" in (cp.extra_buft_names() or []):
        assert "CPU_REPACK" in r.buffers, r      # the probe's models really were repacked


@pytest.mark.slow
def test_dropping_a_buffer_type_really_removes_it_from_the_load(child_probe, monkeypatch):
    """The mechanism "no-amx" uses, shown on the type this machine has: CPU_REPACK."""
    if "CPU_REPACK" not in (cp.extra_buft_names() or []):
        pytest.skip("this llama.cpp lists no CPU_REPACK buffer type")
    monkeypatch.setitem(cp.MODES, "no-repack", ("CPU_REPACK",))
    r = child_probe("no-repack")
    assert r.works and r.buffers and "CPU_REPACK" not in r.buffers, r


@pytest.mark.slow
def test_a_probe_killed_by_a_signal_is_a_conclusive_failure(child_probe, monkeypatch):
    real_run = subprocess.run

    def crashing_child(cmd, **kw):
        return real_run([sys.executable, "-c", "import ctypes; ctypes.string_at(0)"], **kw)

    monkeypatch.setattr(cp.subprocess, "run", crashing_child)
    r = child_probe("default")
    assert (r.works, r.detail, r.conclusive) == (False, "killed by SIGSEGV", True)


@pytest.mark.slow
def test_model_without_exact_mode_follows_the_plan(child_probe, monkeypatch, caplog):
    """Model(exact=False) asks the plan: repacked weights by default here, none when the plan says
    so (llama.cpp's own log names the buffer types it loaded into)."""
    from specrun.kernels.llama import Model

    q4 = next(p for p in child_probe.models() if "q4_k_m" in p.name)
    Model(q4).close()   # this process stays an exact-mode one (a first non-exact load would refuse later exact ones)
    caplog.set_level(logging.INFO, logger="llama.cpp")

    def buffers() -> str:
        with Model(q4, exact=False):
            pass
        text = " ".join(r.getMessage() for r in caplog.records if "model buffer size" in r.getMessage())
        caplog.clear()
        return text

    if "CPU_REPACK" in (cp.extra_buft_names() or []):
        assert "CPU_REPACK" in buffers()
    monkeypatch.setattr(cp, "extra_bufts_plan", lambda: Plan(extra_bufts=False, drop_amx=False, notice="x"))
    assert "CPU_REPACK" not in buffers()


# ---- faulthandler in the CLI entry -------------------------------------------------------------


def test_a_native_crash_under_specrun_main_ends_in_a_readable_line():
    """A real SIGSEGV inside a `specrun` command (one added for the test): main() has installed
    faulthandler, so stderr says what happened instead of nothing."""
    code = ("import ctypes, sys\n"
            "import specrun.cli.main as m\n"
            "@m.cli.command('crash')\n"
            "def crash():\n"
            "    ctypes.string_at(0)\n"
            "sys.argv = ['specrun', 'crash']\n"
            "m.main()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == -signal.SIGSEGV, p
    assert "Fatal Python error: Segmentation fault" in p.stderr
    assert "in crash" in p.stderr          # the Python stack of the crashing thread
