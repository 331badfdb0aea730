"""The Triton GEMM for 8-bit group weights on the GPU: GGUF's block formats other than Q4_0 /
Q4_1 / Q4_K (Q8_0, Q5_x, Q6_K, Q2_K, Q3_K, IQ4), converted at load into one code a byte with a
scale and a zero point per 16 or 32 elements (`hf_weight.Int8GroupWeight`, `gguf_int8.py`).

    w8g_gemm(x, qweight, scales, zeros, group_size, bias)
        y [M, N] = x [M, K] @ ((q - zero) * scale)^T (+ bias), the weight rounded to x's dtype

Three routes, as `triton_gemm.w4a16_gemm`'s, each dequantizing in registers or for the call only
(the model holds the codes): up to W8G_GEMV_MAX_ROWS rows the GEMV kernel (contiguous code runs,
float32 FMAs, no tensor-core tile); below W8G_DEQUANT_MIN_ROWS the fused tensor-core kernel (a
[BLOCK_K, BLOCK_N] code tile dequantized in registers, tl.dot in x's dtype, float32
accumulation); from there the weight dequantized into a transient [N, K] buffer of x's dtype for
torch's dense GEMM. A tile's scales and zero points are gathered per column (GROUP, a
constexpr, is 16 or 32: a shift), so a step spans several groups. Reference:
`kvmesh.kernels.reference.w8g_gemm`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvmesh.kernels import paged_attention
from kvmesh.kernels.quant.triton_gemm import (GEMV_ROWS_LIMIT, _FLOAT_DTYPES, _check_bias_device, _check_rows,
                                              _check_x, _dot_precision, _out, _tiles, _to_operand, _to_output)

W8G_ROUTES = ("auto", "gemv", "kernel", "dequant")
W8G_GROUPS = (16, 32)
# NOTE: the int4 GEMM's thresholds, measured on an H100 for it (triton_gemm.W4A16_GEMV_MAX_ROWS,
# W4A16_DEQUANT_MIN_ROWS); these kernels have not been timed on a GPU yet
W8G_GEMV_MAX_ROWS = int(os.environ.get("KVMESH_W8G_GEMV_ROWS", "1"))
W8G_DEQUANT_MIN_ROWS = int(os.environ.get("KVMESH_W8G_DEQUANT_ROWS", "16"))


@triton.jit
def _dequant_tile(q_ptr, s_ptr, z_ptr, rows, col, mask, stride_qn, stride_sn, stride_zn,
                  GROUP: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """(q - zero) * scale in float32 of the codes at rows x col: [rows, col] if ROWS_FIRST, else
    [col, rows] (the tl.dot operand's orientation)."""
    if ROWS_FIRST:
        r = rows[:, None]
        c = col[None, :]
    else:
        r = rows[None, :]
        c = col[:, None]
    q = tl.load(q_ptr + r * stride_qn + c, mask=mask, other=0).to(tl.float32)
    g = c // GROUP
    scale = tl.load(s_ptr + r * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(z_ptr + r * stride_zn + g, mask=mask, other=0).to(tl.float32)
    return (q - zero) * scale


@triton.jit(do_not_specialize=["M", "stride_sn", "stride_zn", "stride_ym"])
def _w8g_kernel(
    x_ptr,          # [M, K] fp16 / bf16 / fp32 (any strides)
    q_ptr,          # [N, K] uint8 codes
    s_ptr,          # [N, K // GROUP] fp16 / fp32 scales
    z_ptr,          # [N, K // GROUP] zero points: uint8, or float32
    bias_ptr,       # [N] float, or None
    y_ptr,          # [M, N] x's dtype
    M, N, K,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_zn, stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,       # fp32 tl.dot operands (interpreter); else x's dtype
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    x_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        col = k0 + tl.arange(0, BLOCK_K)
        k_mask = col < K
        x = tl.load(x_rows + col[None, :] * stride_xk, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, rows, col, k_mask[:, None] & n_mask[None, :],
                          stride_qn, stride_sn, stride_zn, GROUP, False)              # [BLOCK_K, BLOCK_N]
        if UPCAST:
            x = x.to(tl.float32)
        acc = tl.dot(x, _to_operand(w, x_dtype, UPCAST), acc, input_precision=DOT_PRECISION)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, _to_output(acc, y_ptr.dtype.element_ty, UPCAST), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M", "stride_sn", "stride_zn", "stride_ym"])
def _w8g_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, bias_ptr, y_ptr,     # as _w8g_kernel's, M <= ROWS
    M, N, K,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_zn, stride_ym,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,         # a power of two >= M: every row of x in one program
    BLOCK_N: tl.constexpr,      # weight rows a program owns
    BLOCK_K: tl.constexpr,      # weight columns a step (contiguous bytes a row)
    UPCAST: tl.constexpr,
):
    """Decode-sized M: a program streams BLOCK_N code rows in BLOCK_K-byte runs, dequantizes each
    tile once in registers and multiplies every row of x with float32 FMAs (as the int4 GEMV)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_r = tl.arange(0, ROWS)
    x_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        col = k0 + tl.arange(0, BLOCK_K)
        k_mask = col < K
        w = _dequant_tile(q_ptr, s_ptr, z_ptr, rows, col, n_mask[:, None] & k_mask[None, :],
                          stride_qn, stride_sn, stride_zn, GROUP, True)               # [BLOCK_N, BLOCK_K]
        w = _to_operand(w, x_dtype, UPCAST).to(tl.float32)
        for r in tl.static_range(ROWS):
            if r < M:
                xr = tl.load(x_ptr + r * stride_xm + col * stride_xk, mask=k_mask, other=0.0).to(tl.float32)
                part = tl.sum(w * xr[None, :], axis=1)
                acc += tl.where(offs_r[:, None] == r, part[None, :], 0.0)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_r.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, _to_output(acc, y_ptr.dtype.element_ty, UPCAST), mask=(offs_r < M)[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["stride_sn", "stride_zn"])
def _dequant_w8g_kernel(
    q_ptr, s_ptr, z_ptr,
    w_ptr,          # [N, K] out: x's dtype, contiguous rows
    N, K,
    stride_qn, stride_sn, stride_zn, stride_wn,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = offs_n.to(tl.int64)
    mask = (offs_n < N)[:, None] & (col < K)[None, :]
    w = _dequant_tile(q_ptr, s_ptr, z_ptr, rows, col, mask, stride_qn, stride_sn, stride_zn, GROUP, True)
    tl.store(w_ptr + rows[:, None] * stride_wn + col[None, :], _to_output(w, w_ptr.dtype.element_ty, UPCAST),
             mask=mask)


def w8g_gemm(
    x: torch.Tensor,                  # [M, K] float16 / bfloat16 / float32
    qweight: torch.Tensor,            # [N, K] uint8 codes
    scales: torch.Tensor,             # [N, K // group_size] float16 / float32
    zeros: torch.Tensor,              # [N, K // group_size] uint8, or float32
    group_size: int,                  # 16 or 32
    bias: torch.Tensor | None = None,  # [N]
    *,
    route: str = "auto",              # "gemv", "kernel", "dequant", or "auto": by the rows
) -> torch.Tensor:                    # [M, N] x's dtype
    """y = x @ ((q - zero) * scale)^T + bias, the weight rounded to x's dtype."""
    if route not in W8G_ROUTES:
        raise ValueError(f"route must be one of {', '.join(W8G_ROUTES)}, got {route!r}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [N, K], got shape {tuple(qweight.shape)}")
    n, k = qweight.shape
    _check_x(x, k, f"qweight {list(qweight.shape)} holds K = {k}")
    if group_size not in W8G_GROUPS or k % group_size:
        raise ValueError(f"group_size must be 16 or 32 and divide K = {k}, got {group_size}")
    _check_rows(qweight, "qweight", (n, k), (torch.uint8,))
    _check_rows(scales, "scales", (n, k // group_size), (torch.float16, torch.float32))
    _check_rows(zeros, "zeros", (n, k // group_size), (torch.uint8, torch.float32))
    _check_bias_device(x, n, bias, qweight, scales, zeros)
    m = x.shape[0]
    if route == "gemv" and m > GEMV_ROWS_LIMIT:
        raise ValueError(f"the gemv route takes at most {GEMV_ROWS_LIMIT} rows, got {m}")
    if route == "dequant" or (route == "auto" and m >= W8G_DEQUANT_MIN_ROWS and n and k):
        return torch.nn.functional.linear(x, dequantize_w8g(qweight, scales, zeros, group_size, x.dtype), bias)
    y = _out(x, n)
    if m == 0 or n == 0:
        return y
    upcast = paged_attention.upcast_operands(x)
    strides = (*x.stride(), qweight.stride(0), scales.stride(0), zeros.stride(0), y.stride(0))
    if route == "gemv" or (route == "auto" and m <= min(W8G_GEMV_MAX_ROWS, GEMV_ROWS_LIMIT)):
        block_n = 8 if n <= 8192 else 16
        _w8g_gemv_kernel[(triton.cdiv(n, block_n),)](
            x, qweight, scales, zeros, bias, y, m, n, k, *strides, GROUP=group_size,
            ROWS=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=128, UPCAST=upcast, num_warps=2)
        return y
    block_m, block_n, warps, stages = _tiles(m, x.dtype)
    block_k = 32 if x.dtype == torch.float32 else 64
    _w8g_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, qweight, scales, zeros, bias, y, m, n, k, *strides, GROUP=group_size,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PRECISION=_dot_precision(upcast, x),
        UPCAST=upcast, num_warps=warps, num_stages=stages)
    return y


def dequantize_w8g(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """[N, K] dtype: (q - zero) * scale rounded to dtype (kernels/reference.py's dequantize_w8g).
    Inputs as w8g_gemm's, already checked there."""
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    n, k = qweight.shape
    w = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n, block_k = 32, 128
    _dequant_w8g_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        qweight, scales, zeros, w, n, k, qweight.stride(0), scales.stride(0), zeros.stride(0), w.stride(0),
        GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=paged_attention.upcast_operands(qweight),
        num_warps=4)
    return w
