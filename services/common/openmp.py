"""OpenMP's idle waiting in a server whose forward runs on a thread of its own.

GNU OpenMP (torch's libgomp) lets the workers of a team spin for a while between two parallel
regions (GOMP_SPINCOUNT, 300,000 rounds by default: ~3 ms) before they sleep on a futex. Once it
manages more threads than the process has CPUs, it spins 100 rounds only (1,000 with
OMP_WAIT_POLICY=ACTIVE), whatever GOMP_SPINCOUNT says, so every parallel region (~240 in a step
of the built-in model) starts by waking a sleeping worker.

`kvmesh serve` can have one team too many: where a parallel region runs on the main thread (the
event loop) before it serves, as oneDNN's probes at import (kernels/linear.py) did on the
AVX-512 Xeon, its worker stays parked for good, while the engine thread runs the forward with a
team of its own: 3 managed threads on 2 CPUs. (On an AVX2-only EPYC the import ran no parallel
region: the event loop had no team, and releasing it ended no thread.) An offline engine
stepping on its main thread has 2, and spins. Which one is faster depends on the machine:

- 2 CPUs, load ~2-3 (one engine stepping one sequence on a second thread, interleaved runs):
  33-46 ms a step throttled, 22-29 ms with the main thread's team released (GOMP_SPINCOUNT
  10,000, or libgomp's default in the main-thread run);
- the same at load ~4-5: 38-46 ms throttled, 100-140 ms released (workers spinning on cores
  other processes want; 10,000 or 300,000 rounds alike).

So the server keeps libgomp's own choice unless the operator asks for spinning with the standard
variables (GOMP_SPINCOUNT > 0 or OMP_WAIT_POLICY=ACTIVE, for dedicated cores): then the event
loop's team is released once the engine is up, and the spin count they set holds.

    spin_requested(env)       whether the environment asks for spinning workers
    process_thread_count()    the process's threads now (/proc/self/task)
    release_thread_team()     on a thread that will run no more forwards (the event loop): its
                              parked workers exit, and it takes one thread for any later
                              parallel region, so it never parks one again
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

logger = logging.getLogger("kvmesh.openmp")

_OMP_PAUSE_SOFT = 1        # omp_pause_resource_t: omp_pause_soft


def spin_requested(env: dict[str, str]) -> bool:
    """GOMP_SPINCOUNT above 0 (a number, or libgomp's "infinite"), or OMP_WAIT_POLICY=ACTIVE,
    unless OMP_WAIT_POLICY=PASSIVE (which libgomp lets win)."""
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    if policy == "passive":
        return False
    if policy == "active":
        return True
    count = env.get("GOMP_SPINCOUNT", "").strip().lower()
    if count in ("infinite", "infinity"):
        return True
    try:
        return float(count.rstrip("kmgt") or 0) > 0
    except ValueError:
        return False


def loaded_libgomp(maps: str | None = None) -> str | None:
    """The path of the libgomp this process has loaded (torch's own copy), or None."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)              # address perms offset dev inode path
        if len(fields) == 6 and Path(fields[5]).name.startswith("libgomp") \
                and ".so" in fields[5]:
            return fields[5]
    return None


def process_thread_count() -> int:
    """The threads this process has now (0 where /proc cannot tell)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 0


def release_thread_team(lib_path: str | None = None) -> bool:
    """Release the calling thread's OpenMP team and give it one thread from now on; False when
    no libgomp is loaded (another OpenMP runtime, or none) or it refused (inside a region)."""
    path = lib_path or loaded_libgomp()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path)
        lib.omp_set_num_threads(1)
        ok = lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    except (OSError, AttributeError) as e:
        logger.debug("OpenMP team not released: %s", e)
        return False
    return ok
