"""The quantized-GEMM C++ extension (`kernels/quant/csrc/`), built per machine like the CPU kernels.

It goes through `kvmesh.kernels.cpu_kernels.build_extension`: the same flags (`-march=native`,
so the int8 dot product is AVX-512 VNNI, AVX-VNNI, AVX2 or scalar, whatever this CPU has), the
same cache key (sources, headers, flags, torch version, this CPU's model and flags), the same
build lock, into `${KVMESH_CACHE_DIR:-~/.cache/kvmesh}/quant-kernels/<key>/`.
`KVMESH_CPU_KERNELS=0` turns it off too (GGUF models are then served dequantized).
"""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from kvmesh.kernels import cpu_kernels

log = logging.getLogger(__name__)

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "gemm.cpp",)
HEADERS = (_CSRC / "blocks.h",)
NAME = "kvmesh_quant_kernels"
SUBDIR = "quant-kernels"

_lock = threading.Lock()
_state: dict[str, object] = {}


def load():
    """The built extension, or None (disabled, no compiler, build error: logged once)."""
    with _lock:
        if "ext" in _state:
            return _state["ext"]
        # NOTE: a failed build means the GGUF tensors are served dequantized
        ext, _state["why"] = cpu_kernels.build_or_reason(
            lambda: cpu_kernels.build_extension(NAME, SUBDIR, SOURCES, HEADERS))
        if ext is None:
            log.warning("quantized GEMM kernels unavailable (%s)", _state["why"])
        _state["ext"] = ext
        return ext


def unavailable_reason() -> str | None:
    load()
    return _state.get("why")  # type: ignore[return-value]


def build_key() -> str:
    return cpu_kernels.build_key(None, SOURCES, HEADERS)
