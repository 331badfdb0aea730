"""Build, ahead of the tests that load them, the C++ kernel builds the kernel tests use, in a
background process at the lowest CPU priority.

    python tests/support/kernel_builds.py      # what the suite's session start runs (see below)

A fresh cache builds each narrower instruction-set path of the CPU kernels and of the quantized
GEMMs (`cpu_kernels.PATHS`) for its tests, 20-35 s each on two idle cores; the tests that load
them come a third of the way into `make test`, while the suite leaves much of the CPU idle (its
server tests wait on their processes). Started at the session's start under `nice -n 19`, the
builds take the idle CPU and any test that loads a build still under way waits for it on the
build's lock (`cpu_kernels.build_extension`), never building it twice. A build that fails here
fails again in its test, which reports it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

# (module, paths): the narrower builds the kernel tests load, in the order the tests load them
# (test_attention_amx, test_cpu_paths, test_hf_quant_gemm, test_quant_gemm). NOTE: not the native
# builds: the first engine of the session builds those within its first minute anyway, and the
# fault injection of tests/kernels/test_cpu_kernels_build.py needs nobody else at their lock
BUILDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("kvmesh.kernels.cpu_kernels", ("avx512_bf16", "avx512", "avx2", "portable")),
    ("kvmesh.kernels.quant.hf_build", ("avx2", "portable")),
    ("kvmesh.kernels.quant.build", ("avx2",)),
)
DISABLE_ENV = "KVMESH_TEST_BACKGROUND_BUILDS"     # "0": build in the tests, as they need them


def wanted(builds=BUILDS) -> list[tuple[str, str]]:
    """(module, path) pairs of `builds` this CPU can run (a path that narrows nothing is the native
    build here: not one of them)."""
    from kvmesh.kernels import cpu_kernels
    return [(module, path) for module, paths in builds for path in paths
            if cpu_kernels.PATHS[path][0] and not cpu_kernels.missing_flags(path)]


def start(items_paths: list[str]) -> subprocess.Popen | None:
    """Start the builder when the session runs kernel tests (and not disabled); None otherwise."""
    if os.environ.get(DISABLE_ENV) == "0":
        return None
    if not any(p.startswith("tests/kernels/") for p in items_paths):
        return None
    # NOTE: a process group of its own (stop() ends its compilers with it) but not a session:
    # Linux schedules each session as one group (autogroup) before any nice value counts, so a
    # new session's builds took half the CPU from the tests (the suite ran 1.7x slower). Its
    # output is dropped: a build that fails here fails again in the test that loads it.
    return subprocess.Popen(["nice", "-n", "19", sys.executable, __file__], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, process_group=0)


def stop(proc: subprocess.Popen | None) -> None:
    """End a builder still running when the session ends (its lock goes with it)."""
    if proc is None or proc.poll() is not None:
        return
    # NOTE: the compilers it started (ninja, c++) are in its process group
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


def main() -> int:
    import importlib
    for module, path in wanted():
        ext = importlib.import_module(module).load(path)
        print(f"{module} {path}: {'built' if ext is not None else 'unavailable'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
