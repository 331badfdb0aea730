"""The C++ CPU kernels (`kernels/csrc/`: attention, elementwise, sampling), built once per machine and cached.

    from kvmesh.kernels.cpu_kernels import load
    ext = load()          # the extension module, or None when it cannot be built here

The sources are compiled by torch's own extension builder (g++, `-O3 -march=native -fopenmp`)
into `${KVMESH_CACHE_DIR:-~/.cache/kvmesh}/cpu-kernels/<key>/`, where the key hashes the source,
the headers, the flags, the torch version and this CPU's model and flags, so a cache copied to another
machine is rebuilt rather than run with instructions it may lack. A first build takes ~30-60 s;
later processes load the cached library in milliseconds. `KVMESH_CPU_KERNELS=0` turns them off
(the engine then runs the pure-torch reference kernels).
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

from kvmesh.common.model_files import cache_dir

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = tuple(_CSRC / name for name in ("attention.cpp", "elementwise.cpp", "sampling.cpp", "bindings.cpp"))
HEADERS = tuple(_CSRC / name for name in ("kernels.h", "vec.h"))
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
NAME = "kvmesh_cpu_kernels"

TORCH_LOCK = "lock"      # torch.utils.cpp_extension's FileBaton in the build directory
_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_signature() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def build_key(sources: tuple[Path, ...] = SOURCES, headers: tuple[Path, ...] = HEADERS) -> str:
    h = hashlib.sha256()
    for src in (*sources, *headers):
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS).encode())
    h.update(torch.__version__.encode())
    h.update(_cpu_signature().encode())
    return h.hexdigest()[:16]


def enabled() -> bool:
    return os.environ.get("KVMESH_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def load():
    """The built extension, or None (disabled, no compiler, build error: logged once)."""
    with _lock:
        if "ext" in _state:
            return _state["ext"]
        ext = None
        if not enabled():
            _state["why"] = "KVMESH_CPU_KERNELS=0"
        elif shutil.which(os.environ.get("CXX", "c++")) is None:
            _state["why"] = "no C++ compiler (c++) on PATH"
        else:
            try:
                ext = _build()
            except Exception as e:   # noqa: BLE001 - any build failure means: run without them
                _state["why"] = f"build failed: {e}"
        if ext is None:
            log.warning("C++ CPU kernels unavailable (%s); using the torch reference kernels",
                        _state["why"])
        _state["ext"] = ext
        return ext


def unavailable_reason() -> str | None:
    load()
    return _state.get("why")  # type: ignore[return-value]


def _build():
    return build_extension(NAME, "cpu-kernels", SOURCES, HEADERS)


def build_extension(name: str, subdir: str, sources: tuple[Path, ...], headers: tuple[Path, ...]):
    """Compile (or load the cached build of) one extension: `sources` into
    `<cache>/<subdir>/<key>/`, under the build lock below. Other kernel folders (kernels/quant)
    build through here, so every C++ extension shares the flags, the key and the lock."""
    from torch.utils import cpp_extension

    build_dir = cache_dir() / subdir / build_key(sources, headers)
    build_dir.mkdir(parents=True, exist_ok=True)
    # NOTE: concurrent processes (a test run's workers, several servers) build once: the others
    # wait here and then load the result. torch's builder has a lock of its own, a plain file
    # that a build killed midway (OOM, SIGKILL, a restarted pod on a kept cache) leaves behind,
    # and every later load then waits on it forever. This flock is the kernel's: it goes with
    # its process, so whoever holds it knows a torch lock file still there is stale.
    with open(build_dir / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / TORCH_LOCK
        if stale.exists():
            log.warning("removing %s, left by a C++ kernels build that did not finish", stale)
            stale.unlink()
        return cpp_extension.load(name=name, sources=[str(s) for s in sources],
                                  extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                                  build_directory=str(build_dir), verbose=False)
