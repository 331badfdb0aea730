"""Inputs shared by the 8-bit KV cache tests of both kernel families (C++ and Triton)."""
from __future__ import annotations

import torch
from paged_batch import paged_batch

from kvmesh.kernels.kv_cache_dtype import to_cache_codes
from kvmesh.kernels.metadata import AttentionMetadata


def hard_values(cache_dtype: torch.dtype, random: int = 20000) -> torch.Tensor:
    """float32 values a write must code exactly as torch does: every code's value, the midpoints
    between neighbouring codes (ties go to even), values just either side of them, subnormals,
    saturation, zeros, infinities, and `random` values of every scale."""
    codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(random, generator=g) * torch.exp2(torch.randint(-30, 20, (random,), generator=g).float())
    return torch.cat([finite, mids, mids.nextafter(torch.tensor(float("inf"))),
                      mids.nextafter(torch.tensor(float("-inf"))), wide,
                      torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 1e30, -1e30, 1e-30])])


def every_code_case(cache_dtype: torch.dtype, dim: int = 64):
    """(k_cache, v_cache, meta): one single-token sequence per row of `dim` values, every finite
    code of the format once in some value row. With one key the softmax weight is exactly 1, so
    attention's output is the value rows as the kernel widened them."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[torch.isfinite(codes.view(cache_dtype).float())]
    rows = -(-codes.numel() // dim)
    padded = torch.cat([codes, torch.zeros(rows * dim - codes.numel(), dtype=torch.uint8)])
    v_cache = padded.view(rows, 1, 1, dim).view(cache_dtype).contiguous()
    k_cache = torch.zeros(rows, 1, 1, dim, dtype=cache_dtype)
    meta = AttentionMetadata.build([1] * rows, [1] * rows, [[i] for i in range(rows)], 1)
    return k_cache, v_cache, meta


def fp8_batch(query_lens, seq_lens, cache_dtype, dtype=torch.float32, scale=3.0, **shape):
    """paged_batch's case with its K/V times `scale` stored as `cache_dtype` codes."""
    query, k, v, meta = paged_batch(query_lens, seq_lens, dtype=torch.float32, **shape)
    return (query.to(dtype), to_cache_codes(k * scale, cache_dtype),
            to_cache_codes(v * scale, cache_dtype), meta)
