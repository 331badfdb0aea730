"""Triton GEMMs for quantized weights on the GPU: W4A16 (AWQ / GPTQ), W8A8 int8 and FP8 e4m3.

    y [M, N] = x [M, K] @ W [N, K]^T (+ bias [N]), in x's dtype (float16 / bfloat16 / float32)

The weights are in the canonical layout every Hugging Face quantized checkpoint is converted to
at load (docs/KERNELS.md, "Hugging Face quantized checkpoints on the GPU"); each kernel reads
them as stored and dequantizes a tile at a time in registers, never a copy of the matrix.

    w4a16_gemm   int4 groups with zero points: (q - zero) * scale, rounded to x's dtype, tl.dot
                 in x's dtype with float32 accumulation (float32 x: fp32 operands, tf32 off)
    w8a8_gemm    x quantized per row to int8 (scaled_int8_quant), int8 tl.dot into int32,
                 then * x_scale[m] * w_scale[n]
    fp8_gemm     sm_89+: x cast to e4m3 per tensor or per token (scaled_fp8_quant), fp8 tl.dot,
                 then * x_scale * w_scale; weight-only checkpoints, and sm_80 (no fp8 MMA nor
                 fp8 type): the weight tile widened to x's dtype in registers and multiplied
                 with x as it is

A program owns BLOCK_M rows and BLOCK_N columns of y and walks K; decode-sized M gets 16-row,
32-column tiles (more programs over N), larger M 64 x 128 (`_tiles`). W4A16 at a few rows
(W4A16_GEMV_MAX_ROWS) skips the tensor cores: `_w4a16_gemv_kernel` streams the packed rows
in wide contiguous runs and multiplies with float32 FMAs (`_gemv_tiles`). References:
`kvmesh.kernels.reference` (w4a16_gemm, w8a8_gemm, fp8_gemm). The activation quantizations and
the number-format helpers: `triton_quant.py`.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvmesh.kernels import paged_attention
from kvmesh.kernels.quant.triton_quant import (e4m3_bits_to_f32, round_to_bf16, scaled_fp8_quant,
                                                 scaled_int8_quant)

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8_MMA_K = 32         # K of one fp8 MMA instruction (sm_89 / sm_90)
W4A16_ROUTES = ("auto", "gemv", "kernel", "dequant")
# NOTE: rows up to which w4a16_gemm runs the GEMV kernel (no tensor-core tile) where the fused
# kernel would not split K; on an H100 (2026-11-27, Llama-8B shapes, bf16, CUDA graphs) it took
# 0.56-0.76x the fused kernel's time at 1 row (qkv 20.6 us against 36.9, o 19.1 against 32.5,
# gate_up 64.6 against 85.0) and 1.15-2.25x at 4-8 rows with the sweep's best tiles
# (benchmarks/quant_gemm_gpu.py)
W4A16_GEMV_MAX_ROWS = int(os.environ.get("KVMESH_W4A16_GEMV_ROWS", "1"))
# NOTE: rows from which w4a16_gemm dequantizes into a buffer for cuBLAS instead of running the
# fused kernel; on an H100 (2026-11-26, Llama-8B shapes, bf16) the fused kernel took 2.1-4.6x
# cuBLAS's dense time at 16 rows and 6-25x from 64 (benchmarks/quant_gemm_gpu.py)
W4A16_DEQUANT_MIN_ROWS = int(os.environ.get("KVMESH_W4A16_DEQUANT_ROWS", "16"))


@triton.jit
def _to_operand(w, x_dtype: tl.constexpr, UPCAST: tl.constexpr):
    """A float32 weight tile as the tl.dot operand for activations of x_dtype."""
    if UPCAST:
        if x_dtype == tl.bfloat16:
            return round_to_bf16(w)
        return w.to(x_dtype).to(tl.float32)
    return w.to(x_dtype)


@triton.jit
def _x_columns(perm_ptr, col):
    """x's columns for the weight columns col (even) and col + 1 (odd): through GPTQ's act-order
    permutation where there is one."""
    col_even = col
    col_odd = col + 1
    if perm_ptr is not None:
        col_even = tl.load(perm_ptr + col_even)
        col_odd = tl.load(perm_ptr + col_odd)
    return col_even, col_odd


@triton.jit
def _to_output(acc, y_dtype: tl.constexpr, UPCAST: tl.constexpr):
    """The float32 result tile cast for the store (rounded to nearest even in the interpreter too)."""
    if UPCAST and y_dtype == tl.bfloat16:
        acc = round_to_bf16(acc)
    return acc.to(y_dtype)


# NOTE: M changes every step and the scale strides (K / group_size) with the model; not
# specialising them (16-divisible or not) keeps one compiled kernel per tile choice
@triton.jit(do_not_specialize=["M", "group_size", "stride_sn", "stride_zn", "stride_ys"])
def _w4a16_kernel(
    x_ptr,          # [M, K] fp16 / bf16 / fp32 (any strides)
    q_ptr,          # [N, K // 2] uint8: weight k in byte k // 2, even k low nibble, odd k high
    s_ptr,          # [N, K // group_size] fp16 / bf16 / fp32 scales
    z_ptr,          # [N, K // group_size] zero points: uint8 0..15, or float32 (GGUF Q4_1: -min / d)
    perm_ptr,       # [K] int64: x column of weight column k (GPTQ act-order), or None
    bias_ptr,       # [N] float, or None
    y_ptr,          # [M, N] x's dtype; SPLIT: [splits, M, N] float32 partial sums
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_zn, stride_ym,
    k_split,        # columns a program walks (a multiple of BLOCK_K); K when not split
    stride_ys,      # SPLIT: elements between two splits' partial sums
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,      # weight columns a step; divides group_size (one group a step)
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,       # fp32 tl.dot operands (interpreter); else x's dtype
    SPLIT: tl.constexpr,        # K split over program_id(2): partial sums out, no bias
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_begin = tl.program_id(2) * k_split
    k_len = tl.minimum(K - k_begin, k_split)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_h = tl.arange(0, BLOCK_K // 2)         # byte h of a step holds columns 2h and 2h + 1
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm                        # [BLOCK_M, 1]
    q_ptrs = q_ptr + offs_n.to(tl.int64)[None, :] * stride_qn + offs_h[:, None]       # [BLOCK_K/2, BLOCK_N]
    s_ptrs = s_ptr + offs_n.to(tl.int64) * stride_sn                                  # [BLOCK_N]
    z_ptrs = z_ptr + offs_n.to(tl.int64) * stride_zn
    x_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # NOTE: the even and the odd columns are two tl.dot of half the step each, so the nibbles
    # never need interleaving in registers: x is read at stride 2 instead
    for kk in range(0, k_len, BLOCK_K):
        k0 = k_begin + kk
        col = k0 + 2 * offs_h
        col_even, col_odd = _x_columns(perm_ptr, col)
        x_even = tl.load(x_rows + col_even[None, :] * stride_xk, mask=m_mask[:, None], other=0.0)
        x_odd = tl.load(x_rows + col_odd[None, :] * stride_xk, mask=m_mask[:, None], other=0.0)
        packed = tl.load(q_ptrs + k0 // 2, mask=n_mask[None, :], other=0)
        g = k0 // group_size
        scale = tl.load(s_ptrs + g, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        zero = tl.load(z_ptrs + g, mask=n_mask, other=0).to(tl.float32)[None, :]
        w_even = _to_operand(((packed & 0xF).to(tl.float32) - zero) * scale, x_dtype, UPCAST)
        w_odd = _to_operand(((packed >> 4).to(tl.float32) - zero) * scale, x_dtype, UPCAST)
        if UPCAST:
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
        acc = tl.dot(x_even, w_even, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(x_odd, w_odd, acc, input_precision=DOT_PRECISION)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    if SPLIT:
        tl.store(y_ptrs + tl.program_id(2).to(tl.int64) * stride_ys, acc, mask=m_mask[:, None] & n_mask[None, :])
    else:
        if bias_ptr is not None:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, _to_output(acc, y_ptr.dtype.element_ty, UPCAST), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M", "group_size", "stride_sn", "stride_zn"])
def _w4a16_gemv_kernel(
    x_ptr,          # [M, K] fp16 / bf16 / fp32 (any strides), M <= ROWS
    q_ptr,          # [N, K // 2] uint8 (as _w4a16_kernel)
    s_ptr,          # [N, K // group_size] scales
    z_ptr,          # [N, K // group_size] zero points: uint8, or float32 (FLOAT_ZERO)
    perm_ptr,       # [K] int64 (GPTQ act-order), or None
    bias_ptr,       # [N] float, or None
    y_ptr,          # [M, N] x's dtype
    M, N, K, group_size,
    stride_xm, stride_xk, stride_qn, stride_sn, stride_zn, stride_ym,
    ROWS: tl.constexpr,         # a power of two >= M: every row of x in one program
    BLOCK_N: tl.constexpr,      # weight rows a program owns
    BLOCK_K: tl.constexpr,      # weight columns a step: a power of two dividing group_size
    UPCAST: tl.constexpr,       # the interpreter: bf16 rounded by hand
    FLOAT_ZERO: tl.constexpr,   # float zero points: q, then q - zero (an integer one folds into 2^23)
):
    """Decode-sized M: no tensor-core tile, whose 16 rows would be mostly padding. A program
    streams BLOCK_N weight rows in contiguous BLOCK_K / 2-byte runs (one group a step: one scale
    and zero point a row), dequantizes them once in registers and multiplies each row of x in
    turn with float32 FMAs, reducing along K in registers.

    NOTE: a nibble becomes a float with an OR and a subtraction, not a conversion instruction:
    the bits 0x4B000000 | q are the float 2^23 + q, and (2^23 + q) - (2^23 + zero) = q - zero
    exactly; x's rows are a static loop over the one dequantized tile (a [ROWS, BLOCK_N,
    BLOCK_K] product had each thread dequantize its weights once per row of x)."""
    pid_n = tl.program_id(0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_r = tl.arange(0, ROWS)
    offs_h = tl.arange(0, BLOCK_K // 2)        # byte h of a step: columns 2h and 2h + 1
    rows = offs_n.to(tl.int64)
    q_ptrs = q_ptr + rows[:, None] * stride_qn + offs_h[None, :]                  # [BLOCK_N, BLOCK_K/2]
    s_ptrs = s_ptr + rows * stride_sn
    z_ptrs = z_ptr + rows * stride_zn
    x_dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        col = k0 + 2 * offs_h
        col_even, col_odd = _x_columns(perm_ptr, col)
        packed = tl.load(q_ptrs + k0 // 2, mask=n_mask[:, None], other=0).to(tl.int32)
        g = k0 // group_size
        scale = tl.load(s_ptrs + g, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        zero = tl.load(z_ptrs + g, mask=n_mask, other=0).to(tl.float32)[:, None]
        if FLOAT_ZERO:      # 2^23 + zero would round a fractional zero: take q out first
            lo = (((packed & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) - zero
            hi = (((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0) - zero
        else:
            bias23 = zero + 8388608.0
            lo = ((packed & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - bias23
            hi = ((packed >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - bias23
        # the weights rounded to x's dtype as the fused kernel's operands, float32 for the FMAs
        w_even = _to_operand(lo * scale, x_dtype, UPCAST).to(tl.float32)
        w_odd = _to_operand(hi * scale, x_dtype, UPCAST).to(tl.float32)
        for r in tl.static_range(ROWS):
            if r < M:
                x_even = tl.load(x_ptr + r * stride_xm + col_even * stride_xk).to(tl.float32)
                x_odd = tl.load(x_ptr + r * stride_xm + col_odd * stride_xk).to(tl.float32)
                part = tl.sum(w_even * x_even[None, :] + w_odd * x_odd[None, :], axis=1)
                acc += tl.where(offs_r[:, None] == r, part[None, :], 0.0)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_r.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, _to_output(acc, y_ptr.dtype.element_ty, UPCAST), mask=(offs_r < M)[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["total"])
def _split_k_reduce_kernel(
    p_ptr,          # [splits, M, N] float32 partial sums (contiguous)
    bias_ptr,       # [N] or None
    y_ptr,          # [M, N] contiguous, x's dtype
    total, N,       # M * N, N
    SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """y = sum of the splits' partials in split order (deterministic), + bias, cast once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(p_ptr + s * total + offs, mask=mask, other=0.0)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, _to_output(acc, y_ptr.dtype.element_ty, UPCAST), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _scaled_gemm_kernel(
    x_ptr,          # [M, K] int8 (W8A8), fp8e4nv (FP8 on sm_89+) or fp16/bf16/fp32 (FP8 weight-only)
    w_ptr,          # [N, K] int8, fp8e4nv, or uint8 e4m3fn bits (weight-only)
    x_scale_ptr,    # [M] (W8A8) or [1] (FP8) float32, or None (weight-only)
    w_scale_ptr,    # [N] or [1] float32 (stride_ws 0 for one scale)
    bias_ptr,       # [N] float, or None
    y_ptr,          # [M, N]
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_xs, stride_ws, stride_ym,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    WEIGHT_ONLY: tl.constexpr,  # w holds e4m3 bits, widened to x's dtype here (sm_80)
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,       # the interpreter: fp32 tl.dot operands for float tiles
    IMPRECISE_ACC: tl.constexpr,  # fp8 operands: products summed in the MMA's own precision at most
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk   # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]               # [BLOCK_K, BLOCK_N]
    x_dtype = x_ptr.dtype.element_ty
    integer: tl.constexpr = x_dtype == tl.int8
    if integer:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if WEIGHT_ONLY:
            b = _to_operand(e4m3_bits_to_f32(b), x_dtype, UPCAST)
        if UPCAST and not integer:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION, max_num_imprecise_acc=IMPRECISE_ACC,
                     out_dtype=acc.dtype)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K
    out = acc.to(tl.float32)
    if x_scale_ptr is not None:
        out = out * tl.load(x_scale_ptr + offs_m * stride_xs, mask=m_mask, other=0.0)[:, None]
    out = out * tl.load(w_scale_ptr + offs_n * stride_ws, mask=n_mask, other=0.0)[None, :]
    if bias_ptr is not None:
        out += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, _to_output(out, y_ptr.dtype.element_ty, UPCAST), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["group_size", "stride_sn", "stride_zn"])
