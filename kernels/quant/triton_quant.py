"""Triton quantization of activations for the quantized GEMMs (`triton_gemm.py`), and the
number-format helpers both use: rounding half to even, float32 -> bfloat16, e4m3 <-> float32.

    scaled_int8_quant(x)   per row (token): scale = max|x| / 127, x / scale rounded half to even
    scaled_fp8_quant(x)    per tensor (or per token): scale = max|x| / 448, x / scale rounded to
                           nearest e4m3

Both round exactly as torch does (kernels/reference.py: bit for bit), on a GPU and in the
interpreter alike: the roundings are done in float32 / integer arithmetic, not by casts (the
interpreter's float32 -> bfloat16 and -> fp8 casts do not round to nearest even, and sm_80 has
no fp8 type).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_MAX = 448.0        # e4m3fn's largest finite value


@triton.jit
def round_half_even(v):
    """v rounded to an integer, half to even (float32, |v| < 2^22): the float32 ulp at the magic
    number is 1, so the add rounds, and the subtract is exact."""
    return (v + 12582912.0) - 12582912.0


@triton.jit
def round_to_bf16(v):
    """float32 v rounded to the nearest bfloat16, ties to even, still as float32.

    NOTE: only the interpreter path uses it: its float32 -> bfloat16 cast truncates, where a
    GPU's (cvt.rn) rounds to nearest even as torch does."""
    u = v.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def e4m3_bits_to_f32(b):
    """e4m3fn bytes (uint8) to their float32 values, exactly, in integer arithmetic: sm_80 has
    no fp8 type. Normal: (8 + m) * 2^(e - 10); subnormal (e = 0): m * 2^-9."""
    u = b.to(tl.int32)
    e = (u >> 3) & 0xF
    m = u & 7
    pow2 = ((tl.maximum(e, 1) + 117) << 23).to(tl.float32, bitcast=True)   # 2^(max(e, 1) - 10)
    mag = tl.where(e > 0, m + 8, m).to(tl.float32) * pow2
    return tl.where((u & 0x80) != 0, -mag, mag)


@triton.jit
def f32_to_e4m3_bits(y):
    """float32 y in [-448, 448] rounded to e4m3fn (nearest, ties to even) as its bits (int32).

    NOTE: done in integer arithmetic, not with a cast: the interpreter's float32 -> fp8 cast
    drops the carry of a mantissa that rounds up, and sm_80 has no fp8 type."""
    a = tl.abs(y)
    e = a.to(tl.int32, bitcast=True) >> 23                   # biased float32 exponent
    qe = tl.maximum(e, 121) - 3                               # the e4m3 step at a: 2^(qe - 127)
    step = (qe << 23).to(tl.float32, bitcast=True)
    inv = ((254 - qe) << 23).to(tl.float32, bitcast=True)     # 1 / step, exact
    m = round_half_even(a * inv)                             # 0..16 steps (16: the next binade)
    r = m * step                                              # the rounded |y|, exact
    ur = r.to(tl.int32, bitcast=True)
    re = ur >> 23
    bits = tl.where(re >= 121, ((re - 120) << 3) | ((ur >> 20) & 7), m.to(tl.int32))
    return tl.where(y.to(tl.int32, bitcast=True) < 0, bits | 0x80, bits)   # -0.0 keeps its sign


