"""Triton fused mixture-of-experts: one grouped GEMM over (expert, token-block) tiles, used twice.

    pairs (token, k) ──sort by expert, pad each expert to BLOCK_M──▶ sorted_ids, block_expert
    x [T, H] ──grouped GEMM with w13[e]──▶ [T*K, 2I] ──silu(gate) * up──▶ [T*K, I]
             ──grouped GEMM with w2[e], × routing weight──▶ [T*K, H] ──sum over k──▶ [T, H]

A program owns BLOCK_M sorted (token, k) pairs of one expert and BLOCK_N output columns; it
gathers its A rows through `sorted_ids` (row = pair // top_k for the first GEMM, the pair itself
for the second) and reads its expert's weight tile `b[e]`. The alignment is computed on the
device without a host sync: the grid is an upper bound on the number of padded blocks and
blocks past the last expert's padding (block_expert = -1) return at once.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvmesh.kernels.paged_attention import dot_precision, upcast_operands


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,              # [num_a_rows, K]: x [T, H] (A_DIV = top_k) or the activation [T*top_k, I] (A_DIV = 1)
    b_ptr,              # [num_experts, N, K]: w13 [E, 2I, H] or w2 [E, H, I]
    c_ptr,              # [T*top_k, N]
    weights_ptr,        # [T*top_k] float32 routing weight per pair (read only if MUL_WEIGHT)
    sorted_ids_ptr,     # [max_padded] int32 pair ids grouped by expert; padding holds num_pairs
    block_expert_ptr,   # [max_padded // BLOCK_M] int32 expert of each tile; -1 past the end
    num_pairs, N, K,
    stride_am, stride_ak,
    stride_be, stride_bn, stride_bk,
    stride_cm, stride_cn,
    A_DIV: tl.constexpr,        # A row of a pair = pair // A_DIV
    MUL_WEIGHT: tl.constexpr,   # scale each output row by its pair's routing weight
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,       # fp32 tl.dot operands (interpreter); else native 16-bit operands
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)
    row_mask = pair < num_pairs
    a_row = (pair // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak          # [BLOCK_M, BLOCK_K]
    b_ptrs = (b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn
              + offs_k[:, None] * stride_bk)                                          # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pair, mask=row_mask, other=0.0)
        acc = acc * w[:, None]
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def default_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: the smallest of 16 / 32 / 64 that holds an expert's average share of pairs.

    NOTE: decode batches give most experts a handful of pairs, and every expert with any pads to
    a whole tile, so small tiles waste less; prefill batches fill 64-row tiles.
    """
    avg = num_pairs / max(num_experts, 1)
    return 16 if avg <= 16 else 32 if avg <= 32 else 64


def moe_align_block_size(
    topk_ids: torch.Tensor,     # [num_tokens, top_k] int32/int64
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # (sorted_ids [max_padded] int32, block_expert [max_padded // block_m] int32)
    """Pair ids (t * top_k + k) grouped by expert, each expert's run padded to a multiple of block_m.

    Padding entries hold num_pairs (masked in the kernel). Sized by an upper bound that needs no
    device sync: every expert with pairs adds fewer than block_m padding rows, and at most
    min(num_experts, num_pairs) experts have any.
    """
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))     # (bincount would sync on CUDA)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)                                  # padded run of expert e: [ends - padded, ends)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_padded = triton.cdiv(bound, block_m) * block_m
    sorted_ids = torch.full((max_padded,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids[(ends - padded)[sorted_experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(0, max_padded, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    return sorted_ids, block_expert


def _check_args(x, w13, w2, topk_weights, topk_ids, tiles) -> None:
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T, H], w13 [E, 2I, H], w2 [E, H, I]; got {tuple(x.shape)}, "
                         f"{tuple(w13.shape)}, {tuple(w2.shape)}")
    num_experts, two_inter, hidden = w13.shape
    if two_inter % 2 or hidden != x.shape[1] or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"inconsistent MoE shapes: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} (want w13 [E, 2I, H] and w2 [E, H, I])")
    if not (x.dtype == w13.dtype == w2.dtype):
        raise ValueError(f"x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids and topk_weights must both be [num_tokens={x.shape[0]}, top_k], "
                         f"got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights must be float32, got {topk_weights.dtype}")
    if len({t.device for t in (x, w13, w2, topk_weights, topk_ids)}) != 1:
        raise ValueError("x, w13, w2, topk_weights and topk_ids must be on one device")
    for name, val in tiles.items():
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {val}")


def _grouped_gemm(a, b, c, weights, sorted_ids, block_expert, num_pairs, a_div, mul_weight,
                  block_m, block_n, block_k, num_warps, num_stages) -> None:
    n, k = b.shape[1], b.shape[2]
    grid = (block_expert.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, b, c, weights, sorted_ids, block_expert, num_pairs, n, k,
        *a.stride(), *b.stride(), *c.stride(),
        A_DIV=a_div, MUL_WEIGHT=mul_weight, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(a.dtype), UPCAST=upcast_operands(a),
        num_warps=num_warps, num_stages=num_stages,
    )


def fused_moe(
    x: torch.Tensor,             # [num_tokens, hidden] (any strides)
    w13: torch.Tensor,           # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,            # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,      # [num_tokens, top_k] int32/int64
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:               # [num_tokens, hidden]
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)), e = topk_ids[t, k] (reference.fused_moe)."""
    num_tokens, top_k = topk_ids.shape
    num_experts, hidden = w13.shape[0], x.shape[1]
    bm = default_block_m(num_tokens * top_k, num_experts) if block_m is None else block_m
    _check_args(x, w13, w2, topk_weights, topk_ids, {"block_m": bm, "block_n": block_n, "block_k": block_k})
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    sorted_ids, block_expert = moe_align_block_size(topk_ids, num_experts, bm)
    weights = topk_weights.reshape(-1).contiguous()
    tiles = dict(block_m=bm, block_n=block_n, block_k=block_k, num_warps=num_warps, num_stages=num_stages)
    gate_up = torch.empty((num_pairs, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, weights, sorted_ids, block_expert, num_pairs, top_k, False, **tiles)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up                                                # [T*K, I]
    # NOTE: the weighted expert outputs stay float32 until the sum over k, as HF scales them
    # in float32 (its routing weights are float32) before accumulating.
    down = torch.empty((num_pairs, hidden), dtype=torch.float32, device=x.device)
    _grouped_gemm(act, w2, down, weights, sorted_ids, block_expert, num_pairs, 1, True, **tiles)
    return down.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