def _dequant_int4_kernel(
    q_ptr,          # [N, K // 2] uint8 (as _w4a16_kernel)
    s_ptr,          # [N, K // group_size] scales
    z_ptr,          # [N, K // group_size] zero points, uint8 or float32
    w_ptr,          # [N, K] out: x's dtype, contiguous rows
    N, group_size,
    stride_qn, stride_sn, stride_zn, stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,      # divides group_size: a program's columns share one scale a row
    UPCAST: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)
    packed = tl.load(q_ptr + rows[:, None] * stride_qn + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :],
                     mask=n_mask[:, None], other=0)                              # [BLOCK_N, BLOCK_K / 2]
    g = k0 // group_size
    scale = tl.load(s_ptr + rows * stride_sn + g, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    zero = tl.load(z_ptr + rows * stride_zn + g, mask=n_mask, other=0).to(tl.float32)[:, None]
    lo = ((packed & 0xF).to(tl.float32) - zero) * scale        # columns 2h
    hi = ((packed >> 4).to(tl.float32) - zero) * scale         # columns 2h + 1
    w = tl.reshape(tl.join(lo, hi), [BLOCK_N, BLOCK_K])        # interleaved: column 2h + j
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], _to_output(w, w_ptr.dtype.element_ty, UPCAST),
             mask=n_mask[:, None])


