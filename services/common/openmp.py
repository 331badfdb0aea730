"""OpenMP's idle waiting in a server whose forward runs on a thread of its own.

GNU OpenMP (torch's libgomp) lets the workers of a team spin for a while between two parallel
regions (GOMP_SPINCOUNT, 300,000 rounds by default: ~3 ms) before they sleep on a futex. Once it
manages more threads than the process has CPUs, it spins 100 rounds only, so every parallel
region (~240 in a step of the built-in model) starts by waking a sleeping worker.

`kvmesh serve` had one team too many: the main thread (the event loop) runs oneDNN's probes at
import (kernels/linear.py), so its worker stays parked for good, while the engine thread runs the
forward with a team of its own: 3 managed threads on 2 CPUs. Measured (2 CPUs, load ~3, the
same engine stepping one sequence on a second thread): 33-38 ms a step with the main thread's
team parked, 22-24 ms once it is released and GOMP_SPINCOUNT is 10,000; with the default
300,000 released was 4-7x slower there (workers spinning ~3 ms on cores other processes want).

    serving_environment(env)  GOMP_SPINCOUNT=10000 unless OMP_WAIT_POLICY / GOMP_SPINCOUNT are
                              set: set before torch loads libgomp (`kvmesh serve` does it first)
    release_thread_team()     on a thread that will run no more forwards (the event loop, once
                              the engine is up): its parked workers exit, and it takes one
                              thread for any later parallel region, so it never parks one again
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

logger = logging.getLogger("kvmesh.openmp")

# ~0.1 ms of spinning: longer than the gaps between two parallel regions of a forward (the
# Python between two ops, 10-50 us), short enough that a worker parked between steps gives its
# core back at once on a machine it shares
SERVE_SPINCOUNT = "10000"
_OMP_PAUSE_SOFT = 1        # omp_pause_resource_t: omp_pause_soft


def serving_environment(env: dict[str, str]) -> dict[str, str]:
    """The variables to add to `env` for a server's OpenMP (none when the user chose a policy)."""
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    return {"GOMP_SPINCOUNT": SERVE_SPINCOUNT}


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