@triton.jit
def _rows_quant_kernel(
    x_ptr,          # [M, K] fp16 / bf16 / fp32
    q_ptr,          # [M, K] int8, or uint8 e4m3fn bits (FP8)
    scale_ptr,      # [M] float32: max|x[m]| / QMAX
    K,
    stride_xm, stride_xk, stride_qm,
    FP8: tl.constexpr,          # e4m3 (QMAX 448), else int8 (QMAX 127)
    BLOCK: tl.constexpr,
):
    """Per row (token), one program a row: the row's max, then its values."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        v = tl.load(x_row + (k0 + offs) * stride_xk, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    qmax: tl.constexpr = 448.0 if FP8 else 127.0
    scale = tl.math.div_rn(tl.max(amax, 0), qmax)
    div = tl.where(scale > 0, scale, 1.0)       # an all-zero row: scale 0, values 0
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        v = tl.load(x_row + (k0 + offs) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        y = tl.math.div_rn(v, div)
        if FP8:
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
            tl.store(q_ptr + row * stride_qm + k0 + offs, f32_to_e4m3_bits(y).to(tl.uint8), mask=mask)
        else:
            y = tl.minimum(tl.maximum(round_half_even(y), -127.0), 127.0)
            tl.store(q_ptr + row * stride_qm + k0 + offs, y.to(tl.int8), mask=mask)
    tl.store(scale_ptr + row, scale)


@triton.jit
def _fp8_quant_kernel(
    x_ptr,          # [M, K] fp16 / bf16 / fp32
    q_ptr,          # [M, K] uint8: e4m3fn bits
    scale_ptr,      # [1] float32: max|x| / 448
    K,
    stride_xm, stride_xk, stride_qm,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < K
    scale = tl.load(scale_ptr)
    div = tl.where(scale > 0, scale, 1.0)
    v = tl.load(x_ptr + row * stride_xm + offs * stride_xk, mask=mask, other=0.0).to(tl.float32)
    y = tl.minimum(tl.maximum(tl.math.div_rn(v, div), -448.0), 448.0)
    tl.store(q_ptr + row * stride_qm + offs, f32_to_e4m3_bits(y).to(tl.uint8), mask=mask)


# ---------------------------------------------------------------------------- launchers

def scaled_int8_quant(x: torch.Tensor,   # [M, K] float16 / bfloat16 / float32
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # (x_q [M, K] int8, x_scale [M] float32)
    """Per-row (per-token) symmetric int8: scale = max|x| / 127, x_q = round_half_even(x / scale)."""
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D float16 / bfloat16 / float32 tensor, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        _rows_quant_kernel[(m,)](x, q, scale, k, *x.stride(), q.stride(0), FP8=False, BLOCK=1024, num_warps=4)
    return q, scale


def scaled_fp8_quant(x: torch.Tensor,    # [M, K] float16 / bfloat16 / float32
                     per_token: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor]:  # (x_q [M, K] float8_e4m3fn, scale [1] / [M] float32)
    """e4m3 per tensor (per_token: per row): scale = max|x| / 448, x_q = x / scale rounded to
    nearest e4m3 (ties even)."""
    if x.dim() != 2 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a 2-D float16 / bfloat16 / float32 tensor, got {x.dtype} {tuple(x.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    if per_token:
        # NOTE: one launch for the rows' maxima and values: on an H100 the fp8 GEMM with this
        # done by torch ops took ~70 us at every decode shape (Llama-8B's, 1-16 rows) where
        # W8A8, whose quantization is one launch, took 22-60 us; in one launch, 22-62 us
        scale = torch.empty((m,), dtype=torch.float32, device=x.device)
        if m:
            _rows_quant_kernel[(m,)](x, q, scale, k, *x.stride(), q.stride(0), FP8=True, BLOCK=1024, num_warps=4)
        return q.view(torch.float8_e4m3fn), scale
    # NOTE: one torch reduction (no host sync) for the tensor's max; the kernel reads it on the
    # device. Divided by a tensor: CUDA divides by a Python scalar as a multiplication by its
    # reciprocal (1 ulp off torch's CPU division and the reference for some values)
    amax = x.abs().amax().float().reshape(1) if x.numel() else torch.zeros(1, device=x.device)
    scale = amax / torch.full_like(amax, _FP8_MAX)
    if x.numel():
        block = 1024
        _fp8_quant_kernel[(m, triton.cdiv(k, block))](x, q, scale, k, *x.stride(), q.stride(0),
                                                       BLOCK=block, num_warps=4)
    return q.view(torch.float8_e4m3fn), scale
