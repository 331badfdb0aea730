"""The CPU backend: the reference ops, with attention, the KV-cache write, RMSNorm, RoPE, SiLU·up
and the greedy argmax on C++ kernels, in float32 and bfloat16 (bf16 storage, float32 sums).

`get_ops("cpu")` returns this module (the default on CPU when the kernels build here, see
`kvmesh.kernels.cpu_kernels`). Every query token of a step, decode or prefill chunk, is one row
of `paged_attention_rows`, which reads K/V where they lie in the paged cache: no gather into
padded copies, no masks (a row's causal limit is its own context length), and each key is
loaded once for the whole GQA group of query heads. On a CPU with AMX the kernel itself takes a
bf16 chunk's consecutive rows in runs onto tiles (csrc/attention_amx.cpp). Anything the kernel does not cover (other
dtypes, devices) runs the reference as is. A bfloat16 model's activations and cache stay bf16 from
one op to the next: no per-step dtype or layout copies.

Rows are ordered so that the thread pool's contiguous split gives each thread about the same
number of keys: a prefill chunk's last query sees the whole context, its first almost none.

RMSNorm (with the residual add) and RoPE are one pass each over their tensors, where the torch
reference runs five to eight elementwise ops with temporaries; a decode step's small tensors run
on the calling thread (no parallel region per op). RoPE rounds exactly as the reference; RMSNorm
sums the squares in another order (within an ulp or two of it). In bfloat16 every kernel rounds
where the reference's torch ops round (the residual sum, the normalised value, each product).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.kernels import reference
from kvmesh.kernels.cpu_kernels import load
from kvmesh.kernels.kv_cache_dtype import FP8_DTYPES
from kvmesh.kernels.metadata import AttentionMetadata
from kvmesh.kernels.reference import (  # noqa: F401 - the backend's other ops, unchanged
    fused_moe,
    select_experts,
)

# The dtypes the C++ kernels take (bf16 storage, float32 arithmetic).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class _RowPlan:
    rows: torch.Tensor                          # [T, 3] int64: (token, sequence, context length)


# NOTE: as the reference's plan cache: built for the first layer of a step, reused by the
# others; keyed by metadata identity (strong references, so an id is never reused).
_plans: list[tuple[AttentionMetadata, _RowPlan]] = []
_PLANS = 4


def _plan(meta: AttentionMetadata) -> _RowPlan:
    for m, plan in _plans:
        if m is meta:
            return plan
    plan = _RowPlan(attention_rows(meta.query_lens_cpu, meta.seq_lens_cpu))
    _plans.append((meta, plan))
    del _plans[:-_PLANS]
    return plan


def attention_rows(query_lens: list[int], seq_lens: list[int]) -> torch.Tensor:
    """[T, 3] int64 (token, sequence, context length), in a thread-balanced order.

    Query token i of a sequence with q new tokens and s tokens in all sees s - q + i + 1 keys.
    The order pairs the longest rows with the shortest ([longest, shortest, 2nd longest, ...]),
    so any contiguous half holds about half of the keys."""
    q = torch.tensor(query_lens, dtype=torch.int64)
    s = torch.tensor(seq_lens, dtype=torch.int64)
    total = int(q.sum())
    seq = torch.repeat_interleave(torch.arange(len(query_lens), dtype=torch.int64), q)
    tok = torch.arange(total, dtype=torch.int64)
    first = torch.cumsum(q, 0) - q                       # each sequence's first token
    ctx = (s - q)[seq] + (tok - first[seq]) + 1
    order = torch.argsort(ctx, descending=True, stable=True)
    zig = torch.empty_like(order)
    half = (total + 1) // 2
    zig[0::2] = order[:half]
    zig[1::2] = order[half:].flip(0)
    return torch.stack([tok, seq, ctx], dim=1)[zig].contiguous()


def kernel_applies(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The C++ kernel reads caches in the query's dtype and 8-bit float caches (--kv-cache-dtype)."""
    return (query.device.type == "cpu" and query.dtype in KERNEL_DTYPES and query.dim() == 3
            and query.stride(2) == 1 and k_cache.dtype == v_cache.dtype
            and (k_cache.dtype == query.dtype or k_cache.dtype in FP8_DTYPES)
            and k_cache.is_contiguous() and v_cache.is_contiguous() and load() is not None)


