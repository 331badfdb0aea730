"""8-bit float KV codes in Triton kernels: a float becomes a code on the cache write, a code
widens back to a float where attention loads a K/V tile (`--kv-cache-dtype fp8`).

The kernels see an 8-bit cache as bytes (a uint8 view: `cache_bytes`) and do both conversions
with integer operations on the bits, so the same code compiles for sm_80 (which has no fp8
type in Triton) and sm_90, and runs in the interpreter:

  * widening: e5m2 is the top byte of a float16; e4m3fn's exponent and mantissa, shifted into
    a float16's, read as a float16 are the value / 2^8 (bias 7 against float16's 15), exact for
    every finite code, subnormals included (then float32, and the query's dtype: exact);
  * narrowing: |x| clamped to the largest finite code, then rounded to nearest even on the
    float32 bits (normal codes) or as a multiple of the smallest subnormal (below the smallest
    normal): the codes torch's conversion gives for the clamped value (`to_cache_codes`).

`KV_CODE` (a constexpr) names the cache's element type: 0 the model's dtype (nothing to do),
1 float8_e4m3fn, 2 float8_e5m2 (`kv_code`) as bytes; 3 / 4 the same caches handed to a reading
kernel as their fp8 type, widened by the GPU's own conversion (`kv_read`: compiled for sm_89 and
later, which convert a pair of codes in one instruction). The bit operations are ~10 integer
instructions a value: on an H100 a decode over codes widened that way took 0.95-1.0x the time
of one over bf16 at half the bytes, converted natively (and 128-token tiles) 0.72-0.76x
(docs/BENCHMARKS.md, "The 8-bit KV cache on an H100").
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvmesh.kernels.kv_cache_dtype import is_fp8

_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def kv_code(cache_dtype: torch.dtype) -> int:
    """KV_CODE of a cache's dtype: 0 for a float cache, 1 e4m3fn, 2 e5m2."""
    return _CODES.get(cache_dtype, 0)


def cache_bytes(cache: torch.Tensor) -> torch.Tensor:
    """What a kernel is handed for a cache: an 8-bit float cache as its bytes, others as they are."""
    return cache.view(torch.uint8) if is_fp8(cache.dtype) else cache


_NATIVE = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
# NOTE: sm_89 (Ada) and sm_90 have the e4m3 / e5m2 conversions; Triton refuses fp8e4nv before
NATIVE_MIN_ARCH = 89


def kv_read(cache: torch.Tensor, arch: int) -> tuple[torch.Tensor, int]:
    """(the tensor a reading kernel is handed, its KV_CODE) for a cache read on sm_<arch>: an
    8-bit cache as its own fp8 type (codes 3 / 4) where the compiled kernel converts natively,
    else as bytes widened by bit operations (1 / 2; the interpreter, sm_80); others as they are."""
    if not is_fp8(cache.dtype):
        return cache, 0
    if arch >= NATIVE_MIN_ARCH and os.environ.get("TRITON_INTERPRET") != "1":
        return cache, _NATIVE[cache.dtype]
    return cache.view(torch.uint8), _CODES[cache.dtype]


@triton.jit
def widen_codes(c, KV_CODE: tl.constexpr):
    """uint8 codes -> their float32 values (exact)."""
    h = c.to(tl.uint32)
    if KV_CODE == 1:
        h = ((h & 0x80) << 8) | ((h & 0x7F) << 7)
        return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    else:
        return (h << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def narrow_to_codes(x, KV_CODE: tl.constexpr):
    """float32 values -> uint8 codes: nearest even, saturated at the largest finite code."""
    if KV_CODE == 1:                       # e4m3fn: 3 mantissa bits, bias 7, max 448
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        TOP: tl.constexpr = 448.0
        MIN_NORMAL: tl.constexpr = 0.015625            # 2^-6
        PER_SUBNORMAL: tl.constexpr = 512.0            # 1 / 2^-9
    else:                                  # e5m2: 2 mantissa bits, bias 15, max 57344
        MANT: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        TOP: tl.constexpr = 57344.0
        MIN_NORMAL: tl.constexpr = 0.00006103515625    # 2^-14
        PER_SUBNORMAL: tl.constexpr = 65536.0          # 1 / 2^-16
    SHIFT: tl.constexpr = 23 - MANT
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.minimum(tl.abs(x), TOP)
    # NOTE: a * PER_SUBNORMAL < 8 is exact; adding and taking away 2^23 rounds it to the
    # nearest integer, ties to even (float32 has no fraction bits left at 2^23)
    sub = ((a * PER_SUBNORMAL + 8388608.0) - 8388608.0).to(tl.uint32)
    ab = a.to(tl.uint32, bitcast=True)
    rounded = (ab + ((1 << (SHIFT - 1)) - 1) + ((ab >> SHIFT) & 1)) >> SHIFT
    normal = rounded - ((127 - BIAS) << MANT)   # float32's exponent bias to the code's
    return (sign | tl.where(a < MIN_NORMAL, sub, normal)).to(tl.uint8)
