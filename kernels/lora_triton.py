"""Triton SGMV shrink / expand for LoRA: the CUDA form of `kvmesh.kernels.lora_ops`.

A program owns BLOCK_M rows of one segment (tokens of one adapter slot) and BLOCK_N output
columns; it gathers its x rows through `rows` and reads its slot's weight tile. The grid is
(segments, row tiles of the longest segment, column tiles); tiles past a segment's end return
at once. Expand adds into the projection's output in place: each (row, column) belongs to one
program (a token is in one segment), so the read-add-write needs no atomics.

    shrink:  y [n, R] fp32  = x[rows] [n, K] @ A[slot] [R, K]^T
    expand:  out[rows] [n, N] += y [n, R] @ B[slot] [N, R]^T
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels.paged_attention import dot_precision, upcast_operands


@triton.jit
def _sgmv_kernel(
    x_ptr,              # [num_x_rows, K]: shrink: the layer input x [T, K]; expand: y [n, R]
    w_ptr,              # [L, N, K]: shrink: A [L, R, K]; expand: B [L, N, R]
    out_ptr,            # [num_out_rows, N]: shrink: y [n, R] fp32; expand: the output [T, N]
    rows_ptr,           # [n] int64 batch rows of the LoRA tokens, grouped by slot
    seg_start_ptr,      # [S + 1] int32 segment bounds in rows
    seg_slot_ptr,       # [S] int32 slot of each segment
    N, K,
    stride_xm, stride_xk,
    stride_wl, stride_wn, stride_wk,
    stride_om, stride_on,
    EXPAND: tl.constexpr,       # False: read x through rows, write out by position; True: the reverse, adding
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,       # fp32 tl.dot operands (interpreter); else native 16-bit operands
):
    seg = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(seg_start_ptr + seg)
    end = tl.load(seg_start_ptr + seg + 1)
    if start + pid_m * BLOCK_M >= end:
        return
    slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
    offs_m = start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < end
    batch_row = tl.load(rows_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    if EXPAND:
        x_row = offs_m.to(tl.int64)
        out_row = batch_row
    else:
        x_row = batch_row
        out_row = offs_m.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_row[:, None] * stride_xm + offs_k[None, :] * stride_xk            # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + slot * stride_wl + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        else:
            a = a.to(b.dtype)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    o_ptrs = out_ptr + out_row[:, None] * stride_om + offs_n[None, :] * stride_on
    mask = m_mask[:, None] & n_mask[None, :]
    if EXPAND:
        acc += tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x, w, rows, seg_starts, seg_slots, k_dim: int) -> None:
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[k_dim]:
        raise ValueError(f"shape mismatch: input {tuple(x.shape)}, stacked weights {tuple(w.shape)}")
    if rows.dtype != torch.int64 or seg_starts.dtype != torch.int32 or seg_slots.dtype != torch.int32:
        raise ValueError("rows must be int64, seg_starts and seg_slots int32")
    if seg_starts.shape[0] != seg_slots.shape[0] + 1:
        raise ValueError(f"seg_starts [{seg_starts.shape[0]}] must be seg_slots [{seg_slots.shape[0]}] + 1")
    if len({t.device for t in (x, w, rows, seg_starts, seg_slots)}) != 1:
        raise ValueError("every tensor must be on one device")


def _launch(x, w, out, rows, seg_starts, seg_slots, max_seg_len, n, k, expand, block_m, block_n, block_k):
    grid = (seg_slots.shape[0], triton.cdiv(max(max_seg_len, 1), block_m), triton.cdiv(n, block_n))
    _sgmv_kernel[grid](
        x, w, out, rows, seg_starts, seg_slots, n, k,
        *x.stride(), *w.stride(), *out.stride(),
        EXPAND=expand, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(w.dtype), UPCAST=upcast_operands(x), num_warps=4, num_stages=2,
    )


def _block_m(max_seg_len: int) -> int:
    # NOTE: decode segments hold a few tokens: 16-row tiles waste less; prefill fills 64
    return 16 if max_seg_len <= 16 else 32 if max_seg_len <= 32 else 64


def sgmv_shrink(x: torch.Tensor,           # [T, K]
                a: torch.Tensor,           # [L, R, K]
                rows: torch.Tensor,        # [n] int64
                seg_starts: torch.Tensor,  # [S + 1] int32
                seg_slots: torch.Tensor,   # [S] int32
                max_seg_len: int,          # the longest segment (host value: sizes the grid)
                ) -> torch.Tensor:         # [n, R] float32
    _check(x, a, rows, seg_starts, seg_slots, 2)
    r, k = a.shape[1], a.shape[2]
    y = torch.empty((rows.shape[0], r), dtype=torch.float32, device=x.device)
    _launch(x, a, y, rows, seg_starts, seg_slots, max_seg_len, r, k, False,
            _block_m(max_seg_len), 16, 32)
    return y


def sgmv_expand(y: torch.Tensor,           # [n, R] float32
                b: torch.Tensor,           # [L, N, R]
                out: torch.Tensor,         # [T, N] added to in place
                rows: torch.Tensor,        # [n] int64
                seg_starts: torch.Tensor,  # [S + 1] int32
                seg_slots: torch.Tensor,   # [S] int32
                max_seg_len: int,
                ) -> None:
    _check(y, b, rows, seg_starts, seg_slots, 2)
    if out.dim() != 2 or out.shape[1] != b.shape[1]:
        raise ValueError(f"out {tuple(out.shape)} must be [T, {b.shape[1]}]")
    n, r = b.shape[1], b.shape[2]
    _launch(y, b, out, rows, seg_starts, seg_slots, max_seg_len, n, r, True,
            _block_m(max_seg_len), 64, 16)
