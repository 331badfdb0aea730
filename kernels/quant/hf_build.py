"""The Hugging Face quantized GEMMs' C++ extension (`csrc/hf_gemm.cpp`), built per machine.

The same machinery as `build.py` (the GGUF kernels) and the CPU kernels: `-march=native` (or a
narrower `cpu_kernels.PATHS` build for the tests), one cache key per sources, flags, torch and
CPU, one build lock, `KVMESH_CPU_KERNELS=0` turns it off. A separate extension from the GGUF
one, so neither rebuilds when the other changes.
"""
from __future__ import annotations

from pathlib import Path

from kvmesh.kernels import cpu_kernels

_CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (_CSRC / "hf_gemm.cpp", _CSRC / "hf_amx.cpp", _CSRC / "hf_bindings.cpp")
HEADERS = (_CSRC / "hf_gemm.h", _CSRC / "simd.h", _CSRC / "hf_amx.h", _CSRC / "amx_tiles.h",
           cpu_kernels.ATEN_HEADER)
NAME = "kvmesh_hfquant_kernels"
SUBDIR = "hfquant-kernels"

_kernels = cpu_kernels.PathExtensions(NAME, SUBDIR, SOURCES, HEADERS, "Hugging Face quantized GEMM kernels")
_state = _kernels.state
load = _kernels.load
cached = _kernels.cached
unavailable_reason = _kernels.unavailable_reason
