"""The C++ kernels' build cache survives a build killed midway (fault injection)."""
from __future__ import annotations

import fcntl
import subprocess
import sys

import pytest

from kvmesh.common.model_files import cache_dir
from kvmesh.kernels import cpu_kernels

LOAD = ("import sys; from kvmesh.kernels.cpu_kernels import load; "
        "sys.exit(0 if load() is not None else 1)")


def test_a_lock_left_by_a_killed_build_does_not_block_the_next_load():
    if cpu_kernels.load() is None:            # built (or loaded) here first
        pytest.skip(f"C++ kernels unavailable: {cpu_kernels.unavailable_reason()}")
    build_dir = cache_dir() / "cpu-kernels" / cpu_kernels.build_key()
    stale = build_dir / cpu_kernels.TORCH_LOCK
    # what a SIGKILLed build leaves: torch's lock file, with nobody building (the flock is
    # taken, as a builder would, so that no real build is under way while it is written)
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale.write_text("")
    # NOTE: without the fix the child waits on the lock forever; the timeout makes that a failure
    proc = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert f"removing {stale}, left by a C++ kernels build that did not finish" in proc.stderr
    assert not stale.exists()
