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

from pathlib import Path

from kvmesh.kernels import cpu_kernels

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "gemm.cpp", _CSRC / "tiled.cpp", _CSRC / "amx.cpp", _CSRC / "bindings.cpp")
HEADERS = (_CSRC / "gemm.h", _CSRC / "blocks.h", _CSRC / "simd.h", _CSRC / "tiled.h", _CSRC / "amx.h",
           _CSRC / "amx_tiles.h", cpu_kernels.ATEN_HEADER)
NAME = "kvmesh_quant_kernels"
SUBDIR = "quant-kernels"

# NOTE: a failed build means the GGUF tensors are served dequantized
_kernels = cpu_kernels.PathExtensions(NAME, SUBDIR, SOURCES, HEADERS, "quantized GEMM kernels")
_state = _kernels.state
load = _kernels.load
cached = _kernels.cached
unavailable_reason = _kernels.unavailable_reason


def build_key(path: str | None = None) -> str:
    return cpu_kernels.build_key(path, SOURCES, HEADERS)
