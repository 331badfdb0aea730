"""What this x86 CPU computes natively, from the kernel's view of it (/proc/cpuinfo's flags).

    cpu_flags()              {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", ...}
    native_bf16_flags()      the flags that make bfloat16 arithmetic native here (empty: none)
    onednn_allows_bf16()     whether ONEDNN_MAX_CPU_ISA (if set) still lets oneDNN use them

`--dtype auto` serves float32 checkpoints in bfloat16 only where the CPU has bf16 dot-product
instructions (AVX512-BF16's vdpbf16ps, AMX's bf16 tiles): elsewhere oneDNN emulates bf16 GEMMs
with float32 ones plus conversions, slower than float32 itself. The C++ kernels' build picks its
code path from the compiler's macros instead (kernels/csrc/vec.h); these flags tell the tests which
paths this CPU can run.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

# Either makes bf16 matmuls native: AVX512-BF16 (vdpbf16ps) or AMX (bf16 tiles).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")

# oneDNN's ISA names (its ONEDNN_MAX_CPU_ISA) at or above AVX512_CORE_BF16: the caps under which its
# GEMMs may still use bf16 dot products. A lower cap (AVX2, AVX512_CORE, ...) makes a wide CPU
# compute as a narrower one would: a benchmark's stand-in for an AVX2-only machine.
ONEDNN_BF16_ISAS = frozenset({
    "ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX512_CORE_AMX",
    "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16", "AVX10_2_512",
    "AVX10_2_512_AMX_2"})


@functools.lru_cache(maxsize=None)
def _cpuinfo_field(name: str) -> str:
    """The first /proc/cpuinfo line's value for `name` ("" where there is none, or no file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(name):
            return line.split(":", 1)[1].strip()
    return ""


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo does not exist: not Linux on x86)."""
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("AuthenticAMD", "GenuineIntel"; "" where there is none)."""
    return _cpuinfo_field("vendor_id")


def onednn_allows_bf16() -> bool:
    """Whether oneDNN may use bf16 dot products: ONEDNN_MAX_CPU_ISA (or its older name
    DNNL_MAX_CPU_ISA) unset or at least AVX512_CORE_BF16."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()
    return cap in ONEDNN_BF16_ISAS


def native_bf16_flags(flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """Those of BF16_FLAGS this CPU (or `flags`) has, in that order; for this CPU, none when
    ONEDNN_MAX_CPU_ISA keeps oneDNN below them."""
    if flags is None and not onednn_allows_bf16():
        return ()
    have = cpu_flags() if flags is None else flags
    return tuple(f for f in BF16_FLAGS if f in have)
