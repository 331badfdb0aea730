"""The quantized-GEMM C++ extension (`kernels/quant/csrc/`), built per machine like the CPU kernels.

It goes through `kvmesh.kernels.cpu_kernels.build_extension`: the same flags (`-march=native`,
so the int8 dot product is AVX-512 VNNI, AVX-VNNI, AVX2 or scalar, whatever this CPU has), the
same cache key (sources, headers, flags, torch version, this CPU's model and flags), the same
build lock, into `${KVMESH_CACHE_DIR:-~/.cache/kvmesh}/quant-kernels/<key>/`.
`KVMESH_CPU_KERNELS=0` turns it off too (GGUF models are then served dequantized).
`load("avx2")` (any `cpu_kernels.PATHS` name) builds the same sources for that narrower path,
under its own module name and cache entry, so the tests run every path this CPU has.
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from kvmesh.kernels import cpu_kernels

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "gemm.cpp", _CSRC / "tiled.cpp")
HEADERS = (_CSRC / "blocks.h", _CSRC / "simd.h", _CSRC / "tiled.h")
NAME = "kvmesh_quant_kernels"
SUBDIR = "quant-kernels"

_lock = threading.Lock()
_state: dict[str | None, dict[str, object]] = {}


def load(path: str | None = None):
    """The built extension (`path`: a `cpu_kernels.PATHS` name, None: native), or None
    (disabled, no compiler, a CPU without the path's flags, build error: logged once)."""
    with _lock:
        state = _state.setdefault(path, {})
        if "ext" in state:
            return state["ext"]
        if path is not None and cpu_kernels.missing_flags(path):
            ext, why = None, f"the {path} path needs {', '.join(cpu_kernels.missing_flags(path))}"
        else:
            # NOTE: a failed build means the GGUF tensors are served dequantized
            # NOTE: one module name per path: two extensions of one name cannot share a process.
            name = NAME if path is None else f"{NAME}_{path}"
            ext, why = cpu_kernels.build_or_reason(
                lambda: cpu_kernels.build_extension(name, SUBDIR, SOURCES, HEADERS, path))
        if ext is None:
            log.warning("quantized GEMM kernels unavailable (%s)", why)
        state["ext"], state["why"] = ext, why
        return ext


def unavailable_reason(path: str | None = None) -> str | None:
    load(path)
    return _state[path].get("why")  # type: ignore[return-value]


def build_key(path: str | None = None) -> str:
    return cpu_kernels.build_key(path, SOURCES, HEADERS)
