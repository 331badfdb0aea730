"""How long each start-up phase took: the numbers behind `kvmesh:startup_phase_seconds{phase}` and
the readiness log line.

`startup_phase(..., phase="weight_load")` adds its duration here; the server sets `total_s`
(process start to ready) when /ready turns green. A phase nested in another (CUDA graph capture
inside the KV allocation) is counted in its own phase only, so the phases never sum to more
than the time they covered.

NOTE: one record per process (`get_startup_times`), because the phases run in different floors
(the fetch in `common.storage`, weights and KV in `engine`, warm-up in `api`) and none of them
should hand a recorder to the others.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

# the phases, in start-up order; `kvmesh:startup_phase_seconds` has one series each plus "total"
PHASES = ("fetch", "kernel_build", "weight_load", "kv_alloc", "warmup")
TOTAL = "total"


@dataclass(slots=True)
class StartupTimes:
    # phase -> seconds spent in it, nested phases' time excluded; every phase present (0: not run)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # process start (as the kernel counts it, interpreter start-up included) -> ready; None
    # until the server is ready
    total_s: float | None = None
    # per thread, the phases open now, outermost first: an inner one's time is taken off its
    # parent's (NOTE: per thread, so two models loaded at once in one process, as tests do,
    # never nest into each other)
    _open: dict[int, list[list]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self, phase: str) -> None:
        if phase not in self.seconds:
            raise ValueError(f"unknown start-up phase {phase!r}; one of {', '.join(PHASES)}")
        with self._lock:
            # [phase, seconds of nested phases]
            self._open.setdefault(threading.get_ident(), []).append([phase, 0.0])

    def end(self, phase: str, elapsed_s: float) -> None:
        """Close this thread's innermost open phase (`phase`), `elapsed_s` after it began."""
        with self._lock:
            stack = self._open[threading.get_ident()]
            name, nested = stack.pop()
            assert name == phase, (name, phase)  # phases are context managers: strictly nested
            self.seconds[phase] += max(0.0, elapsed_s - nested)
            if stack:
                stack[-1][1] += elapsed_s
            else:
                del self._open[threading.get_ident()]

    def series(self) -> list[tuple[str, float]]:
        """(phase label, seconds) for the gauge: every phase, then the total once known."""
        out = [(p, self.seconds[p]) for p in PHASES]
        if self.total_s is not None:
            out.append((TOTAL, self.total_s))
        return out

    def summary(self) -> str:
        """`fetch 0.0 s, kernel_build 1.2 s, ...` (and `total 9.8 s` once known): the
        readiness line's account."""
        return ", ".join(f"{p} {s:.1f} s" for p, s in self.series())


_TIMES = StartupTimes()


def get_startup_times() -> StartupTimes:
    return _TIMES


def reset_startup_times() -> StartupTimes:
    """A fresh record (a test, or an in-process server started again)."""
    global _TIMES
    _TIMES = StartupTimes()
    return _TIMES


_T0 = time.monotonic()       # fallback origin where the kernel's process start is unreadable


def process_age_s() -> float:
    """Seconds since this process started (Linux: its start time in /proc, so the interpreter's
    own start-up, imports and an allocator re-exec count); elsewhere since this module loaded."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        return age_from_stat(stat, time.clock_gettime(time.CLOCK_BOOTTIME),
                             os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, AttributeError):
        return time.monotonic() - _T0


def age_from_stat(stat: str, boottime_s: float, ticks_per_s: int) -> float:
    """Process age from a /proc/PID/stat line and the boot-time clock: field 22, `starttime`,
    is clock ticks after boot. NOTE: fields are counted after the last ')', since the command
    name (field 2) may hold spaces and parentheses."""
    fields = stat[stat.rindex(")") + 2:].split()
    start_ticks = int(fields[19])                # field 22 overall; field 3 is fields[0]
    return max(0.0, boottime_s - start_ticks / ticks_per_s)