def write_kv_cache(
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim], unit stride along head_dim
    value: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; -1 marks a padding token to skip
) -> None:
    """The reference's contract: each token's K/V into its slot, one pass, no mask or gather
    (the reference's `-1` check costs a host sync and a masked copy per layer); into an 8-bit
    float cache, the reference's codes (nearest even, saturated)."""
    ext = load()
    if (ext is None or key.device.type != "cpu" or key.dim() != 3 or key.dtype not in KERNEL_DTYPES
            or key.dtype != value.dtype or k_cache.dtype != v_cache.dtype
            or not (k_cache.dtype == key.dtype or k_cache.dtype in FP8_DTYPES)
            or key.stride(2) != 1 or value.stride(2) != 1 or slot_mapping.dtype != torch.int64
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())):
        return reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    ext.write_kv_cache(key, value, k_cache, v_cache, slot_mapping.contiguous())


def paged_attention(
    query: torch.Tensor,        # [num_tokens, num_heads, head_dim], packed by meta.query_start_loc
    k_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,      # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:              # [num_tokens, num_heads, head_dim]
    """The reference's contract (see `kvmesh.kernels.reference.paged_attention`)."""
    if meta.num_seqs == 0 or not kernel_applies(query, k_cache, v_cache):
        return reference.paged_attention(query, k_cache, v_cache, meta, scale, softcap)
    plan = _plan(meta.with_window(0))
    out = torch.empty(query.shape, dtype=query.dtype)
    load().paged_attention_rows(query, k_cache, v_cache, meta.block_tables, plan.rows, out,
                                float(scale), int(meta.sliding_window), float(softcap))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The reference's contract: norm(x) or (norm(x + residual), x + residual), float32 math."""
    ext = load()
    if (ext is None or x.dtype not in KERNEL_DTYPES or x.device.type != "cpu" or x.dim() != 2
            or weight.dtype != x.dtype
            or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape))):
        return reference.rms_norm(x, weight, eps, residual)
    res = None if residual is None else residual.contiguous()
    out, new_residual = ext.rms_norm(x.contiguous(), weight.contiguous(), float(eps), res)
    return out, (None if residual is None else new_residual)


def rotary_embedding(
    positions: torch.Tensor,    # [num_tokens] int64
    query: torch.Tensor,        # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,          # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: cos in [:, :d/2], sin in [:, d/2:]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's contract (NeoX rotate-half), bit for bit in float32 and bfloat16."""
    ext = load()
    if (ext is None or query.dtype not in KERNEL_DTYPES or key.dtype != query.dtype
            or query.device.type != "cpu" or query.dim() != 3 or key.dim() != 3
            or query.stride(2) != 1 or key.stride(2) != 1 or positions.dtype != torch.int64
            or cos_sin_cache.dtype != torch.float32):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache)
    q, k = ext.rotary_embedding(positions.contiguous(), query, key, cos_sin_cache.contiguous())
    return q, k


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1)'s answer for [R, V] (first maximum; a NaN counts as the max),
    on the C++ kernel for CPU float32 rows (torch's CPU argmax is ~20x slower than its amax)."""
    ext = load()
    if (ext is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.shape[1] == 0 or logits.stride(1) != 1):
        return logits.argmax(dim=-1)
    return ext.argmax_rows(logits)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(x[:, :I]) * x[:, I:] of a fused gate|up projection [T, 2I] -> [T, I], one pass on the
    C++ kernel for CPU float32 / bfloat16 (within a few ulp of torch's silu and mul); torch
    elsewhere."""
    ext = load()
    if (ext is None or x.device.type != "cpu" or x.dtype not in KERNEL_DTYPES or x.dim() != 2
            or x.shape[1] % 2 or x.stride(1) != 1):
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    return ext.silu_and_mul(x)
