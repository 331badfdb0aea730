"""Triton cache write: store this step's K/V into their paged-cache slots.

One program per (token, tile of KV heads); a slot of -1 (a padding token) stores nothing. An
8-bit float cache (`--kv-cache-dtype fp8`) is written as its codes (`fp8_codes.py`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.kernels.fp8_codes import cache_bytes, kv_code, narrow_to_codes
from kvmesh.kernels.kv_cache_dtype import is_fp8

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,        # [num_tokens, num_kv_heads, head_dim]
    value_ptr,      # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,    # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,    # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_ptr,       # [num_tokens] int32/int64, -1 = skip
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcb, stride_kcs, stride_kch, stride_kcd,
    stride_vcb, stride_vcs, stride_vch, stride_vcd,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_CODE: tl.constexpr,      # 0: the caches hold key's dtype; 1 / 2: e4m3fn / e5m2 codes (bytes)
):
    tok = tl.program_id(0)
    head_tile = tl.program_id(1)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:        # a padding token
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)

    k = tl.load(key_ptr + tok * stride_kt + heads[:, None] * stride_kh
                + dims[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + tok * stride_vt + heads[:, None] * stride_vh
                + dims[None, :] * stride_vd, mask=mask)
    if KV_CODE != 0:
        k = narrow_to_codes(k.to(tl.float32), KV_CODE)
        v = narrow_to_codes(v.to(tl.float32), KV_CODE)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs
    tl.store(k_dst + heads[:, None] * stride_kch + dims[None, :] * stride_kcd, k, mask=mask)
    tl.store(v_dst + heads[:, None] * stride_vch + dims[None, :] * stride_vcd, v, mask=mask)


def _check_write_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    if key.dim() != 3 or value.shape != key.shape:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim], "
                         f"got {tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key heads/head_dim {tuple(key.shape[1:])} do not match the cache's "
                         f"{tuple(k_cache.shape[2:])}")
    if key.dtype != value.dtype or k_cache.dtype != v_cache.dtype or key.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"key and value must share a float dtype and the caches one dtype, got "
                         f"{key.dtype}, {value.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.dtype != key.dtype and not is_fp8(k_cache.dtype):
        raise ValueError(f"the caches hold the keys' dtype ({key.dtype}) or 8-bit float codes, "
                         f"got {k_cache.dtype}")
    if slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]:
        raise ValueError(f"slot_mapping must be [num_tokens={key.shape[0]}], "
                         f"got {tuple(slot_mapping.shape)}")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")


def write_kv_cache(
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim] (any strides)
    value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim] (any strides)
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int32/int64; -1 marks a padding token to skip
    *,
    block_h: int | None = None,
    num_warps: int = 4,
) -> None:
    """Store each token's K/V in its slot (block_id * block_size + offset); -1 slots are skipped.
    Caches in an 8-bit float dtype get the codes `kv_cache_dtype.to_cache_codes` gives.

    Slots are not bounds-checked on the device (that would need a sync): the caller's block
    manager owns them. `block_h` is the number of KV heads per program (default: all of them).
    """
    _check_write_args(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    block_h = block_h or triton.next_power_of_2(num_kv_heads)
    if block_h & (block_h - 1):
        raise ValueError(f"block_h must be a power of two, got {block_h}")
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_cache_kernel[grid](
        key, value, cache_bytes(k_cache), cache_bytes(v_cache), slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=triton.next_power_of_2(head_dim),
        KV_CODE=kv_code(k_cache.dtype),
        num_warps=num_warps,
    )
