"""The default -t (kernels/threads.py): the rule, the parsers and the one warning, all on injected
samples; nothing here reads the machine's real load."""

from __future__ import annotations

import logging

import pytest

from specrun.kernels import threads
from specrun.kernels.threads import ThreadChoice, busy_cpus, choose, parse_stat, physical_cores, quota_cpus


@pytest.mark.parametrize("n_cpus, cores, busy, want", [
    (2, 2, None, 2),      # not sampled: every core, as before
    (2, 2, 0.0, 2),       # quiet
    (2, 2, 0.3, 2),       # a little background work
    (2, 2, 0.6, 1),       # more than half a core taken
    (2, 2, 1.0, 1),       # a busy loop on one core
    (2, 2, 2.0, 1),       # both cores busy: still one thread
    (2, 2, 5.0, 1),
    (16, 16, 4.0, 12),
    (16, 8, 0.0, 8),      # SMT: the physical cores, as llama.cpp's cpu_get_num_math
    (16, 8, 7.0, 8),      # 9 idle logical CPUs still hold 8 threads
    (16, 8, 12.0, 4),
    (1, 1, 1.0, 1),
])
def test_choose(n_cpus, cores, busy, want):
    c = choose(n_cpus, cores, busy)
    assert c == ThreadChoice(want, cores, busy)


def test_note_names_the_choice_the_load_and_the_flag():
    assert choose(2, 2, 0.0).note() is None
    assert choose(2, 2, None).note() is None
    assert choose(16, 8, 7.0).note() is None
    assert choose(2, 2, 1.04).note() == ("-t 1 of 2 cores: other processes keep 1.0 cores busy, and a descheduled "
                                         "thread stalls the others (-t 2 to use every core)")


STAT_0 = """cpu  100 0 0 1000 0 0 0 0 0 0
cpu0 50 5 10 500 7 1 1 0 0 0
cpu1 50 5 10 500 0 0 0 2 0 0
intr 12345
"""
# over the sample: cpu0 spent 8 ticks in user, 2 idle; cpu1 1 system, 6 idle, 3 niced
STAT_1 = """cpu  100 0 0 1000 0 0 0 0 0 0
cpu0 58 5 10 502 7 1 1 0 0 0
cpu1 50 8 11 506 0 0 0 2 0 0
intr 12399
"""


def test_parse_stat_counts_nice_idle_and_iowait_as_free():
    assert parse_stat(STAT_0) == {0: (50 + 10 + 1 + 1, 50 + 10 + 1 + 1 + 5 + 500 + 7),
                                  1: (50 + 10 + 2, 50 + 10 + 2 + 5 + 500)}
    assert parse_stat("cpu 1 2 3 4\nintr 5\n") == {}


def test_busy_cpus_sums_each_cpus_busy_fraction():
    before, after = parse_stat(STAT_0), parse_stat(STAT_1)
    assert busy_cpus(before, after, [0, 1]) == pytest.approx(0.8 + 0.1)
    assert busy_cpus(before, after, [1]) == pytest.approx(0.1)     # outside the affinity: not counted
    assert busy_cpus(before, before, [0, 1]) is None                # no tick moved: unknown
    assert busy_cpus(before, after, [7]) is None


def test_physical_cores_count_smt_siblings_once():
    assert physical_cores([0, 1], {0: "0\n", 1: "1\n"}) == 2
    assert physical_cores([0, 1, 2, 3], {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}) == 2
    assert physical_cores([0, 1], {0: "0-1", 1: "0-1"}) == 1
    assert physical_cores([0, 1], {}) == 2


@pytest.mark.parametrize("text, want", [
    ("max 100000\n", None), ("200000 100000\n", 2.0), ("150000 100000", 1.5), (None, None), ("", None),
    ("5 0", None),
])
def test_quota_cpus(text, want):
    assert quota_cpus(text) == want


def test_sample_takes_this_process_out_and_reads_only_the_given_cpus(monkeypatch):
    texts = iter([STAT_0, STAT_1])
    own = iter([10.0, 10.0])      # this process used no CPU in the sample
    monkeypatch.setattr(threads, "_own_cpu_s", lambda: next(own))
    assert threads.sample([0, 1], 0.1, read=lambda: next(texts), sleep=lambda s: None) == pytest.approx(0.9)
    texts = iter([STAT_0, None])
    own = iter([10.0, 10.0])
    assert threads.sample([0, 1], 0.1, read=lambda: next(texts), sleep=lambda s: None) is None


def test_sample_subtracts_own_cpu_time(monkeypatch):
    texts = iter([STAT_0, STAT_1])
    clock = iter([100.0, 100.5])  # 0.5 s of wall time
    own = iter([10.0, 10.25])     # of which this process's threads used a quarter second: 0.5 CPUs
    monkeypatch.setattr(threads, "_own_cpu_s", lambda: next(own))
    monkeypatch.setattr(threads.time, "monotonic", lambda: next(clock))
    assert threads.sample([0, 1], 0.5, read=lambda: next(texts), sleep=lambda s: None) == pytest.approx(0.4)


def test_env_and_one_warning_per_process(monkeypatch, caplog):
    monkeypatch.setenv("LLAMA_ARG_THREADS", "3")
    assert threads.default_threads() == 3
    monkeypatch.setenv("LLAMA_ARG_THREADS", "")
    monkeypatch.setattr(threads, "_choice", None)
    monkeypatch.setattr(threads, "_cpus", lambda: [0, 1])
    monkeypatch.setattr(threads, "_cores", lambda cpus: 2)
    calls = []
    monkeypatch.setattr(threads, "sample", lambda cpus: calls.append(cpus) or 1.2)
    with caplog.at_level(logging.INFO, logger=threads.__name__):
        assert threads.default_threads() == 1
        assert threads.default_threads() == 1
    assert calls == [[0, 1]]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [choose(2, 2, 1.2).note()]
