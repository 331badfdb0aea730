"""The C++ kernels' build cache survives a build killed midway (fault injection)."""
from __future__ import annotations

import fcntl
import subprocess
import sys

import pytest

from kvmesh.common.model_files import cache_dir
from kvmesh.kernels import cpu_kernels
from kvmesh.kernels.quant import build, hf_build

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


EXTENSIONS = {"cpu_kernels": (cpu_kernels.SOURCES, cpu_kernels.HEADERS), "quant": (build.SOURCES, build.HEADERS),
              "hf_quant": (hf_build.SOURCES, hf_build.HEADERS)}


@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_only_the_bindings_include_pybind11_and_every_local_header_is_in_the_build_key(name):
    """Each extension's kernel sources include ATen's own headers (csrc/aten.h), not
    <torch/extension.h> (~27 s of compile time a source); one source, the bindings, includes
    pybind11. And every header a source includes by quotes is one the build key hashes, so an
    edit to it rebuilds."""
    sources, headers = EXTENSIONS[name]
    modules = [s.name for s in sources if "PYBIND11_MODULE" in s.read_text()]
    assert len(modules) == 1 and modules[0].endswith("bindings.cpp")
    hashed = {h.resolve() for h in headers}
    for f in (*sources, *headers):
        includes = [line for line in f.read_text().splitlines() if line.startswith("#include")]
        heavy = any("<torch/extension.h>" in line or "pybind" in line for line in includes)
        assert heavy == (f.name == modules[0]), f
        for line in includes:
            if line.startswith('#include "'):
                included = (f.parent / line.split('"')[1]).resolve()
                assert included in hashed, f"{f.name} includes {included}, which the build key does not hash"
