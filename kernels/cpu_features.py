"""What this x86 CPU computes natively, from the kernel's view of it (/proc/cpuinfo's flags).

    cpu_flags()              {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", ...}
    native_bf16_flags()      the flags that make bfloat16 arithmetic native here (empty: none)

`--dtype auto` serves float32 checkpoints in bfloat16 only where the CPU has bf16 dot-product
instructions (AVX512-BF16's vdpbf16ps, AMX's bf16 tiles): elsewhere oneDNN emulates bf16 GEMMs
with float32 ones plus conversions, slower than float32 itself. The C++ kernels' build picks its
code path from the compiler's macros instead (kernels/csrc/vec.h); these flags tell the tests which
paths this CPU can run.
"""
from __future__ import annotations

import functools
from pathlib import Path

# Either makes bf16 matmuls native: AVX512-BF16 (vdpbf16ps) or AMX (bf16 tiles).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo does not exist: not Linux on x86)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def native_bf16_flags(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """Those of BF16_FLAGS this CPU (or `flags`) has, in that order."""
    have = cpu_flags() if flags is None else flags
    return tuple(f for f in BF16_FLAGS if f in have)
