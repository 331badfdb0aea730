"""The Hugging Face quantized GEMMs' C++ extension (`csrc/hf_gemm.cpp`), built per machine.

The same machinery as `build.py` (the GGUF kernels) and the CPU kernels: `-march=native` (or a
narrower `cpu_kernels.PATHS` build for the tests), one cache key per sources, flags, torch and
CPU, one build lock, `KVMESH_CPU_KERNELS=0` turns it off. A separate extension from the GGUF
one, so neither rebuilds when the other changes.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from kvmesh.kernels import cpu_kernels

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "hf_gemm.cpp",)
HEADERS = (_CSRC / "simd.h",)
NAME = "kvmesh_hfquant_kernels"
SUBDIR = "hfquant-kernels"

_lock = threading.Lock()
_state: dict[str | None, tuple[object | None, str | None]] = {}


def load(path: str | None = None):
    """The built extension (`path`: a `cpu_kernels.PATHS` name, None: native), or None
    (disabled, no compiler, a CPU without the path's flags, build error: logged once)."""
    with _lock:
        if path not in _state:
            missing = cpu_kernels.missing_flags(path) if path is not None else ()
            if missing:
                ext, why = None, f"the {path} path needs {', '.join(missing)}"
            else:
                # NOTE: one module name per path: two extensions of one name cannot share a process
                name = NAME if path is None else f"{NAME}_{path}"
                ext, why = cpu_kernels.build_or_reason(
                    lambda: cpu_kernels.build_extension(name, SUBDIR, SOURCES, HEADERS, path))
            if ext is None:
                log.warning("Hugging Face quantized GEMM kernels unavailable (%s)", why)
            _state[path] = (ext, why)
        return _state[path][0]


def unavailable_reason(path: str | None = None) -> str | None:
    load(path)
    return _state[path][1]
