"""The default -t: the cores this process may use that other work leaves idle now.

llama.cpp's CPU backend makes every thread wait at a barrier after each graph node (this build:
OpenMP's ``#pragma omp barrier``, which spins and then sleeps). When other work keeps a core busy,
one of our threads is descheduled and the others wait for it at every node, so each node costs a
scheduler time slice instead of microseconds. So the default is not every core but

    cpus   = the CPUs this process may run on (sched_getaffinity)
    cores  = the physical cores among them (SMT siblings count once, as llama.cpp's
             cpu_get_num_math), capped by a cgroup CPU quota (cpu.max)
    busy   = the CPUs other processes kept busy over a short /proc/stat sample (SAMPLE_S),
             this process's own CPU time taken out
    n      = len(cpus) - busy, rounded to the nearest whole CPU, at least 1 and at most cores

`choose` is that rule, pure: the sample comes in as numbers. -t and LLAMA_ARG_THREADS win over it.
`default_threads` decides once per process, at the first context, as llama.cpp decides -t once at
startup, and logs one warning when it chooses fewer threads than cores.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

SAMPLE_S = 0.1        # the /proc/stat sample: 10 ticks of 10 ms on each CPU
ENV = "LLAMA_ARG_THREADS"


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    """The default -t and why."""

    n_threads: int
    cores: int               # the physical cores this process may use (affinity, cgroup quota)
    busy: float | None       # CPUs other processes kept busy in the sample; None: not sampled

    def note(self) -> str | None:
        """One line when the choice is below the cores: the -t taken, why, and the -t for all cores."""
        if self.n_threads >= self.cores or self.busy is None:
            return None
        return (f"-t {self.n_threads} of {self.cores} cores: other processes keep {self.busy:.1f} cores busy, "
                f"and a descheduled thread stalls the others (-t {self.cores} to use every core)")


def choose(n_cpus: int, cores: int, busy: float | None) -> ThreadChoice:
    """The rule of the module docstring. n_cpus: the CPUs this process may run on; cores: the
    physical cores among them (<= n_cpus); busy: the CPUs other processes kept busy, or None when
    it could not be sampled (every core then, as before)."""
    cores = max(1, cores)
    if busy is None:
        return ThreadChoice(cores, cores, None)
    idle = max(0.0, n_cpus - busy)
    return ThreadChoice(max(1, min(cores, math.floor(idle + 0.5))), cores, busy)


# ---- inputs (parsers are pure; the readers below feed them) ----------------------------------


def parse_stat(text: str) -> dict[int, tuple[int, int]]:
    """/proc/stat -> {cpu: (busy ticks, all ticks)} for each ``cpuN`` line. Busy: user, system,
    irq, softirq and steal (guest time is inside user and nice). Free: idle, iowait and nice (work
    at a lower priority, which the scheduler sets aside for ours)."""
    out: dict[int, tuple[int, int]] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or not name[3:].isdigit():
            continue
        f = [int(x) for x in rest.split()[:8]] + [0] * 8
        busy = f[0] + f[2] + f[5] + f[6] + f[7]
        out[int(name[3:])] = (busy, busy + f[1] + f[3] + f[4])
    return out


def busy_cpus(before: Mapping[int, tuple[int, int]], after: Mapping[int, tuple[int, int]],
              cpus: Iterable[int]) -> float | None:
    """The CPUs (a sum of fractions) kept busy between two parse_stat samples, over cpus; None when
    no CPU's ticks moved (too short a sample to say)."""
    total, seen = 0.0, False
    for c in cpus:
        if c not in before or c not in after:
            continue
        d_busy, d_all = after[c][0] - before[c][0], after[c][1] - before[c][1]
        if d_all > 0:
            total += min(1.0, max(0.0, d_busy / d_all))
            seen = True
    return total if seen else None


def physical_cores(cpus: Iterable[int], siblings: Mapping[int, str]) -> int:
    """The physical cores among cpus: each CPU's thread_siblings_list ("0,8" or "0-1") counts
    once; a CPU whose list is unknown counts as its own core."""
    return len({siblings.get(c, f"cpu{c}").strip() for c in cpus})


def quota_cpus(cpu_max: str | None) -> float | None:
    """cgroup v2 cpu.max ("200000 100000": 2 CPUs; "max 100000": no quota) -> CPUs, or None."""
    parts = (cpu_max or "").split()
    if len(parts) != 2 or not parts[0].isdigit() or not parts[1].isdigit() or int(parts[1]) == 0:
        return None
    return int(parts[0]) / int(parts[1])


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _cores(cpus: list[int]) -> int:
    siblings = {c: s for c in cpus
                if (s := _read(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")) is not None}
    cores = physical_cores(cpus, siblings)
    quota = quota_cpus(_read("/sys/fs/cgroup/cpu.max"))
    return max(1, min(cores, math.ceil(quota))) if quota is not None else cores


def sample(cpus: list[int], seconds: float = SAMPLE_S, read: Callable[[], str | None] = lambda: _read("/proc/stat"),
           sleep: Callable[[float], None] = time.sleep) -> float | None:
    """The CPUs other processes kept busy over `seconds`: /proc/stat's busy CPUs less this
    process's own CPU time (its other threads may be working). None where /proc/stat is missing."""
    first = read()
    t0, own0 = time.monotonic(), _own_cpu_s()
    sleep(seconds)
    second = read()
    wall, own = time.monotonic() - t0, _own_cpu_s() - own0
    if first is None or second is None:
        return None
    busy = busy_cpus(parse_stat(first), parse_stat(second), cpus)
    if busy is None:
        return None
    return max(0.0, busy - (own / wall if wall > 0 else 0.0))


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


_lock = threading.Lock()
_choice: ThreadChoice | None = None


def default_choice() -> ThreadChoice:
    """This process's default -t (sampled once, then kept); logs one warning when below the cores."""
    global _choice
    with _lock:
        if _choice is None:
            cpus = _cpus()
            _choice = choose(len(cpus), min(len(cpus), _cores(cpus)), sample(cpus))
            if (line := _choice.note()) is not None:
                log.warning("%s", line)
            else:
                log.info("-t %d (%d cores, %s busy)", _choice.n_threads, _choice.cores,
                         "?" if _choice.busy is None else f"{_choice.busy:.1f}")
        return _choice


def default_threads() -> int:
    """The threads of a context given none: LLAMA_ARG_THREADS when set (llama.cpp's variable for
    -t), else default_choice()."""
    env = os.environ.get(ENV, "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return default_choice().n_threads
