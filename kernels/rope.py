"""Triton rotary embedding (NeoX rotate-half), query and key in one launch.

One program per (token, tile of heads): the token's cos/sin row is read once and applied to its
query heads and key heads of that tile. Outputs are new tensors (the inputs are often strided
views of the fused QKV projection; the strides are honoured, nothing is copied first).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, heads, num_heads, cos, sin, offs, half_mask,
                  stride_st, stride_sh, stride_sd, stride_dt, stride_dh, stride_dd,
                  HALF: tl.constexpr):
    mask = (heads[:, None] < num_heads) & half_mask[None, :]
    src = src_ptr + token * stride_st + heads[:, None] * stride_sh + offs[None, :] * stride_sd
    x1 = tl.load(src, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = tl.load(src + HALF * stride_sd, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_dt + heads[:, None] * stride_dh + offs[None, :] * stride_dd
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF * stride_dd, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rope_kernel(
    positions_ptr,      # [num_tokens] int32/int64
    q_ptr,              # [num_tokens, num_heads, head_dim]
    k_ptr,              # [num_tokens, num_kv_heads, head_dim]
    q_out_ptr,          # [num_tokens, num_heads, head_dim]
    k_out_ptr,          # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,        # [max_position, head_dim] fp32: cos in [:, :half], sin in [:, half:]
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_qot, stride_qoh, stride_qod,
    stride_kot, stride_koh, stride_kod,
    stride_cs,
    num_heads, num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,   # HALF padded to a power of two
    BLOCK_H: tl.constexpr,      # heads per program
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    half_mask = offs < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs, mask=half_mask, other=0.0)[None, :]
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs, mask=half_mask, other=0.0)[None, :]
    _rotate_heads(q_ptr, q_out_ptr, token, heads, num_heads, cos, sin, offs, half_mask,
                  stride_qt, stride_qh, stride_qd, stride_qot, stride_qoh, stride_qod, HALF)
    _rotate_heads(k_ptr, k_out_ptr, token, heads, num_kv_heads, cos, sin, offs, half_mask,
                  stride_kt, stride_kh, stride_kd, stride_kot, stride_koh, stride_kod, HALF)


def rotary_embedding(
    positions: torch.Tensor,      # [num_tokens] int32/int64
    query: torch.Tensor,          # [num_tokens, num_heads, head_dim] (any strides)
    key: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim] (any strides)
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: cos [:, :d/2], sin [:, d/2:]
    *,
    block_h: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style RoPE over the full head_dim; returns new (query, key) tensors."""
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(f"query and key must be [num_tokens, heads, head_dim], "
                         f"got {tuple(query.shape)} and {tuple(key.shape)}")
    num_tokens, num_heads, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} does not match query {tuple(query.shape)}")
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for rotate-half RoPE, got {head_dim}")
    if query.dtype not in _FLOAT_DTYPES or key.dtype != query.dtype:
        raise ValueError(f"query/key must share a float dtype, got {query.dtype} and {key.dtype}")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 \
            or cos_sin_cache.shape[1] != head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be a row-contiguous fp32 [max_position, "
                         f"head_dim={head_dim}], got {tuple(cos_sin_cache.shape)} "
                         f"{cos_sin_cache.dtype}")
    if positions.dtype not in (torch.int32, torch.int64) or positions.shape != (num_tokens,):
        raise ValueError(f"positions must be int32/int64 [num_tokens={num_tokens}], "
                         f"got {tuple(positions.shape)} {positions.dtype}")
    if len({t.device for t in (positions, query, key, cos_sin_cache)}) != 1:
        raise ValueError("positions, query, key and cos_sin_cache must be on one device")
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    num_kv_heads = key.shape[1]
    most = max(num_heads, num_kv_heads)
    block_h = block_h or triton.next_power_of_2(most)
    if block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two, got {block_h}")
    half = head_dim // 2
    _rope_kernel[(num_tokens, triton.cdiv(most, block_h))](
        positions, query, key, q_out, k_out, cos_sin_cache,
        *query.stride(), *key.stride(), *q_out.stride(), *k_out.stride(),
        cos_sin_cache.stride(0), num_heads, num_kv_heads,
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_H=block_h,
        num_warps=num_warps,
    )
    return q_out, k_out