# ---------------------------------------------------------------------------- launchers

def _tiles(m: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for M rows whose tl.dot operands are `dtype`.

    NOTE: decode batches (M <= 16) read every weight once for a few rows; 32-column tiles give
    4x the programs of 128-column ones, so a 4096-row weight spreads over 128 programs (more
    SMs streaming it) instead of 32. Larger M reuses each weight tile over 64 rows, with 8 warps
    (4 held 254 registers a thread on sm_80 with the W4A16 dequantized tiles). fp32 operands
    run on FMA units, not tensor cores, and hold their K steps in registers: 32 x 64 tiles over
    32-column steps with 8 warps (64 x 128 over 64 spilled 11 KB; 32 x 64 over 64, 136-240 B;
    4 warps, 24 B on sm_90)."""
    if m <= 16:
        return 16, 32, 4, 4
    if dtype == torch.float32:
        return 32, 64, 8, 2
    return 64, 128, 8, 3


def _check_x(x: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[1] != k:
        raise ValueError(f"x has K = {x.shape[1]} columns but {what}")


def _check_rows(t: torch.Tensor, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """A weight-side tensor: exact shape, one of dtypes, unit stride along its last dimension."""
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must be {list(shape)}, got {list(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d).removeprefix('torch.') for d in dtypes)}, "
                         f"got {str(t.dtype).removeprefix('torch.')}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along its last dimension")


def _check_bias_device(x: torch.Tensor, n: int, bias: torch.Tensor | None, *tensors: torch.Tensor) -> None:
    if bias is not None:
        _check_rows(bias, "bias", (n,), _FLOAT_DTYPES)
    if any(t is not None and t.device != x.device for t in (*tensors, bias)):
        raise ValueError("x and every weight tensor must be on one device")


def _out(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)


def _dot_precision(upcast: bool, x: torch.Tensor) -> str:
    return "ieee" if upcast else paged_attention.dot_precision(x.dtype)


def w4a16_gemm(
    x: torch.Tensor,                  # [M, K] float16 / bfloat16 / float32
    qweight: torch.Tensor,            # [N, K // 2] uint8, two 4-bit weights a byte (even k low)
    scales: torch.Tensor,             # [N, K // group_size] float16 / bfloat16 / float32
    zeros: torch.Tensor,              # [N, K // group_size] uint8 0..15, or float32 (GGUF Q4_1)
    group_size: int,                  # a multiple of 32 dividing K (AWQ / GPTQ: 32, 64, 128; GGUF 32)
    perm: torch.Tensor | None = None,  # [K] int64: GPTQ act-order, x[:, perm] is multiplied
    bias: torch.Tensor | None = None,  # [N]
    *,
    route: str = "auto",              # "gemv", "kernel", "dequant", or "auto": by the rows
    split_k: int | None = None,       # the fused kernel's K splits (None: _split_k's choice)
    gemv_tiles: tuple[int, ...] | None = None,  # (BLOCK_N, BLOCK_K, num_warps[, stages]); None: _gemv_tiles
) -> torch.Tensor:                    # [M, N] x's dtype
    """y = x[:, perm] @ ((q - zero) * scale)^T + bias, the weight rounded to x's dtype
    (kvmesh.kernels.reference.w4a16_gemm).

    Three routes, each dequantizing in registers or for the call only (the model holds the
    packed weight): up to W4A16_GEMV_MAX_ROWS rows, where K is not split, the GEMV kernel
    (float32 FMAs over contiguous weight runs); below W4A16_DEQUANT_MIN_ROWS the fused
    tensor-core kernel; from there the weight dequantized into a transient [N, K] buffer of x's
    dtype and multiplied by torch's dense GEMM (cuBLAS), as vLLM does for AWQ batches from 256
    tokens."""
    if route not in W4A16_ROUTES:
        raise ValueError(f"route must be one of {', '.join(W4A16_ROUTES)}, got {route!r}")
    n = qweight.shape[0] if qweight.dim() == 2 else -1
    k = 2 * qweight.shape[1] if qweight.dim() == 2 else -1
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D [N, K // 2], got shape {tuple(qweight.shape)}")
    _check_x(x, k, f"qweight {list(qweight.shape)} packs K = {k}")
    if not isinstance(group_size, int) or group_size <= 0 or group_size % 32 or k % group_size:
        raise ValueError(f"group_size must be a positive multiple of 32 that divides K = {k}, got {group_size}")
    _check_rows(qweight, "qweight", (n, k // 2), (torch.uint8,))
    _check_rows(scales, "scales", (n, k // group_size), _FLOAT_DTYPES)
    _check_rows(zeros, "zeros", (n, k // group_size), (torch.uint8, torch.float32))
    if perm is not None:
        _check_rows(perm, "perm", (k,), (torch.int64,))
    _check_bias_device(x, n, bias, qweight, scales, zeros, perm)
    if route == "dequant" or (route == "auto" and x.shape[0] >= W4A16_DEQUANT_MIN_ROWS and n and k):
        xs = x if perm is None else x.index_select(1, perm)      # act-order: x's columns, not W's
        return torch.nn.functional.linear(xs, dequantize_int4(qweight, scales, zeros, group_size, x.dtype), bias)
    y = _out(x, n)
    if x.shape[0] == 0 or n == 0:
        return y
    upcast = paged_attention.upcast_operands(x)
    block_m, block_n, warps, stages = _tiles(x.shape[0], x.dtype)
    block_k = 64 if group_size % 64 == 0 and x.dtype != torch.float32 else 32
    m = x.shape[0]
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    steps = k // block_k
    splits = _split_k(tiles, steps, x.device) if split_k is None else min(max(int(split_k), 1), steps)
    # NOTE: where K is long enough to split (Llama-8B's down, K = 14336), the split fused kernel
    # beat the GEMV at 1 row on an H100: 46.1 us against 60.5
    if route == "gemv" or (route == "auto" and m <= min(W4A16_GEMV_MAX_ROWS, GEMV_ROWS_LIMIT) and splits == 1):
        _launch_gemv(x, qweight, scales, zeros, group_size, perm, bias, y, gemv_tiles)
        return y
    k_split = triton.cdiv(steps, splits) * block_k
    splits = triton.cdiv(k, k_split)                 # no empty split
    out = y if splits == 1 else torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    _w4a16_kernel[grid](
        x, qweight, scales, zeros, perm, bias, out, m, n, k, group_size,
        *x.stride(), qweight.stride(0), scales.stride(0), zeros.stride(0), n if splits > 1 else y.stride(0),
        k_split, m * n,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=_dot_precision(upcast, x), UPCAST=upcast, SPLIT=splits > 1,
        num_warps=warps, num_stages=stages,
    )
    if splits > 1:
        block = 1024
        _split_k_reduce_kernel[(triton.cdiv(m * n, block),)](out, bias, y, m * n, n, SPLITS=splits, BLOCK=block,
                                                             UPCAST=upcast, num_warps=4)
    return y


GEMV_ROWS_LIMIT = 16    # the widest ROWS the GEMV kernel is built for (its registers grow with it)


def _gemv_tiles(n: int) -> tuple[int, ...]:
    """(BLOCK_N, BLOCK_K, num_warps[, num_stages]) of the GEMV kernel for n weight rows, however
    many rows x has; BLOCK_K is cut to the largest power of two dividing the group size (one
    group a step).

    NOTE: from the sweep on an H100 (2026-11-27, bf16, group size 128, 1 row, CUDA graphs;
    `benchmarks/quant_gemm_gpu.py --gemv-sweep --cudagraph`): 2 warps over 8 weight rows were
    within 3% of each shape's best up to N = 6144 (qkv 20.6 us, best 20.1; o 19.1, best 18.3)
    and 16 rows at N = 28672 (gate_up 64.6 us, the best; 8 rows there: 74.7); one group a step
    is 64 contiguous bytes a row; num_stages changed nothing (no tl.dot to pipeline)."""
    return (8 if n <= 8192 else 16), 128, 2


def _launch_gemv(x, qweight, scales, zeros, group_size, perm, bias, y, tiles) -> None:
    m, k = x.shape
    n = qweight.shape[0]
    if m > GEMV_ROWS_LIMIT:
        raise ValueError(f"the gemv route takes at most {GEMV_ROWS_LIMIT} rows, got {m}")
    rows = triton.next_power_of_2(m)
    block_n, block_k, warps, *stages = _gemv_tiles(n) if tiles is None else tiles
    if block_k < 32 or block_k & (block_k - 1) or block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"gemv_tiles needs powers of two, BLOCK_K >= 32: got {tiles}")
    block_k = math.gcd(block_k, group_size)         # one group a step (group_size: 32 a unit)
    _w4a16_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, qweight, scales, zeros, perm, bias, y, m, n, k, group_size,
        *x.stride(), qweight.stride(0), scales.stride(0), zeros.stride(0), y.stride(0),
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=paged_attention.upcast_operands(x),
        FLOAT_ZERO=zeros.dtype == torch.float32, num_warps=warps, num_stages=stages[0] if stages else 3,
    )


_SM_COUNT: dict[int, int] = {}
_SPLIT_MIN_STEPS = 128  # K steps from which the decode kernel splits K
_SPLIT_STEPS = 32       # K steps a split walks


def _split_k(tiles: int, steps: int, device: torch.device) -> int:
    """K splits for the fused W4A16 kernel: ~32 K steps a split, for long K (>= 128 steps) when
    the output tiles (decode: N / 32) number under two a streaming multiprocessor.

    NOTE: measured on an H100 (2026-11-26, Llama-8B's projections, bf16, do_bench in eager mode):
    `down` (K = 14336, 224 steps, 128 tiles) took 167 us unsplit at 1 row and 54 us split 8
    ways (dense bf16: 56); at K = 4096 (64 steps) every split cost more than it saved: the
    partial-sum buffer and the reduce kernel's launch (qkv 51 us unsplit, 85-167 split)."""
    if device.type != "cuda" or steps < _SPLIT_MIN_STEPS:
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    if tiles >= 2 * _SM_COUNT[index]:
        return 1
    return min(triton.cdiv(steps, _SPLIT_STEPS), 16)


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """[N, K] dtype: (q - zero) * scale rounded to dtype (kernels/reference.py's dequantize_int4).
    Inputs as w4a16_gemm's, already checked there (group_size a multiple of 32 dividing K)."""
    n, k = qweight.shape[0], 2 * qweight.shape[1]
    w = torch.empty((n, k), dtype=dtype, device=qweight.device)
    block_n = 32
    block_k = next(b for b in (128, 64, 32) if group_size % b == 0)
    grid = (triton.cdiv(n, block_n), k // block_k)
    _dequant_int4_kernel[grid](qweight, scales, zeros, w, n, group_size, qweight.stride(0),
                               scales.stride(0), zeros.stride(0), w.stride(0), BLOCK_N=block_n,
                               BLOCK_K=block_k, UPCAST=paged_attention.upcast_operands(qweight), num_warps=4)
    return w


def _launch_scaled(x, w, x_scale, w_scale, bias, y, weight_only: bool, upcast: bool) -> None:
    m, k = x.shape
    n = w.shape[0]
    block_m, block_n, warps, stages = _tiles(m, x.dtype)
    # NOTE: 1-byte operands take 128 columns a step (the int8 / fp8 MMA's K is 32); the
    # weight-only path widens its weight tile in registers, so it steps 64 (fp32: 32, as W4A16)
    block_k = 128 if not weight_only else 32 if x.dtype == torch.float32 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    # NOTE: sm_90's fp8 MMA adds its products in a narrower accumulator than float32, and
    # Triton's default there never promotes (on an H100 a K = 200 product missed the float32
    # accumulation bound of the tests); 32, one fp8 MMA's K, adds every MMA's partial sum into
    # the float32 accumulator
    imprecise = _FP8_MMA_K if x.dtype == torch.float8_e4m3fn else 0
    _scaled_gemm_kernel[grid](
        x, w, x_scale, w_scale, bias, y, m, n, k,
        *x.stride(), w.stride(0), 0 if x_scale is None or x_scale.numel() == 1 else 1,
        0 if w_scale.numel() == 1 else 1, y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, WEIGHT_ONLY=weight_only,
        DOT_PRECISION=_dot_precision(upcast, x), UPCAST=upcast, IMPRECISE_ACC=imprecise,
        num_warps=warps, num_stages=stages,
    )


def w8a8_gemm(
    x: torch.Tensor,                  # [M, K] float16 / bfloat16 / float32
    weight: torch.Tensor,             # [N, K] int8
    weight_scale: torch.Tensor,       # [N] float32 (per output channel)
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:                    # [M, N] x's dtype
    """y = (x_q @ w^T in int32) * x_scale[m] * w_scale[n] + bias, x_q from scaled_int8_quant(x)."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_x(x, k, f"weight {list(weight.shape)} has K = {k}")
    _check_rows(weight, "weight", (n, k), (torch.int8,))
    _check_rows(weight_scale, "weight_scale", (n,), (torch.float32,))
    _check_bias_device(x, n, bias, weight, weight_scale)
    y = _out(x, n)
    if x.shape[0] == 0 or n == 0:
        return y
    x_q, x_scale = scaled_int8_quant(x)
    _launch_scaled(x_q, weight, x_scale, weight_scale, bias, y, False, paged_attention.upcast_operands(x))
    return y


FP8_ACTIVATIONS = ("tensor", "token", "none")


def fp8_mma(device: torch.device) -> bool:
    """Whether fp8_gemm multiplies in fp8 on this device: CUDA sm_89+ (fp8 MMA); the
    interpreter runs the fp8 path too (pass `arch` to pick the other)."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_gemm(
    x: torch.Tensor,                  # [M, K] float16 / bfloat16 / float32
    weight: torch.Tensor,             # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,       # [1] (per tensor) or [N] (per channel) float32
    bias: torch.Tensor | None = None,  # [N]
    *,
    activations: str = "tensor",      # x cast to e4m3 per "tensor" / per "token", or "none" (W8A16)
    arch: int | None = None,          # compute capability as 80, 90...; None: x's device
) -> torch.Tensor:                    # [M, N] x's dtype
    """sm_89+: y = (x_q @ w^T) * x_scale * w_scale + bias, x_q = scaled_fp8_quant(x) per tensor or
    per token; below sm_89, or activations "none": y = (x @ w^T) * w_scale + bias, the e4m3
    weight widened exactly to x's dtype."""
    if activations not in FP8_ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(FP8_ACTIVATIONS)}, got {activations!r}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {tuple(weight.shape)}")
    n, k = weight.shape
    _check_x(x, k, f"weight {list(weight.shape)} has K = {k}")
    _check_rows(weight, "weight", (n, k), (torch.float8_e4m3fn,))
    if weight_scale.dim() != 1 or weight_scale.shape[0] not in (1, n) or weight_scale.dtype != torch.float32:
        raise ValueError(f"weight_scale must be float32 [1] or [{n}], got "
                         f"{str(weight_scale.dtype).removeprefix('torch.')} {list(weight_scale.shape)}")
    _check_bias_device(x, n, bias, weight, weight_scale)
    y = _out(x, n)
    if x.shape[0] == 0 or n == 0:
        return y
    fp8 = activations != "none" and (fp8_mma(x.device) if arch is None else arch >= 89)
    if fp8:
        x_q, x_scale = scaled_fp8_quant(x, per_token=activations == "token")
        _launch_scaled(x_q, weight, x_scale, weight_scale, bias, y, False, paged_attention.upcast_operands(x))
    else:
        _launch_scaled(x, weight.view(torch.uint8), None, weight_scale, bias, y, True,
                       paged_attention.upcast_operands(x))
    return y
