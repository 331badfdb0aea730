"""The Triton backend: the reference's ops (attention, cache write, norm, RoPE, MoE) with the same signatures, on Triton kernels.

`kvmesh.kernels.ops.get_ops("triton")` returns this module; the model calls
`ops.paged_attention(...)` etc. without knowing the backend. Tile sizes are the kernels'
GPU defaults; the kernel modules take them as keyword parameters for tuning and tests.
"""
from __future__ import annotations

import torch

from kvmesh.kernels.cache_ops import write_kv_cache as _write_kv_cache
from kvmesh.kernels.flash_prefill import default_impl, prefill_attention
from kvmesh.kernels.fused_moe import fused_moe as _fused_moe
from kvmesh.kernels.metadata import AttentionMetadata
from kvmesh.kernels.norm import rms_norm as _rms_norm
from kvmesh.kernels.paged_attention import paged_decode_attention
from kvmesh.kernels.prefill_attention import unified_attention
from kvmesh.kernels.rope import rotary_embedding as _rotary_embedding


def write_kv_cache(
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padding token to skip
) -> None:
    """Store each token's K/V in its slot (block_id * block_size + offset)."""
    _write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,        # [num_tokens, num_heads, head_dim], packed by meta.query_start_loc
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:              # [num_tokens, num_heads, head_dim]
    """Causal attention of a mixed batch over the paged cache (write_kv_cache first).

    An all-decode batch goes to the split-K decode kernel; anything else (prefill chunks,
    prefix hits, decodes mixed in) to the unified varlen kernel, except that on CUDA the chunks
    with no cached prefix go to torch's flash attention (`flash_prefill.py`).
    `meta.sliding_window` and `softcap` as in the reference.
    """
    if meta.num_seqs == 0:
        return torch.empty_like(query)
    if meta.max_query_len == 1 and query.shape[0] == meta.num_seqs:
        # the runner's split choice and preallocated partials (else the kernel's own rule)
        launch = meta.decode_launch
        split = {} if launch is None else dict(num_splits=launch.num_splits,
                                               min_split_tokens=launch.min_split_tokens,
                                               workspace=launch.workspace)
        return paged_decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      meta.max_seq_len, scale, sliding_window=meta.sliding_window,
                                      softcap=softcap, **split)
    # NOTE: prefill chunks with no cached prefix go to torch's flash kernel where it applies
    # (CUDA, 16-bit, no soft-cap); the rest of the step stays on the unified kernel
    out = prefill_attention(query, k_cache, v_cache, meta, scale, softcap, unified_attention,
                            default_impl(query.device))
    if out is not None:
        return out
    return unified_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                             meta.block_tables, scale, sliding_window=meta.sliding_window, softcap=softcap)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm in float32 (as HF Llama does). With a residual: returns (norm(x + r), x + r)."""
    return _rms_norm(x, weight, eps, residual)


def rotary_embedding(
    positions: torch.Tensor,    # [num_tokens] int64
    query: torch.Tensor,        # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: cos [:, :d/2], sin [:, d/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style (rotate-half) RoPE, the layout of HF Llama / Qwen2 checkpoints."""
    return _rotary_embedding(positions, query, key, cos_sin_cache)


def fused_moe(
    x: torch.Tensor,             # [num_tokens, hidden]
    w13: torch.Tensor,           # [num_experts, 2 * inter, hidden]: gate rows, then up rows
    w2: torch.Tensor,            # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    topk_ids: torch.Tensor,      # [num_tokens, top_k] int32/int64
) -> torch.Tensor:               # [num_tokens, hidden]
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's experts e = ids[t, k]."""
    return _fused_moe(x, w13, w2, topk_weights, topk_ids)
