"""The CPU backend: the reference ops, with decode attention on the C++ kernel.

`get_ops("cpu")` returns this module (the default on CPU when the kernels build here, see
`kvmesh.kernels.cpu_kernels`). Every decode row (query length 1) of a step, alone or mixed with
prefill chunks, goes to `paged_attention_rows`, which reads K/V where they lie in the paged
cache: no gather into padded copies, no masks, one pass over each sequence's keys and values
per KV head. Prefill chunks keep the reference path (a gather of their context, then SDPA, whose
blocked GEMMs beat a per-row kernel once a chunk has many queries). Anything the kernel does not
cover (other dtypes, devices) runs the reference as is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvmesh.kernels import reference
from kvmesh.kernels.cpu_kernels import load
from kvmesh.kernels.metadata import AttentionMetadata
from kvmesh.kernels.reference import (  # noqa: F401 - the backend's other ops, unchanged
    fused_moe,
    rms_norm,
    rotary_embedding,
    select_experts,
    write_kv_cache,
)


@dataclass(slots=True)
class _RowPlan:
    rows: torch.Tensor                          # [R, 3] int64: (token, sequence, context length)
    prefills: list[tuple[int, int, int, int]]   # (seq, first token, last token + 1, seq_len)


# NOTE: as the reference's plan cache: built for the first layer of a step, reused by the
# others; keyed by metadata identity (strong references, so an id is never reused).
_plans: list[tuple[AttentionMetadata, _RowPlan]] = []
_PLANS = 4


def _plan(meta: AttentionMetadata) -> _RowPlan:
    for m, plan in _plans:
        if m is meta:
            return plan
    rows: list[tuple[int, int, int]] = []
    prefills: list[tuple[int, int, int, int]] = []
    start = 0
    for s, (q_len, s_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        if q_len == 1:
            rows.append((start, s, s_len))
        elif q_len > 0:
            prefills.append((s, start, start + q_len, s_len))
        start += q_len
    plan = _RowPlan(torch.tensor(rows, dtype=torch.int64).reshape(len(rows), 3), prefills)
    _plans.append((meta, plan))
    del _plans[:-_PLANS]
    return plan


def kernel_applies(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and query.dtype == torch.float32 and query.dim() == 3
            and query.stride(2) == 1 and k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.is_contiguous() and v_cache.is_contiguous() and load() is not None)


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
    if plan.rows.shape[0]:
        load().paged_attention_rows(query, k_cache, v_cache, meta.block_tables, plan.rows, out,
                                    float(scale), int(meta.sliding_window), float(softcap))
    for s, lo, hi, s_len in plan.prefills:
        table = meta.block_tables[s]
        k = reference._gather_context(k_cache, table, s_len)
        v = reference._gather_context(v_cache, table, s_len)
        out[lo:hi] = reference._extend_one(query[lo:hi], k, v, scale, meta.sliding_window, softcap)
    return out
